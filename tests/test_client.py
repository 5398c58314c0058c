"""The producer: submission, back-pressure, idempotency, reading and resuming replies.

Reply streams here are written with the protocol's own encoder, standing in for a worker's
output; the worker itself is tested end to end in test_worker*.py.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import fakeredis
import fakeredis.aioredis
import pytest
import redis
import redis.asyncio

import tokenq.producer.client as client_module
from tests.redis_fixtures import CLIENT, queue_of
from tests.waits import blocked_in_xread, named, wait_for
from tokenq.producer.client import AsyncClient, Client, make_request
from tokenq.producer.errors import ClientClosed, JobFailed, QueueFull
from tokenq.protocol import DoneEvent, ErrorEvent, Keys, TokenEvent, Usage, decode_job, encode_event


@pytest.fixture
def fake() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def write_reply(conn: redis.Redis, keys: Keys, job_id: str, events: list) -> list[str]:
    return [conn.xadd(keys.reply(job_id), encode_event(e)).decode() for e in events]


REPLY = [
    TokenEvent(0, [10, 11], "Hello"),
    TokenEvent(2, [12], ","),
    TokenEvent(3, [13], " world"),
    DoneEvent("Hello, world", "stop", [10, 11, 12, 13], Usage(5, 4)),
]


def test_submit_writes_a_protocol_entry_and_a_job_key(fake: fakeredis.FakeRedis) -> None:
    client = Client(fake, namespace="t", **CLIENT)
    job = client.submit("hi", max_tokens=5, temperature=0, metadata={"a": 1}, priority=2)
    entries = fake.xrange(queue_of("t", priority=2))
    assert len(entries) == 1
    decoded = decode_job(entries[0][1])
    assert decoded.job_id == job.id and decoded.prompt == "hi"
    assert decoded.params == {"max_tokens": 5, "temperature": 0}
    assert decoded.metadata == {"a": 1} and decoded.priority == 2
    assert decoded.submitted_at is not None
    assert job.status() == "queued"
    assert 0 < fake.ttl("t:job:" + job.id) <= 24 * 3600


def test_client_side_validation_fails_before_redis(fake: fakeredis.FakeRedis) -> None:
    client = Client(fake, namespace="t", **CLIENT)
    with pytest.raises(ValueError, match="exactly one"):
        client.submit("hi", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="unknown parameter"):
        client.submit("hi", max_token=5)
    with pytest.raises(ValueError, match="job id"):
        client.submit("hi", job_id="has space")
    assert fake.xlen(queue_of("t")) == 0


def test_decode_responses_clients_are_refused() -> None:
    with pytest.raises(ValueError, match="decode_responses"):
        Client(fakeredis.FakeRedis(decode_responses=True))


def test_queue_full_beyond_max_backlog(fake: fakeredis.FakeRedis) -> None:
    client = Client(fake, namespace="t", **CLIENT, max_backlog=3)
    for _ in range(3):
        client.submit("x")
    with pytest.raises(QueueFull) as info:
        client.submit("x")
    assert info.value.backlog == 3 and info.value.max_backlog == 3
    # All or nothing for a batch that does not fit (workers finished two of the three).
    fake.set("t:backlog:tiny:default", 1)
    with pytest.raises(QueueFull):
        client.submit_many([make_request("a"), make_request("b"), make_request("c")])
    assert fake.xlen(queue_of("t")) == 3
    assert len(client.submit_many([make_request("a"), make_request("b")])) == 2


def test_same_job_id_is_queued_once(fake: fakeredis.FakeRedis) -> None:
    client = Client(fake, namespace="t", **CLIENT)
    first = client.submit("x", job_id="order-7")
    again = client.submit("something else", job_id="order-7")
    batch = client.submit_many([make_request("y", job_id="b1"), make_request("z", job_id="b1")])
    assert not first.duplicate and again.duplicate
    assert [j.duplicate for j in batch] == [False, True]
    assert fake.xlen(queue_of("t")) == 2
    # A duplicate never counts against the backlog.
    full = Client(fake, namespace="t", **CLIENT, max_backlog=2)
    assert full.submit("x", job_id="order-7").duplicate


def test_stream_result_and_resume_from_a_middle_event(fake: fakeredis.FakeRedis) -> None:
    client = Client(fake, namespace="t", **CLIENT)
    job = client.submit("x")
    ids = write_reply(fake, client.keys, job.id, REPLY)
    events = list(job.stream())
    assert [e.event_id for e in events] == ids
    assert "".join(e.text for e in events[:-1]) == events[-1].text
    resumed = list(job.stream(after=ids[1]))
    assert [e.event_id for e in resumed] == ids[2:]
    assert job.result().text == "Hello, world"
    assert client.job(job.id).result().usage.total_tokens == 9


def test_error_event_raises_job_failed(fake: fakeredis.FakeRedis) -> None:
    client = Client(fake, namespace="t", **CLIENT)
    job = client.submit("x")
    write_reply(fake, client.keys, job.id, [ErrorEvent("invalid_params", "top_p: bad")])
    with pytest.raises(JobFailed) as info:
        job.result()
    assert info.value.code == "invalid_params"


def test_result_timeout(fake: fakeredis.FakeRedis) -> None:
    job = Client(fake, namespace="t", **CLIENT, block_ms=20).submit("x")
    with pytest.raises(TimeoutError):
        job.result(timeout=0.1)


def test_cancel_sets_the_cancel_key_and_close_stops_submits(fake: fakeredis.FakeRedis) -> None:
    client = Client(fake, namespace="t", **CLIENT)
    job = client.submit("x")
    job.cancel()
    assert fake.get(client.keys.cancel(job.id)) == b"1"
    client.close()
    with pytest.raises(ClientClosed):
        client.submit("y")


def test_stream_many_interleaves_jobs(fake: fakeredis.FakeRedis) -> None:
    client = Client(fake, namespace="t", **CLIENT)
    a, b = client.submit("a"), client.submit("b")
    write_reply(fake, client.keys, a.id, REPLY)
    write_reply(fake, client.keys, b.id, [ErrorEvent("prompt_too_long", "too long")])
    seen = [(job.id, event.type) for job, event in client.stream_many([a, b], timeout=5)]
    assert seen.count((a.id, "done")) == 1 and (b.id, "error") in seen


def test_async_client_matches_the_sync_one() -> None:
    async def scenario() -> None:
        server = fakeredis.FakeServer()
        sync = fakeredis.FakeRedis(server=server)
        client = AsyncClient(fakeredis.aioredis.FakeRedis(server=server), namespace="t", **CLIENT)
        job = await client.submit("x", job_id="aj", max_tokens=3)
        assert (await client.submit("x", job_id="aj")).duplicate
        assert await job.status() == "queued"
        ids = write_reply(sync, client.keys, job.id, REPLY)
        events = [e async for e in job.stream(after=ids[0])]
        assert [e.event_id for e in events] == ids[1:]
        assert (await job.result()).finish_reason == "stop"
        await job.cancel()
        assert sync.exists(client.keys.cancel("aj"))
        small = AsyncClient(
            fakeredis.aioredis.FakeRedis(server=server), namespace="t", **CLIENT, max_backlog=1
        )
        with pytest.raises(QueueFull):
            await small.submit("y")
        await client.aclose()

    asyncio.run(scenario())


# --- against a real server -------------------------------------------------------------


def test_concurrent_submits_of_one_id_queue_it_once(redis_url: str, redis_namespace: str) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    results: list[bool] = []
    barrier = threading.Barrier(8)

    def submit() -> None:
        barrier.wait()
        results.append(client.submit("x", job_id="same").duplicate)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] + [True] * 7
    assert client.redis.xlen(queue_of(redis_namespace)) == 1
    client.close()


def test_queue_full_and_resume_on_a_real_server(redis_url: str, redis_namespace: str) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT, max_backlog=2)
    job = client.submit("a")
    client.submit("b")
    with pytest.raises(QueueFull):
        client.submit("c")
    ids = write_reply(client.redis, client.keys, job.id, REPLY)
    assert [e.event_id for e in job.stream(after=ids[2], timeout=5)] == ids[3:]
    client.close()


def test_producer_and_submit_need_no_torch(redis_url: str, redis_namespace: str) -> None:
    script = textwrap.dedent(
        f"""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith(("torch.", "triton")):
                    raise ImportError("torch is blocked in this test")

        sys.meta_path.insert(0, NoTorch())
        import tokenq, tokenq.producer.client, tokenq.protocol, tokenq.cli
        from tokenq import AsyncClient, Client, JobFailed, QueueFull
        code = tokenq.cli.main(["submit", "hello", "--no-wait", "--job-id", "nt",
                                "--model", "tiny", "--queue-anyway",
                                  "--redis-url", "{redis_url}", "--namespace", "{redis_namespace}"])
        assert code == 0
        assert "torch" not in sys.modules
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "nt"
    conn = redis.Redis.from_url(redis_url)
    assert decode_job(conn.xrange(queue_of(redis_namespace))[0][1]).messages == [
        {"role": "user", "content": "hello"}
    ]
    conn.close()


def test_every_cli_option_reads_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenq.cli.options import parse_size
    from tokenq.cli.worker import build_parser, engine_kwargs

    monkeypatch.setenv("TOKENQ_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("TOKENQ_KV_CACHE_MEMORY", "2GiB")
    monkeypatch.setenv("TOKENQ_MODEL", "/models/tiny")
    monkeypatch.setenv("TOKENQ_REDIS_URL", "redis://elsewhere:6380/1")
    args = build_parser().parse_args(["worker", "--block-size", "32"])
    assert args.redis_url == "redis://elsewhere:6380/1"
    assert engine_kwargs(args) == {
        "model": "/models/tiny",
        "max_num_seqs": 3,
        "kv_cache_memory": 2 << 30,
        "block_size": 32,
    }
    assert parse_size("512M") == 512 << 20 and parse_size("1048576") == 1 << 20


def test_submit_refuses_text_that_no_encoding_holds_before_anything_reaches_redis(
    redis_url: str, redis_namespace: str
) -> None:
    from tokenq import InvalidRequest

    with Client(redis_url, namespace=redis_namespace, **CLIENT) as client:
        for job in ({"prompt": "\ud800"}, {"messages": [{"role": "user", "content": "a\udfff"}]}):
            with pytest.raises(InvalidRequest) as info:
                client.submit(job_id="lone", **job)
            assert info.value.code == "invalid_request"
            assert "not valid Unicode" in info.value.message
        assert not client.redis.exists(client.keys.job("lone"))


def test_help_states_each_default_once_and_jobs_name_their_model_by_their_own_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TOKENQ_MODEL is the worker's model to load (a path or an alias); the client's
    commands read the model a job names from TOKENQ_JOB_MODEL."""
    import argparse
    import re

    from tokenq.cli import dispatch
    from tokenq.cli import worker as worker_cli

    monkeypatch.setenv("TOKENQ_MODEL", "/models/tiny")
    parsers = [dispatch.build_parser(), worker_cli.build_parser()]
    helps = []
    for parser in parsers:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    helps.append(sub.format_help())
                    helps += [
                        verb.format_help()
                        for a in sub._actions
                        if isinstance(a, argparse._SubParsersAction)
                        for verb in a.choices.values()
                    ]
    text = re.sub(r"\s+", " ", "".join(helps))
    assert "default None" not in text
    assert "(default 64)" not in text and "TOKENQ_MAX_NUM_SEQS; default 64]" in text
    assert dispatch.build_parser().parse_args(["submit", "hi"]).model is None
    monkeypatch.setenv("TOKENQ_JOB_MODEL", "tiny")
    assert dispatch.build_parser().parse_args(["submit", "hi"]).model == "tiny"
    args = worker_cli.build_parser().parse_args(["worker"])
    assert worker_cli.engine_kwargs(args)["model"] == "/models/tiny"


def test_a_burst_of_events_on_many_followed_streams_reaches_the_caller_in_one_hand_off(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis before 7.2 ends a blocked read of several streams with the one whose write
    woke it; the reader then reads the others at once, so a step's first tokens for a batch
    of jobs reach their caller together (not the rest a wake-up later), on any server."""
    handed: list[int] = []  # streams per hand-off to the callers (0: a BLOCK ran out)
    dispatch = client_module._Multiplex.dispatch

    def recording(self: Any, reply: Any) -> None:
        handed.append(len(reply or ()))  # RESP2: [key, entries] pairs; RESP3: a map
        dispatch(self, reply)

    monkeypatch.setattr(client_module._Multiplex, "dispatch", recording)
    keys, writer = Keys(redis_namespace), redis.Redis.from_url(redis_url)

    def burst_once_blocked(reader: str, jobs: list[str]) -> None:
        """Once the named reader waits in its blocked read: one event per job, written
        in one transaction, as one PUBLISH call writes a step's first tokens."""
        wait_for(lambda: blocked_in_xread(writer, reader), timeout=10, interval=0.005)
        with writer.pipeline(transaction=True) as p:
            for job in jobs:
                p.xadd(keys.reply(job), encode_event(TokenEvent(0, [7], "x")))
            p.execute()

    jobs = [f"sync-{i}" for i in range(5)]
    reader = f"{redis_namespace}-sync"  # the server may serve other runs' tests too
    conn = redis.Redis.from_url(redis_url, client_name=reader)
    client = Client(conn, namespace=redis_namespace, **CLIENT)
    threading.Thread(target=burst_once_blocked, args=(reader, jobs)).start()
    events = client.stream_many([client.job(j) for j in jobs], timeout=10)
    assert sorted(job.id for job, _ in itertools.islice(events, len(jobs))) == jobs
    events.close()
    client.close()
    assert [n for n in handed if n] == [len(jobs)]

    async def follow_async(jobs: list[str]) -> list[str]:
        aconn = redis.asyncio.Redis.from_url(redis_url, client_name=f"{redis_namespace}-async")
        async with AsyncClient(aconn, namespace=redis_namespace, **CLIENT) as aclient:
            seen = []
            async for job, _ in aclient.stream_many([aclient.job(j) for j in jobs], timeout=10):
                seen.append(job.id)
                if len(seen) == len(jobs):
                    break
            return sorted(seen)

    handed.clear()
    jobs = [f"async-{i}" for i in range(5)]
    threading.Thread(target=burst_once_blocked, args=(f"{redis_namespace}-async", jobs)).start()
    assert asyncio.run(follow_async(jobs)) == jobs
    assert [n for n in handed if n] == [len(jobs)]


def test_a_lone_caller_reads_its_streams_on_its_own_thread(
    redis_url: str, redis_namespace: str
) -> None:
    """Its events reach it with no hand-off from another thread (which a host whose cores
    a worker keeps busy may wake milliseconds late); once a second caller follows too, the
    reader's thread reads for both, since either may be busy with its events for long."""
    name = f"{redis_namespace}-lone"
    client = Client(named(redis_url, name), namespace=redis_namespace, **CLIENT)
    writer = redis.Redis.from_url(redis_url)

    def reader_threads() -> int:  # this client's (those of the tests before may linger)
        return int(client._reader.thread is not None)

    def write_slowly(job_id: str) -> None:
        for event in REPLY:
            time.sleep(0.02)  # a reply written as a worker does: over a while
            write_reply(writer, client.keys, job_id, [event])

    def follow(job_id: str, seen: list[int]) -> list[str]:
        types = []
        for event in client.job(job_id).stream():
            seen.append(reader_threads())
            types.append(event.type)
        return types

    def write(job_id: str) -> None:
        thread = threading.Thread(target=write_slowly, args=(job_id,))
        writers.append(thread)
        thread.start()

    writers: list[threading.Thread] = []
    write("alone")
    seen_alone: list[int] = []
    assert follow("alone", seen_alone) == [e.type for e in REPLY]
    assert seen_alone == [0] * len(REPLY)

    seen_first: list[int] = []
    first = threading.Thread(target=follow, args=("first", seen_first))
    first.start()
    wait_for(lambda: blocked_in_xread(writer, name), timeout=10)  # it reads, on its thread
    for job_id in ("first", "second"):
        write(job_id)
    seen_second: list[int] = []
    assert follow("second", seen_second) == [e.type for e in REPLY]
    first.join(5)
    assert len(seen_first) == len(REPLY)
    assert 1 in seen_first + seen_second  # the reader's thread read for both
    for thread in writers:  # each may still be on its way back from its last write
        thread.join(5)
    client.close()
    writer.close()


@pytest.mark.parametrize("timeout", [None, 5], ids=["caller-thread", "reader-thread"])
def test_closing_the_client_ends_a_waiting_stream_at_once(
    redis_url: str, redis_namespace: str, timeout: float | None
) -> None:
    """Whether the caller reads (no timeout) or waits for the reader's thread (a timeout
    shorter than its socket calls could block), close() ends its stream with ClientClosed."""
    name = f"{redis_namespace}-closing"
    client = Client(named(redis_url, name), namespace=redis_namespace, **CLIENT)
    observer = redis.Redis.from_url(redis_url)
    ended: list[tuple[type, float]] = []

    def follow() -> None:
        try:
            list(client.job("silent").stream(timeout=timeout))
        except Exception as exc:
            ended.append((type(exc), time.monotonic()))

    follower = threading.Thread(target=follow)
    follower.start()
    wait_for(lambda: blocked_in_xread(observer, name), timeout=10)  # it waits in its read
    closed_at = time.monotonic()
    client.close()
    follower.join(3)
    observer.close()
    assert [kind for kind, _ in ended] == [ClientClosed]
    assert ended[0][1] - closed_at < 0.5
