"""The worker against a real Redis server and a real engine (a tiny random Llama)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog

from tests.helpers import default_tokenizer, make_tiny_llama_dir
from tests.redis_fixtures import CLIENT, TEST_MODEL
from tests.worker_support import (
    WorkerThread,
    add_raw,
    check_reply,
    default_queue,
    fast_config,
    make_engine,
    pending,
    queued,
    reference_run,
    single_torch_thread,  # noqa: F401
    slow_steps,
    tiny_model,  # noqa: F401
    wait_for,
)
from tokenq import cli
from tokenq.cli.worker import build_parser, worker_kwargs
from tokenq.engine import SamplingParams
from tokenq.engine.outputs import RequestDelta
from tokenq.producer.client import Client, make_request
from tokenq.protocol import Keys, TokenEvent, decode_event, encode_event, pack, unpack
from tokenq.worker.config import WorkerConfig, connect
from tokenq.worker.detokenizer import Detokenizing, text_side
from tokenq.worker.driver import Add, EngineDriver, Failed, Refused
from tokenq.worker.host import make_worker
from tokenq.worker.intake import EMPTIED_FOR_BLOCKS
from tokenq.worker.logs import configure_logging
from tokenq.worker.pipe import NOT_SENT
from tokenq.worker.scripts import Scripts, TakeResult
from tokenq.worker.worker import Worker

pytestmark = pytest.mark.usefixtures("single_torch_thread")

GREEDY = {"temperature": 0, "ignore_eos": True}
BYTE_C3, BYTE_A9 = 142, 119  # the default tokenizer's tokens of these single bytes


def reply_events(conn: redis.Redis, keys: Keys, job_id: str) -> list:
    return [decode_event(eid, f) for eid, f in conn.xrange(keys.reply(job_id))]


def test_jobs_stream_tokens_and_match_the_engine(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    prompts = ["The queue", "Hello there, how", "Once upon a time", "x"]
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    jobs = client.submit_many(
        make_request(p, max_tokens=8 + i, metadata={"n": i}, **GREEDY)
        for i, p in enumerate(prompts)
    )
    conn = client.redis
    worker = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace, consumer="w1"))
    with WorkerThread(worker):
        results = [check_reply(list(job.stream(timeout=30))) for job in jobs]
        wait_for(lambda: conn.exists(client.keys.metrics("w1")))
        mid = reply_events(conn, client.keys, jobs[1].id)[3]
        resumed = list(jobs[1].stream(after=mid.event_id, timeout=5))
    expected = reference_run(
        tiny_model,
        [{"prompt": p, "params": {"max_tokens": 8 + i, **GREEDY}} for i, p in enumerate(prompts)],
    )
    for i, (reply, (_, final)) in enumerate(zip(results, expected, strict=True)):
        assert reply.done.token_ids == final.token_ids
        assert reply.done.text == final.text
        assert reply.done.finish_reason == "length"
        assert reply.done.usage.completion_tokens == 8 + i
        assert reply.done.metadata == {"n": i}
        t = reply.done.timings
        assert 0 <= t.queue_time <= t.time_to_first_token <= t.total
    assert [e.event_id for e in resumed] == [e.event_id for e in results[1].events[4:]]
    # Acknowledged and deleted: nothing left in the stream or pending.
    assert queued(conn, client.keys) == 0
    assert pending(conn, client.keys) == []
    assert {job.status() for job in jobs} == {"done"}
    assert 0 < conn.ttl(client.keys.reply(jobs[0].id)) <= 3600
    metrics = {k.decode(): float(v) for k, v in conn.hgetall(client.keys.metrics("w1")).items()}
    assert metrics["generation_tokens_total"] == sum(8 + i for i in range(4))
    assert metrics['request_success_total{finished_reason="length"}'] == 4
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prompt_tokens_total",
        "updated_at",
    ):
        assert name in metrics
    client.close()


def test_a_running_jobs_reply_ttl_is_renewed_while_its_tokens_stream(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    """The job key says running from the first token on, and the reply stream's running
    TTL is renewed as tokens keep coming (a quarter of it after the last renewal), not
    set once and left to run out."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    engine = make_engine(tiny_model)
    slow_steps(engine, 0.05)
    job = client.submit("a long story", max_tokens=60, **GREEDY)
    worker = Worker(engine, client.redis, fast_config(redis_namespace, running_reply_ttl_s=8))
    with WorkerThread(worker):
        wait_for(lambda: job.status() == "running", timeout=30)
        time.sleep(2.5)  # past the renewal due 2 s after the first token
        assert job.status() == "running"
        assert client.redis.pttl(client.keys.reply(job.id)) > 6500  # else at most 5.5 s left
        result = job.result(timeout=60)
    assert result.usage.completion_tokens == 60
    client.close()


def test_a_serving_worker_leaves_its_startup_heap_out_of_collections(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    """While a worker serves, what existed when it started (the engine, the imports) is
    frozen out of the collector's walks; when it stops, all of it is collected again."""
    engine = make_engine(tiny_model)
    worker = Worker(engine, redis.Redis.from_url(redis_url), fast_config(redis_namespace))
    assert gc.get_freeze_count() == 0
    with WorkerThread(worker):
        wait_for(lambda: gc.get_freeze_count() > 0, timeout=10)
        cycle = _Node()
        cycle.next = cycle  # garbage made while serving is still collected
        gone = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None
    assert gc.get_freeze_count() == 0


class _Node:
    next: _Node


def test_bad_input_of_every_kind_never_stops_the_worker(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    queue = default_queue(keys)

    def raw(job_id: str | None, data: object, v: str = "2") -> None:
        fields = {"v": v, "data": data if isinstance(data, bytes) else pack(data)}
        if job_id is not None:
            fields["id"] = job_id
        add_raw(conn, keys, fields)

    # (job id, expected error code); None: only a dead letter, no client to answer.
    bad: list[tuple[str | None, str]] = []
    good = []

    def add_bad(job_id: str | None, code: str, data: object, v: str = "2") -> None:
        raw(job_id, data, v)
        bad.append((job_id, code))
        good.append(client.submit(f"good after {code}", max_tokens=4, **GREEDY))

    # Two entries a consumer took and then died with: one was trimmed from the stream
    # while pending, the other is a poison job that workers kept dying on.
    lost = add_raw(conn, keys, {"v": "2", "id": "b-lost", "data": pack({"prompt": "a"})})
    poison = add_raw(conn, keys, {"v": "2", "id": "b-poison", "data": pack({"prompt": "a"})})
    conn.xgroup_create(queue, "workers", id="0")
    assert len(conn.xreadgroup("workers", "ghost", {queue: ">"}, count=2)[0][1]) == 2
    conn.xdel(queue, lost)
    conn.xclaim(queue, "workers", "ghost", 0, [poison], retrycount=5, justid=True)
    bad += [(None, "lost_payload"), ("b-poison", "max_deliveries_exceeded")]
    add_bad("b-msgpack", "invalid_payload", b"\xc1\xc1\xc1")
    add_bad(None, "invalid_request", {"prompt": "no id"})
    add_bad("b-notmap", "invalid_payload", [1, 2, 3])
    add_bad("b-noprompt", "invalid_request", {"params": {"max_tokens": 3}})
    add_bad("b-two", "invalid_request", {"prompt": "a", "prompt_token_ids": [1, 2]})
    add_bad("b-field", "invalid_request", {"prompt": "a", "temperature": 0})
    add_bad("b-param", "invalid_params", {"prompt": "a", "params": {"nucleus": 0.9}})
    add_bad("b-value", "invalid_params", {"prompt": "a", "params": {"top_p": 2.0}})
    add_bad("b-bias", "invalid_params", {"prompt": "a", "params": {"logit_bias": {"x": 1}}})
    add_bad("b-type", "invalid_params", {"prompt": "a", "params": {"max_tokens": "many"}})
    add_bad(
        "b-minmax", "invalid_params", {"prompt": "a", "params": {"min_tokens": 9, "max_tokens": 2}}
    )
    add_bad("b-long", "prompt_too_long", {"prompt_token_ids": [7] * 5000})
    add_bad("b-vocab", "invalid_input", {"prompt_token_ids": [10**9]})
    add_bad("b-msgs", "invalid_request", {"messages": [{"role": "user"}]})
    add_bad("b-version", "unsupported_version", {"prompt": "a"}, v="7")
    add_bad("b-model", "unknown_model", {"prompt": "a", "model": "gpt-9"})
    # Late: an error for the client, but not a dead letter.
    late = client.submit("too late", deadline=time.time() - 1, job_id="b-late")
    good.append(client.submit("last good one", max_tokens=4, **GREEDY))

    worker = Worker(
        make_engine(tiny_model, max_model_len=1024),
        conn,
        fast_config(redis_namespace),
    )
    runner = WorkerThread(worker)
    with runner:
        for job in good:
            assert check_reply(list(job.stream(timeout=30))).done.finish_reason == "length"
        for job_id, code in bad:
            if job_id is not None:
                events = list(client.job(job_id).stream(timeout=30))
                assert [e.type for e in events] == ["error"], job_id
                assert events[0].code == code, (job_id, events[0].message)
                assert events[0].message
        late_events = list(late.stream(timeout=30))
        assert late_events[0].code == "deadline_exceeded"
        wait_for(lambda: conn.xlen(keys.dead) == len(bad))
        assert runner.alive()
        survivor = client.submit("still serving?", max_tokens=3, **GREEDY)
        assert survivor.result(timeout=30).usage.completion_tokens == 3
    dead = [{k.decode(): v for k, v in f.items()} for _, f in conn.xrange(keys.dead)]
    assert sorted(d["code"].decode() for d in dead) == sorted(code for _, code in bad)
    msgpack_letter = next(d for d in dead if d["job_id"] == b"b-msgpack")
    assert unpack(msgpack_letter["fields"])[b"data"] == b"\xc1\xc1\xc1"
    assert queued(conn, keys) == 0
    assert pending(conn, keys) == []
    client.close()


def test_cancel_stops_generation_and_frees_the_blocks(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    early = client.submit("cancelled before any worker saw it", max_tokens=50)
    early.cancel()
    engine = make_engine(tiny_model)
    worker = Worker(engine, client.redis, fast_config(redis_namespace))
    with WorkerThread(worker):
        job = client.submit("go on forever", max_tokens=1900, **GREEDY)
        stream = job.stream(timeout=30)
        first = next(stream)
        assert isinstance(first, TokenEvent)
        job.cancel()
        asked = time.monotonic()
        reply = check_reply([first, *stream])
        assert time.monotonic() - asked < 5
        assert reply.done.finish_reason == "cancelled"
        assert 0 < reply.done.usage.completion_tokens < 1900
        wait_for(lambda: not worker.in_flight)
        assert not engine.has_unfinished()
        assert engine.stats().num_running == 0
        early_reply = check_reply(list(early.stream(timeout=30)))
        assert early_reply.done.finish_reason == "cancelled"
        assert early_reply.token_ids == []
    assert queued(client.redis, client.keys) == 0
    client.close()


def test_deadline_is_enforced_during_generation(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    worker = Worker(make_engine(tiny_model), client.redis, fast_config(redis_namespace))
    with WorkerThread(worker):
        # once the worker takes jobs: the deadline must fall during generation, not before
        client.submit("warm", max_tokens=1, **GREEDY).result(timeout=30)
        job = client.submit("long", max_tokens=1900, deadline=time.time() + 0.5, **GREEDY)
        reply = check_reply(list(job.stream(timeout=30)))
    assert reply.done.finish_reason == "deadline"
    assert reply.done.usage.completion_tokens < 1900
    client.close()


def test_two_workers_share_the_stream_and_each_job_finishes_once(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    jobs = client.submit_many(make_request(f"job {i}", max_tokens=24, **GREEDY) for i in range(12))
    workers = [
        Worker(
            make_engine(tiny_model, max_num_seqs=2),
            client.redis,
            fast_config(redis_namespace, consumer=name),
        )
        for name in ("a", "b")
    ]
    with WorkerThread(workers[0]), WorkerThread(workers[1]):
        for job in jobs:
            check_reply(list(job.stream(timeout=60)))
    served = [sum(w.metrics.request_success_total.values()) for w in workers]
    assert sum(served) == 12 and min(served) > 0, served
    for job in jobs:
        assert sum(e.type == "done" for e in reply_events(client.redis, client.keys, job.id)) == 1
    assert queued(client.redis, client.keys) == 0
    client.close()


def test_a_dead_workers_job_is_reclaimed_and_continued_without_duplicates(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    job = client.submit("a long story", max_tokens=40, **GREEDY)
    # Worker A takes the job, streams a few tokens, then stops dead (never called again).
    a = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace, consumer="a"))
    a.register()
    while sum(isinstance(e, TokenEvent) for e in reply_events(conn, keys, job.id)) < 5:
        a.run_once()
    assert job.id in a.in_flight
    with WorkerThread(
        Worker(make_engine(tiny_model), conn, fast_config(redis_namespace, consumer="b"))
    ):
        reply = check_reply(list(job.stream(timeout=30)))
    assert not any(e.type == "restart" for e in reply.events)
    ((_, expected),) = reference_run(
        tiny_model, [{"prompt": "a long story", "params": {"max_tokens": 40, **GREEDY}}]
    )
    assert reply.done.token_ids == expected.token_ids
    # A wakes up: it finds the job is no longer its own and writes nothing more.
    length = conn.xlen(keys.reply(job.id))
    for _ in range(3):
        a.run_once()
    assert job.id not in a.in_flight
    assert not a.driver.engine.has_unfinished()
    assert conn.xlen(keys.reply(job.id)) == length
    client.close()


def test_rerun_continues_a_matching_reply_and_restarts_a_diverged_one(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    """What a crashed run left in the reply stream decides how the re-run writes."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    params = {"max_tokens": 12, **GREEDY}
    ((deltas, expected),) = reference_run(tiny_model, [{"prompt": "resume me", "params": params}])
    # The earlier run published the first three steps (as the same engine would have).
    published_ids = [t for ids, _ in deltas[:3] for t in ids]
    published_text = "".join(text for _, text in deltas[:3])
    conn.xadd(keys.reply("same"), encode_event(TokenEvent(0, published_ids, published_text)))
    # Another earlier run published tokens this model would never produce.
    conn.xadd(keys.reply("other"), encode_event(TokenEvent(0, [1, 2, 3], "<junk>")))
    jobs = [client.submit("resume me", job_id=jid, **params) for jid in ("same", "other")]
    with WorkerThread(Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))):
        same, other = (check_reply(list(j.stream(timeout=30))) for j in jobs)
    assert [e.type for e in same.events].count("restart") == 0
    assert same.events[1].index == 3  # continued right after what was already there
    assert same.done.token_ids == expected.token_ids
    assert [e.type for e in other.events][:2] == ["token", "restart"]
    assert other.done.token_ids == expected.token_ids
    assert other.text == expected.text
    client.close()


def test_redelivery_of_a_finished_job_does_not_run_it_again(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    job = client.submit("once", job_id="once", max_tokens=4, **GREEDY)
    worker = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))
    with WorkerThread(worker):
        job.result(timeout=30)
        # A producer that bypasses the job key (or a redelivery) brings the same id back.
        add_raw(conn, keys, make_request("once", job_id="once", max_tokens=4).to_fields())
        wait_for(lambda: queued(conn, keys) == 0)
    assert [e.type for e in reply_events(conn, keys, "once")].count("done") == 1
    assert sum(worker.metrics.request_success_total.values()) == 1
    client.close()


def test_a_worker_holds_no_more_jobs_than_its_engine_admits(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    jobs = client.submit_many(make_request(f"job {i}", max_tokens=40, **GREEDY) for i in range(12))
    held = []
    with WorkerThread(
        Worker(make_engine(tiny_model, max_num_seqs=2), conn, fast_config(redis_namespace))
    ):
        while not all(j.status() == "done" for j in jobs):
            held.append(len(pending(conn, keys)))
            time.sleep(0.005)  # a sample every 5 ms
    # The engine's two, and at most two more: jobs the engine has finished whose ends are
    # still being published when their slots are refilled (the engine does not wait for
    # Redis). The other eight stay in the stream for any worker to take.
    assert 2 <= max(held) <= 4, held


def test_a_take_that_drained_the_queues_is_not_repeated_until_a_doorbell_rings(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    # A slot freed at the end of a step used to run a TAKE that found nothing, beside the
    # publish of that step's tokens, and an idle worker ran one after every doorbell wait
    # (and after the first wait that read the ring of a submit TAKE had already served).
    # New entries still come in: a submit rings the doorbell, and an entry added without
    # one (against the protocol) is found once the TAKE's answer is some blocks old.
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    worker = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))
    take, taken = worker.scripts.take, []

    def counted(*args: Any) -> TakeResult:
        result = take(*args)
        taken.append(len(result.taken))
        return result

    worker.scripts.take = counted  # type: ignore[method-assign]
    client.submit_many([make_request("first", max_tokens=2, **GREEDY)])
    worker.intake.admit(2.0)
    assert taken == [1]
    client.submit_many([make_request("second", max_tokens=2, **GREEDY)])
    started = time.monotonic()
    worker.intake.admit(2.0)  # the second submit's doorbell, not a TAKE of the drained queue
    assert taken == [1]
    assert time.monotonic() - started < 1.0  # a ring TAKE had not seen: no wait
    block = 0.05  # from here: the TAKE's answer expires after EMPTIED_FOR_BLOCKS of these
    worker.intake.admit(block)
    assert taken == [1, 1]
    started = time.monotonic()
    worker.intake.admit(block)  # that TAKE saw the second ring: this waits for a newer one
    assert taken == [1, 1]
    assert time.monotonic() - started >= block * 0.9
    fields = {"v": "2", "id": "no-bell", "data": pack({"prompt": "third", "max_tokens": 2})}
    add_raw(conn, worker.keys, fields)  # as a producer that rings no doorbell
    started = time.monotonic()
    while sum(taken) < 3:
        worker.intake.admit(block)
        assert time.monotonic() - started < 10, taken
    # Doorbell waits, not TAKEs, until the TAKE's answer was EMPTIED_FOR_BLOCKS blocks old.
    assert taken == [1, 1, 1]
    assert time.monotonic() - started >= (EMPTIED_FOR_BLOCKS - 3) * block


def test_take_says_which_lanes_it_drained_and_the_doorbell_ring_it_saw(
    redis_url: str, redis_namespace: str
) -> None:
    # A TAKE that fills its slots exactly has drained the queue when it took the newest
    # entry: the worker then asks again only after a newer ring, not when a slot frees.
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, Keys(redis_namespace)
    config = fast_config(redis_namespace)
    scripts = Scripts(conn, keys, config.group, config.consumer)

    def take(slots: int) -> TakeResult:
        return scripts.take([TEST_MODEL], [slots] * 3, [0, 0, 0], 1, b"fence", 60)

    client.submit_many([make_request(f"job {i}", max_tokens=2) for i in range(3)])
    ring = conn.xrevrange(keys.bell(TEST_MODEL), count=1)[0][0]
    first = take(2)
    assert len(first.taken) == 2
    assert first.drained == (True, False, True)  # one default job left; no other lanes
    assert first.rings == {keys.bell(TEST_MODEL): ring}
    second = take(1)
    assert len(second.taken) == 1
    assert second.drained == (True, True, True)  # took the newest entry: drained
    client.submit_many([make_request(f"batch {i}", max_tokens=2, priority=5) for i in range(2)])
    third = take(1)
    assert len(third.taken) == 1
    assert third.drained == (True, True, False)  # a batch job is left
    assert third.rings[keys.bell(TEST_MODEL)] > ring


def test_a_job_that_comes_in_gets_its_first_heartbeat_an_interval_later(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    # Its entry was delivered as it came in: a heartbeat then (KEEP over every entry of a
    # burst) only took the Redis side's time beside the burst's first step.
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    engine = make_engine(tiny_model)
    slow_steps(engine, 0.02)
    config = fast_config(redis_namespace, heartbeat_interval_s=0.4, claim_idle_ms=2000)
    worker = Worker(engine, client.redis, config)
    keep, kept = worker.scripts.keep, []

    def counted(entries: Any, **kwargs: Any) -> Any:
        kept.append((time.monotonic(), len(entries)))
        return keep(entries, **kwargs)

    worker.scripts.keep = counted  # type: ignore[method-assign]
    with WorkerThread(worker):
        time.sleep(0.3)  # idle for most of an interval: that does not count
        job = client.submit("a job", max_tokens=40, **GREEDY)
        wait_for(lambda: job.id in worker.in_flight)
        came_in = time.monotonic()
        wait_for(lambda: kept, timeout=5)
    assert kept[0][0] - came_in >= 0.3, kept  # an interval (0.4 s) after, give or take a pass
    assert kept[0][1] == 1


def test_a_live_worker_keeps_its_long_job_from_other_workers(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    # Several claim idle times long: only heartbeats keep it with its owner.
    job = client.submit("a very long job", max_tokens=600, **GREEDY)
    config = fast_config(redis_namespace, claim_idle_ms=250, heartbeat_interval_s=0.05)
    owner = Worker(make_engine(tiny_model), conn, replace(config, consumer="owner"))
    with WorkerThread(owner):
        wait_for(lambda: job.id in owner.in_flight)
        rival = Worker(make_engine(tiny_model), conn, replace(config, consumer="rival"))
        with WorkerThread(rival):
            reply = check_reply(list(job.stream(timeout=120)))
    assert reply.done.usage.completion_tokens == 600
    assert reply.done.timings.total > 0.5  # it did outlive two claim idle periods
    assert sum(owner.metrics.request_success_total.values()) == 1
    assert sum(rival.metrics.request_success_total.values()) == 0


def test_a_restarted_worker_replays_its_own_pending_jobs_first(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    job = client.submit("interrupted", max_tokens=30, **GREEDY)
    # No other worker could reclaim it for a minute: only the replay from id 0 can help.
    config = fast_config(redis_namespace, consumer="stable-name", claim_idle_ms=60_000)
    first = Worker(make_engine(tiny_model), conn, config)
    first.register()
    while not any(isinstance(e, TokenEvent) for e in reply_events(conn, client.keys, job.id)):
        first.run_once()
    # The process "dies" here; its successor under the same name starts.
    with WorkerThread(Worker(make_engine(tiny_model), conn, config)):
        reply = check_reply(list(job.stream(timeout=10)))
    assert reply.done.usage.completion_tokens == 30
    assert not any(e.type == "restart" for e in reply.events)


def test_tokenq_submit_prints_the_answer(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = ["--redis-url", redis_url, "--namespace", redis_namespace, "--max-tokens", "5"]
    configure_logging(level="warning")  # keep the worker's lines out of the captured stdout
    conn = redis.Redis.from_url(redis_url)
    with WorkerThread(Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))):
        # The command asks the registry which model to use: wait for the worker to be in it.
        wait_for(lambda: conn.zcard(Keys(redis_namespace).workers) == 1)
        assert cli.main(["submit", "Hello", "--json", *common]) == 0
        done = json.loads(capsys.readouterr().out)
        assert done["finish_reason"] in ("length", "stop") and done["usage"]["total_tokens"] > 0
        assert cli.main(["submit", "Hello", "--stream", "--raw", *common]) == 0
        streamed = capsys.readouterr().out
        assert streamed.rstrip().endswith("tokens]")
        assert cli.main(["submit", "Hi", "--temperature", "-1", *common]) == cli.EXIT_JOB_FAILED
        errors = capsys.readouterr().err.splitlines()
        assert any(e.startswith("tokenq: job") and "invalid_params" in e for e in errors)
    conn.close()
    structlog.reset_defaults()


@pytest.mark.parametrize("side", ["threads", "process"])
def test_a_stream_interval_sends_first_tokens_at_once_and_the_rest_in_chunks(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    side: str,
) -> None:
    # In two processes the engine's also sends running jobs' tokens over the pipe once an
    # interval: none may be lost or reordered on the way.
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    jobs = client.submit_many(
        make_request(f"chunked {i}", max_tokens=200, **GREEDY) for i in range(4)
    )
    config = fast_config(redis_namespace, stream_interval_s=0.05)
    with WorkerThread(make_worker(make_engine(tiny_model), redis_url, config, side=side)):
        replies = [check_reply(list(job.stream(timeout=60))) for job in jobs]
    expected = reference_run(
        tiny_model,
        [{"prompt": f"chunked {i}", "params": {"max_tokens": 200, **GREEDY}} for i in range(4)],
    )
    for reply, (_, final) in zip(replies, expected, strict=True):
        assert reply.done.token_ids == final.token_ids
        tokens = [e for e in reply.events if isinstance(e, TokenEvent)]
        # The first token goes out at once (with at most what came while it was sent)...
        assert len(tokens[0].token_ids) <= 3
        assert len(tokens) < 200 / 4  # the rest in chunks of several steps
    client.close()


def test_the_queue_process_decodes_the_text_of_jobs_without_stop_strings(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    sampled = {"max_tokens": 60, "temperature": 1.0, "ignore_eos": True}
    requests = [{"prompt": f"decode {i}", "params": {**sampled, "seed": i}} for i in range(2)]
    # Byte tokens 0xC3 and 0xA9 at random: "é" when they come in that order, an invalid
    # byte (U+FFFD) otherwise; a character is always split across two steps, and its first
    # byte's text must wait for the second's, as in the engine.
    bytes_only = {"temperature": 3.0, "logit_bias": {BYTE_C3: 98, BYTE_A9: 100}}
    requests.append({"prompt": "decode 2", "params": {**sampled, "seed": 2, **bytes_only}})
    plain_text = reference_run(tiny_model, requests[:1])[0][1].text
    # A stop string from the middle of job 0's text: that job ends there, in the engine.
    requests.append({"prompt": "decode 0", "params": {**sampled, "seed": 0}})
    requests[-1]["params"]["stop"] = [plain_text[20:23]]
    expected = [final for _, final in reference_run(tiny_model, requests)]
    assert expected[-1].finish_reason == "stop" and len(expected[-1].text) <= 20
    assert "é" in expected[2].text and "\ufffd" in expected[2].text

    engine = make_engine(tiny_model)
    decoded_in_engine: dict[str, bool] = {}
    add_request = engine.output_processor.add_request

    def spy(seq: Any) -> None:
        decoded_in_engine[seq.request_id] = seq.params.detokenize
        add_request(seq)

    engine.output_processor.add_request = spy  # type: ignore[method-assign]
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    jobs = client.submit_many(make_request(r["prompt"], **r["params"]) for r in requests)
    config = fast_config(redis_namespace, stream_interval_s=0.05)
    with WorkerThread(make_worker(engine, redis_url, config, side="process")):
        replies = [check_reply(list(job.stream(timeout=60))) for job in jobs]
    for reply, final in zip(replies, expected, strict=True):
        assert (reply.done.text, reply.done.token_ids) == (final.text, final.token_ids)
        assert reply.done.finish_reason == final.finish_reason
    assert [decoded_in_engine[job.id] for job in jobs] == [False, False, False, True]
    client.close()


class DecodesAllBut:
    """A tokenizer that raises on one id."""

    def __init__(self, bad: int) -> None:
        self.tokenizer, self.bad = default_tokenizer(), bad

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.bad in ids:
            raise ValueError("no text for this id")
        return self.tokenizer.decode(ids, skip_special_tokens)


def test_a_job_whose_text_fails_in_the_queue_process_ends_alone_with_an_error() -> None:
    aborted: list[str] = []
    texts = Detokenizing(DecodesAllBut(999), aborted.append)  # type: ignore[arg-type]
    names = ["ok", "bad", "stops", "refused", "dropped", "bad prompt"]
    adds = []
    for name in names:
        params = SamplingParams(stop=["."] if name == "stops" else [])
        adds.append(Add(name, [1, 2], params, 0, 0.0, None, text_side(params)))
    adds[-1].prompt_token_ids = [1, 999]
    for add in adds:
        texts.take(add)
    assert [add.text_by == "engine" for add in adds] == [False, False, True, False, False, False]
    texts.prepare()  # the intake's, once the delivery is sent: a prompt it cannot decode too

    def delta(job: str, ids: list[int], end: str | None = None, text: str = "") -> RequestDelta:
        return RequestDelta(job, ids, text, end is not None, end, 2, len(ids), NOT_SENT)

    hello = default_tokenizer().encode("Hello there")
    ok, bad = texts.output([delta("ok", hello[:1]), delta("bad", [999])])  # type: ignore[misc]
    assert ok.new_text == "Hello"
    assert (bad.finished, bad.finish_reason) == (True, "error") and "ValueError" in bad.error
    assert aborted == ["bad"]
    # Its outputs until the engine ends it (the abort) are dropped; the others go on.
    later = texts.output([delta("bad", [5]), delta("ok", hello[1:], "length")])
    assert [(d.request_id, d.new_text, d.text) for d in later] == [("ok", " there", "Hello there")]
    assert texts.output([delta("bad", [], "cancelled")]) == []
    (failed,) = texts.output([delta("bad prompt", [5])])
    assert (failed.finish_reason, aborted) == ("error", ["bad", "bad prompt"])
    # A job the engine refused or dropped is forgotten: were its id to come again, its
    # text would be the engine's.
    texts.output(Refused("refused", "invalid_params", "no"))
    texts.output(Failed([], "the device is gone", ["dropped"]))
    for job in ("refused", "dropped", "stops"):
        assert texts.output([delta(job, [5], text="the engine's")])[0].new_text == "the engine's"


def test_the_driver_names_an_engine_error_as_the_engine_does(
    tiny_model: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request the engine fails to add (a bug, not bad input) is refused, and a step that
    fails for every request is reported, with the error as the engine names one for a job
    that fails alone: its type and text, not a quoted repr of them."""
    engine = make_engine(tiny_model)
    driver = EngineDriver(engine)

    def add(job_id: str) -> Add:
        params = SamplingParams(max_tokens=4, **GREEDY)
        return Add(job_id, [5, 6, 7], params, 0, time.monotonic(), None)

    def no_room(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no room")

    with monkeypatch.context() as patch:
        patch.setattr(engine, "add_request", no_room)
        driver.add([add("refused")])
        driver.pump()
    refused = Refused("refused", "internal_error", "RuntimeError: no room")
    assert driver.outputs.get_nowait() == refused

    def device_lost(*args: Any) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.model_runner.model, "forward", device_lost)
    driver.add([add("a"), add("b")])
    driver.pump()
    failed = driver.outputs.get_nowait()
    assert isinstance(failed, Failed)
    assert (failed.error, sorted(failed.dropped)) == ("RuntimeError: device lost", ["a", "b"])


def test_the_stream_interval_comes_from_a_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flag = build_parser().parse_args(["worker", "--stream-interval", "0.1"])
    assert worker_kwargs(flag)["stream_interval_s"] == 0.1
    monkeypatch.setenv("TOKENQ_STREAM_INTERVAL", "0.25")
    assert worker_kwargs(build_parser().parse_args(["worker"]))["stream_interval_s"] == 0.25


def test_the_demo_runs_its_jobs_through_an_embedded_fakeredis_at_once(tmp_path: Path) -> None:
    """`tokenq demo` (make demo): the worker and client on an in-process fakeredis, whose
    Lua answers some commands in other shapes than Redis; its jobs are taken at once, not
    after the 60 s in which a stuck entry would be reclaimed."""
    model = make_tiny_llama_dir(tmp_path / "tiny")
    cmd = [sys.executable, "-m", "tokenq.cli", "demo", "--model", str(model), "--max-tokens", "4"]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 jobs," in out.stdout and "Traceback" not in out.stderr
    assert time.monotonic() - started < 45


@pytest.mark.parametrize("block_ms", [100, 8000])
def test_the_workers_reads_time_out_but_never_within_its_longest_block(
    redis_url: str, block_ms: int
) -> None:
    """A Redis that stops answering must end each call with a timeout, to be waited out
    with backoff (redis-py before 8 reads without one by default); and the doorbell's
    blocked XREAD, block_ms long, must never be cut by it."""
    config = WorkerConfig(served_names=("m",), block_ms=block_ms)
    conn = connect(redis_url, config)
    timeout = conn.connection_pool.connection_kwargs["socket_timeout"]
    assert timeout is not None and block_ms / 1000 < timeout <= block_ms / 1000 + 10
    conn.close()
