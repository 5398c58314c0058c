"""Durability under ordinary faults: workers killed or frozen, Redis restarted, replies cut
or stalled on the wire, hostile entries by the thousand.

In every run the same things must hold: each good job ends with exactly one `done` whose
tokens equal a clean run; its reply stream holds each token index once; nothing is left
pending; only bad entries are dead-lettered, each with an error its client can read.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.faults import RedisServer, TcpProxy, WorkerProcess
from tests.redis_fixtures import CLIENT
from tests.worker_support import (
    TEST_MODEL,
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
    tiny_model,  # noqa: F401
    wait_for,
    wait_still,
)
from tokenq.producer.client import Client, Job, make_request
from tokenq.protocol import NO_TENANT, ErrorEvent, Keys, TokenEvent, decode_event, pack, unpack
from tokenq.worker import intake, retry
from tokenq.worker.host import make_worker
from tokenq.worker.worker import Worker

pytestmark = pytest.mark.usefixtures("single_torch_thread")

GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class Run:
    """Good jobs submitted for a fault run, and what a clean run of them produces."""

    client: Client
    jobs: list[Job]
    requests: list[dict[str, Any]]

    @classmethod
    def submit(cls, client: Client, n: int, max_tokens: int, tag: str = "story") -> Run:
        prompts = [f"{tag} number {i}" for i in range(n)]
        params = {"max_tokens": max_tokens, **GREEDY}
        jobs = client.submit_many(make_request(p, **params) for p in prompts)
        return cls(client, jobs, [{"prompt": p, "params": params} for p in prompts])

    def tokens_so_far(self, conn: redis.Redis | None = None) -> list[int]:
        conn = conn or self.client.redis
        counts = []
        for job in self.jobs:
            events = [decode_event(i, f) for i, f in conn.xrange(self.client.keys.reply(job.id))]
            counts.append(sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent)))
        return counts

    def check(self, model: Path, conn: redis.Redis | None = None, restarts: bool = False) -> None:
        """Each job: one done, every token index once, the clean run's tokens; the stream
        and the pending list empty."""
        conn = conn or self.client.redis
        keys = self.client.keys
        expected = reference_run(model, self.requests)
        for job, (_, final) in zip(self.jobs, expected, strict=True):
            events = [decode_event(i, f) for i, f in conn.xrange(keys.reply(job.id))]
            reply = check_reply(events)
            assert reply.done.token_ids == final.token_ids, job.id
            if not restarts:
                assert not any(e.type == "restart" for e in events), job.id
            indices = [i for e in events if isinstance(e, TokenEvent) for i in _span(e)]
            assert len(indices) == len(set(indices)), f"{job.id}: a token index twice"
            assert conn.get(keys.job(job.id)) == b"done"
        assert queued(conn, keys) == 0
        assert pending(conn, keys) == []


def _span(event: TokenEvent) -> range:
    return range(event.index, event.index + len(event.token_ids))


def reply_events(conn: redis.Redis, keys: Keys, job_id: str) -> list[Any]:
    return [decode_event(i, f) for i, f in conn.xrange(keys.reply(job_id))]


def kinds(events: list[Any]) -> list[tuple[str, str | None]]:
    """Each event's type, and its code if it is an error."""
    return [(e.type, getattr(e, "code", None)) for e in events]


def dead_letters(conn: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    return [{k.decode(): v for k, v in f.items()} for _, f in conn.xrange(keys.dead)]


# -- processes die or freeze ------------------------------------------------------------


def test_kill_9_of_one_of_two_workers_loses_and_duplicates_nothing(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    run = Run.submit(client, 8, 250)
    args = ["--claim-idle-ms", "1000", "--max-num-seqs", "4"]
    conn, keys = client.redis, client.keys
    # a starts first and takes four jobs; b, once up, the other four.
    with WorkerProcess(
        tiny_model, redis_url, redis_namespace, tmp_path / "a.log", consumer="a", extra=args
    ) as a:
        wait_for(lambda: len(pending(conn, keys, "a")) == 4, timeout=60)
        b = WorkerProcess(
            tiny_model, redis_url, redis_namespace, tmp_path / "b.log", consumer="b", extra=args
        )
        with b:
            wait_for(lambda: min(run.tokens_so_far()) > 10, timeout=60)
            assert pending(conn, keys, "a"), "worker a should hold jobs when it is killed"
            a.kill()
            wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=60)
            assert b.alive()
            b.proc.send_signal(signal.SIGTERM)
            b.wait_clean_exit(timeout=30)
    run.check(tiny_model)
    assert client.redis.xlen(client.keys.dead) == 0
    client.close()


def test_a_worker_frozen_past_the_claim_time_wakes_up_fenced_out(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    run = Run.submit(client, 8, 300)
    args = ["--claim-idle-ms", "1000", "--max-num-seqs", "4"]
    conn, keys = client.redis, client.keys
    a = WorkerProcess(
        tiny_model, redis_url, redis_namespace, tmp_path / "a.log", consumer="a", extra=args
    )
    with a:
        wait_for(lambda: len(pending(conn, keys, "a")) == 4, timeout=60)  # a first: 4 jobs
        b = WorkerProcess(
            tiny_model, redis_url, redis_namespace, tmp_path / "b.log", consumer="b", extra=args
        )
        with b:
            wait_for(lambda: min(run.tokens_so_far()) > 10, timeout=60)
            assert pending(conn, keys, "a")
            a.signal_all(signal.SIGSTOP)  # the whole worker freezes
            # b takes a's jobs over once they have been idle past the claim time...
            wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=60)
            a.signal_all(signal.SIGCONT)
            # ...and a, awake again, must write nothing more for them and keep serving.
            wait_for(lambda: "taken over by another worker" in a.log.read_text(), timeout=60)
            later = Run.submit(client, 4, 20, tag="after the thaw")
            wait_for(lambda: all(j.status() == "done" for j in later.jobs), timeout=60)
            assert a.alive() and b.alive()
            for w in (a, b):
                w.proc.send_signal(signal.SIGTERM)
            a.wait_clean_exit(timeout=30)
            b.wait_clean_exit(timeout=30)
    run.check(tiny_model)
    later.check(tiny_model)
    assert conn.xlen(keys.dead) == 0
    assert "taken over by another worker" in a.log.read_text()
    client.close()


# -- Redis restarts, cut and stalled replies --------------------------------------------


def test_three_redis_restarts_under_long_jobs_dead_letter_nothing(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Eight 300-token jobs, Redis (AOF) restarted three times for a second while they run,
    no worker dies: every job finishes once, seamlessly, and none is dead-lettered."""
    with RedisServer(tmp_path / "redis") as server:
        client = Client(server.url, namespace="faults", **CLIENT)
        run = Run.submit(client, 8, 300)
        conn = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=1)
        # A small outbox: the engine pauses while Redis is away, so each restart hits
        # jobs in the middle of their generation.
        config = fast_config("faults", max_outbox_events=64, max_backoff_s=0.2)
        worker = Worker(make_engine(tiny_model), conn, config)
        direct = server.client()
        with WorkerThread(worker):
            for threshold in (40, 120, 200):
                wait_for(lambda t=threshold: min(run.tokens_so_far(direct)) >= t, timeout=60)
                server.restart(down_for=1.0)
            wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=120)
        # Counted once stopped: a job's count follows the script call that ended it.
        assert sum(worker.metrics.request_success_total.values()) == 8
        run.check(tiny_model, direct)
        assert direct.xlen(client.keys.dead) == 0
        deliveries = [inf for inf in worker.in_flight.values()]
        assert not deliveries
        client.close()


def test_cut_and_stalled_publish_replies_duplicate_no_token(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Redis runs the publish call but the worker never hears back (the connection is cut,
    or Redis stalls past the socket timeout): re-sending it must write nothing twice."""
    with RedisServer(tmp_path / "redis", aof=False) as server, TcpProxy(server.port) as proxy:
        client = Client(server.url, namespace="faults", **CLIENT)
        run = Run.submit(client, 12, 120)
        conn = redis.Redis.from_url(proxy.url, socket_timeout=0.5, socket_connect_timeout=1)
        config = fast_config("faults", max_backoff_s=0.1)
        with WorkerThread(Worker(make_engine(tiny_model), conn, config)):
            wait_for(lambda: min(run.tokens_so_far()) > 5, timeout=60)
            proxy.cut_reply(b"EVALSHA", times=3)
            wait_for(lambda: proxy.cuts_done == 3, timeout=30)
            proxy.stall(1.2)  # past the worker's 0.5 s socket timeout
            time.sleep(1.5)  # the stall, and a moment of service: a second stall, not a longer one
            proxy.stall(1.2)
            wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=120)
        run.check(tiny_model)
        assert client.redis.xlen(client.keys.dead) == 0
        client.close()


def test_a_lost_settle_reply_after_its_queue_was_dropped_leaves_the_worker_serving(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Redis applies the call that settles a queue's last entry but its reply is lost; the
    TAKE that a job submitted to another queue rings then drops the empty queue with its
    group, before the re-sent settle arrives. That settle has nothing left to do: the
    worker (its queue process) serves on, and the entry's job has one error."""
    with RedisServer(tmp_path / "redis", aof=False) as server, TcpProxy(server.port) as proxy:
        client = Client(server.url, namespace="faults", **CLIENT)
        conn, keys = client.redis, client.keys
        with WorkerProcess(tiny_model, proxy.url, "faults", tmp_path / "worker.log") as worker:
            worker.wait_registered()
            for i in range(4):
                jid = f"broken-{i}"
                proxy.cut_reply_containing(f"settle {jid} ".encode(), hold_resend_s=1.5)
                add_raw(conn, keys, {"v": "2", "id": jid, "data": b"\xc1"})
                wait_for(lambda i=i: proxy.cuts_done == i + 1, timeout=30)
                good = client.submit(prompt=f"after {i}", max_tokens=4, temperature=0, priority=-1)
                wait_for(lambda: not conn.exists(default_queue(keys)), timeout=30)
                assert good.result(timeout=60).finish_reason == "length"
                assert worker.alive(), worker.log.read_text()[-3000:]
        for i in range(4):
            assert kinds(reply_events(conn, keys, f"broken-{i}")) == [("error", "invalid_payload")]
        assert [d["job_id"] for d in dead_letters(conn, keys)] == [
            f"broken-{i}".encode() for i in range(4)
        ]
        assert pending(conn, keys) == []
        client.close()


# -- hostile input ------------------------------------------------------------------------


Fields = dict[str, Any]


def hostile_entries(rng: random.Random, good_ids: list[str], n: int) -> list[Fields]:
    """Entries that no worker may run: random bytes, wrong types, extreme numbers, huge
    sizes, bad ids, and ids of good jobs carried by broken payloads. Each is a job stream
    entry's fields; an absent "id" gets a fresh one."""
    ok = {"prompt": "x", "params": {"max_tokens": 2}}
    numbers = [float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 2**63 - 1, -(2**63)]
    bad_ints = [float("nan"), float("inf"), 1e308, -(2**63), 0, -1]

    def job(**payload: Any) -> Fields:
        return {"data": pack(payload)}

    makers = [
        lambda: {"data": rng.randbytes(rng.randint(0, 64))},
        lambda: {"data": pack(rng.choice([1, "text", None, [1, 2], 3.5]))},
        lambda: job(prompt=rng.choice([1, None, [1], {"a": 1}])),
        lambda: job(prompt="x", params=rng.choice([[], "p", 3])),
        lambda: job(prompt="x", params={"max_tokens": rng.choice(bad_ints)}),
        lambda: job(prompt="x", params={"temperature": rng.choice(numbers)}),
        lambda: job(prompt="x", params={"top_p": rng.choice(numbers)}),
        lambda: job(prompt="x", priority=rng.choice(numbers)),
        lambda: job(prompt="x", deadline=rng.choice(numbers[:3])),
        lambda: job(prompt_token_ids=[rng.choice([-1, 2**40, 10**9])]),
        lambda: job(messages=[{"role": 1, "content": "x"}]),
        lambda: job(**ok, unknown=1),
        lambda: job(prompt="x", params={"logit_bias": {"x": 1.0}}),
        lambda: job(prompt="x", params={"stop": [1, 2]}),
        lambda: job(prompt="x", params={"stop": ["s"] * 100}),
        lambda: job(prompt="x", params={"stop_token_ids": list(range(2000))}),
        lambda: {**job(**ok), "v": rng.choice(["0", "1", "", "2.0"])},
        lambda: {**job(**ok), "id": rng.choice(["bad id", "x\n", "", "é", "a" * 200])},
        lambda: {**job(**ok), "id": None},  # no id field at all
        lambda: {"data": None},  # no data field
        # A broken entry that reuses the id of a good job (running or finished by now).
        lambda: {"data": b"\xc1", "id": rng.choice(good_ids)},
    ]
    return [rng.choice(makers)() for _ in range(n)]


def huge_entries() -> list[Fields]:
    return [
        {"data": pack({"prompt": "p" * (10 << 20)})},  # 10 MB prompt
        {"data": pack({"prompt": "x", "params": {"logit_bias": dict.fromkeys(range(10**6), 1.0)}})},
        {"data": pack({"prompt": "x", "params": {"stop": [f"s{i}" for i in range(100_000)]}})},
        {"data": pack({"prompt": "x", "metadata": "m" * (1 << 20)})},
    ]


def wire(fields: Fields, default_id: str) -> dict[str, Any]:
    out = {"v": "2", "id": default_id, **fields}
    return {k: v for k, v in out.items() if v is not None}


def test_thousands_of_hostile_entries_interleaved_with_good_jobs(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    rng = random.Random(8)
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    good = Run.submit(client, 20, 12)
    good_ids = [j.id for j in good.jobs]
    hostile = hostile_entries(rng, good_ids, 2000) + huge_entries()
    rng.shuffle(hostile)
    worker = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))
    runner = WorkerThread(worker)
    started = time.monotonic()
    with runner:
        for start in range(0, len(hostile), 50):
            with conn.pipeline(transaction=True) as pipe:  # atomic, as SUBMIT (add_raw)
                pipe.zadd(keys.queues(TEST_MODEL), {f"0:{NO_TENANT}": 0})
                for i, fields in enumerate(hostile[start : start + 50]):
                    pipe.xadd(default_queue(keys), wire(fields, f"hostile-{start + i}"))
                pipe.execute()
            more = Run.submit(client, 1, 6, tag=f"good among the bad {start}")
            good.jobs += more.jobs
            good.requests += more.requests
        try:
            wait_for(lambda: all(j.status() == "done" for j in good.jobs), timeout=60)
        except AssertionError:
            stuck = {
                j.id: (j.status(), [e.type for e in reply_events(conn, keys, j.id)])
                for j in good.jobs
                if j.status() != "done"
            }
            raise AssertionError(f"not done: {stuck}; in flight {list(worker.in_flight)}") from None
        wait_for(lambda: queued(conn, keys) == 0, timeout=60)
        assert runner.alive()  # the same worker, never restarted
    elapsed = time.monotonic() - started
    good.check(tiny_model)
    dead = dead_letters(conn, keys)
    assert len(dead) == len(hostile), "every hostile entry, and nothing else, is dead-lettered"
    for d in dead:
        assert len(d["message"]) < 500
        assert len(d["fields"]) < 40_000
    # A hostile entry with a usable id got one readable error on its reply stream; one
    # that reused a good job's id left that job's reply alone (checked above).
    answered = 0
    for i in range(len(hostile)):
        events = [decode_event(e, f) for e, f in conn.xrange(keys.reply(f"hostile-{i}"))]
        if events:
            assert len(events) == 1 and isinstance(events[0], ErrorEvent), i
            assert len(events[0].message) < 500
            answered += 1
    assert answered > len(hostile) // 2
    print(f"fuzz: {len(hostile)} hostile entries, {len(good.jobs)} good jobs, {elapsed:.1f}s")
    client.close()


def test_a_bad_entry_naming_a_good_job_taken_with_it_leaves_that_job_alone(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    good = Run.submit(client, 1, 6)
    # Right behind the good job's entry, in the same queue: a broken entry with its id, then
    # more broken entries, so that the worker's first take delivers them all at once and
    # the bad ones take a while to refuse before the good one starts.
    add_raw(conn, keys, wire({"data": b""}, good.jobs[0].id))
    for i in range(40):
        add_raw(conn, keys, wire({"data": b"\xc1"}, f"broken-{i}"))
    worker = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))
    with WorkerThread(worker):
        wait_for(lambda: good.jobs[0].status() in ("done", "error"), timeout=30)
        wait_for(lambda: len(dead_letters(conn, keys)) == 41, timeout=30)
    good.check(tiny_model)
    dead = dead_letters(conn, keys)[0]
    assert dead["code"] == b"invalid_payload" and dead["job_id"] == good.jobs[0].id.encode()
    client.close()


@pytest.mark.parametrize("start_chunk", [1, intake.START_CHUNK])
def test_a_second_good_entry_for_a_job_taken_with_it_runs_the_job_once(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    start_chunk: int,
) -> None:
    """Two well-formed entries with one job id in one take, among others: the first starts
    the job, the second is acknowledged without a run, an error or a dead letter; also
    when the take's jobs are started a few at a time (each few its own START)."""
    monkeypatch.setattr(intake, "START_CHUNK", start_chunk)
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    good = Run.submit(client, 3, 6)
    job = good.jobs[0].id
    payload = {"prompt": good.requests[0]["prompt"], "params": good.requests[0]["params"]}
    add_raw(conn, keys, wire({"data": pack(payload)}, job))
    worker = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))
    with WorkerThread(worker):
        wait_for(lambda: all(j.status() == "done" for j in good.jobs), timeout=30)
        wait_for(lambda: queued(conn, keys) == 0 and pending(conn, keys) == [], timeout=30)
    good.check(tiny_model)
    assert dead_letters(conn, keys) == []
    client.close()


def test_a_broken_entry_borrowing_a_queued_jobs_id_leaves_that_job_alone(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    good = Run.submit(client, 1, 6)  # waits in the default lane
    # A broken entry with the good job's id in the interactive lane: taken first and alone
    # (one slot), refused and dead-lettered while the good job still waits; the job it
    # names is not its own (SUBMIT recorded the job's entry).
    add_raw(conn, keys, wire({"data": b""}, good.jobs[0].id), priority=-1)
    engine = make_engine(tiny_model, max_num_seqs=1)
    worker = Worker(engine, conn, fast_config(redis_namespace))
    worker.run_once()  # intake, engine, publisher once: the refusal is published
    assert len(dead_letters(conn, keys)) == 1
    assert good.jobs[0].status() == "queued"
    with WorkerThread(worker):
        wait_for(lambda: good.jobs[0].status() in ("done", "error"), timeout=30)
    good.check(tiny_model)
    [dead] = dead_letters(conn, keys)
    interactive = keys.queue(TEST_MODEL, -1, NO_TENANT)
    assert dead["code"] == b"invalid_payload" and dead["stream"] == interactive.encode()
    assert conn.exists(keys.entry(good.jobs[0].id)) == 0  # gone with the job's end
    client.close()


def test_take_starts_fresh_jobs_itself_and_a_refused_one_keeps_no_owner_key(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    good = Run.submit(client, 3, 4)
    # A broken entry under an id no job was submitted with: its own job's entry, so TAKE
    # starts it too (taking the owner key); the worker refuses it, and lets the key go.
    add_raw(conn, keys, wire({"data": b""}, "broken-own"))
    worker = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))
    starts: list[int] = []
    start = worker.scripts.start

    def counted(*args: Any) -> Any:
        starts.append(len(args[2]))
        return start(*args)

    worker.scripts.start = counted  # type: ignore[method-assign]
    worker.run_once()
    assert conn.exists(keys.owner("broken-own")) == 0
    assert [d["code"] for d in dead_letters(conn, keys)] == [b"invalid_payload"]
    assert all(conn.get(keys.owner(job.id)) == worker.fence for job in good.jobs)
    with WorkerThread(worker):
        wait_for(lambda: all(j.status() == "done" for j in good.jobs), timeout=30)
    good.check(tiny_model)
    assert starts == []  # fresh entries all: no START round trip
    client.close()


# -- smaller ones -------------------------------------------------------------------------


def test_a_job_id_ending_in_a_newline_is_refused() -> None:
    from tokenq.protocol import JobRequest, ProtocolError

    with pytest.raises(ProtocolError):
        JobRequest(prompt="x", job_id="job\n").validate()


def test_dead_letters_keep_a_bounded_prefix_of_huge_entries(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    add_raw(conn, keys, {"v": "2", "id": "huge", "data": pack({"prompt": "p" * (10 << 20)})})
    small = {"prompt": "x", "params": {"nucleus": 1}}
    add_raw(conn, keys, {"v": "2", "id": "small", "data": pack(small)})
    with WorkerThread(Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))):
        wait_for(lambda: conn.xlen(keys.dead) == 2)
    letters = {d["job_id"]: d for d in dead_letters(conn, keys)}
    assert letters[b"huge"]["code"] == b"payload_too_large"
    assert letters[b"huge"]["truncated"] == b"1"
    assert len(letters[b"huge"]["fields"]) <= 33 << 10
    assert letters[b"small"]["truncated"] == b"0"
    assert unpack(unpack(letters[b"small"]["fields"])[b"data"]) == small
    client.close()


def test_a_broken_entry_reusing_a_jobs_id_never_adds_a_terminal_event(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    run = Run.submit(client, 1, 1000)
    (job,) = run.jobs
    broken = {"v": "2", "id": job.id, "data": b"\xc1"}
    worker = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))
    with WorkerThread(worker):
        wait_for(lambda: run.tokens_so_far()[0] > 5)
        add_raw(conn, keys, broken)  # while the job runs
        wait_for(lambda: conn.xlen(keys.dead) == 1)
        # The job runs on, still this worker's: the broken entry took nothing from it.
        assert job.status() == "running"
        assert conn.get(keys.owner(job.id)) == worker.fence
        wait_for(lambda: job.status() == "done")
        add_raw(conn, keys, broken)  # after it finished
        wait_for(lambda: conn.xlen(keys.dead) == 2)
    run.check(tiny_model)  # one terminal event: the done
    assert job.status() == "done"
    codes = [d["code"] for d in dead_letters(conn, keys)]
    assert codes == [b"invalid_payload", b"invalid_payload"]
    assert "taken over" not in str(worker.metrics.request_error_total)
    assert sum(worker.metrics.request_success_total.values()) == 1
    client.close()


def test_entries_without_a_job_key_end_their_job_with_one_terminal_event(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A producer that skips the client writes no job key. However often an entry with
    such a job's id comes (a broken one after a broken one, a good one after a good one),
    its reply gets one terminal event; later broken entries are only dead-lettered."""
    keys = Keys("faults")
    broken = {"v": "2", "id": "no-key-broken", "data": b"\xc1"}
    params = {"max_tokens": 3, "temperature": 0}
    good = {"v": "2", "id": "no-key-good", "data": pack({"prompt": "x", "params": params})}
    with RedisServer(tmp_path / "redis", aof=False) as server:
        conn = server.client()
        with WorkerProcess(tiny_model, server.url, "faults", tmp_path / "worker.log") as worker:
            worker.wait_registered()
            for n in range(1, 4):
                add_raw(conn, keys, broken)
                add_raw(conn, keys, good)
                wait_for(lambda n=n: conn.xlen(keys.dead) == n, timeout=30)
                wait_for(lambda: queued(conn, keys) == 0 and pending(conn, keys) == [])
            assert worker.alive()
        assert kinds(reply_events(conn, keys, "no-key-broken")) == [("error", "invalid_payload")]
        events = reply_events(conn, keys, "no-key-good")
        assert [e.type for e in events][-1:] == ["done"]
        assert sum(e.type in ("done", "error") for e in events) == 1
        codes = {d["job_id"]: d["code"] for d in dead_letters(conn, keys)}
        assert codes == {b"no-key-broken": b"invalid_payload"}
        conn.close()


def test_huge_entries_do_not_stall_the_jobs_beside_them(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    with pytest.raises(ValueError, match="payload_too_large"):
        client.submit("p" * (10 << 20))  # refused before it reaches Redis
    with pytest.raises(ValueError, match="logit_bias"):
        client.submit("x", logit_bias=dict.fromkeys(range(10**6), 1.0))
    assert queued(conn, keys) == 0
    run = Run.submit(client, 4, 400)
    worker = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))
    with WorkerThread(worker):
        wait_for(lambda: min(run.tokens_so_far()) > 5)
        for i, fields in enumerate(huge_entries()):
            add_raw(conn, keys, wire(fields, f"huge-{i}"))
        # Just under the client's bound, and far beyond what the context holds.
        add_raw(conn, keys, wire({"data": pack({"prompt": "word " * 190_000})}, "long"))
        gaps = []
        last = time.monotonic()
        for _ in run.jobs[0].stream(timeout=60):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        for i in range(4):
            (error,) = client.job(f"huge-{i}").stream(timeout=30)
            assert isinstance(error, ErrorEvent)
            assert error.code in ("payload_too_large", "invalid_params"), error.message
        events = list(client.job("long").stream(timeout=30))
        assert [e.code for e in events if isinstance(e, ErrorEvent)] == ["prompt_too_long"]
        wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=60)
    run.check(tiny_model)
    assert max(gaps) < 1.0, f"a bystander waited {max(gaps):.2f}s between events"
    for d in dead_letters(conn, keys):
        assert len(d["message"]) < 300
    client.close()


def test_a_dead_workers_job_is_reclaimed_within_about_the_claim_time(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    run = Run.submit(client, 1, 60)
    claim_ms = 1000
    config = fast_config(redis_namespace, claim_idle_ms=claim_ms, claim_interval_s=5.0)
    dead = Worker(make_engine(tiny_model), conn, replace(config, consumer="dead"))
    dead.register()
    while run.tokens_so_far()[0] < 3:
        dead.run_once()
    died = time.monotonic()  # its last heartbeat was no later than this
    rescuer = Worker(make_engine(tiny_model), conn, replace(config, consumer="rescuer"))
    with WorkerThread(rescuer):
        wait_for(lambda: run.jobs[0].id in rescuer.in_flight, timeout=10)
        taken = time.monotonic() - died
        wait_for(lambda: run.jobs[0].status() == "done")
    run.check(tiny_model)
    # claim_interval_s says 5 s, but a dead worker's job must not wait that long.
    assert taken < 1.6 * claim_ms / 1000, taken
    assert conn.xlen(keys.dead) == 0
    client.close()


def test_a_poison_job_fails_alone_and_its_batch_neighbours_finish(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job that breaks the forward pass is isolated and dead-lettered; so are parameters
    that used to crash the sampler. The eight jobs batched with them all finish."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    run = Run.submit(client, 8, 40)
    poison_token = 4242
    vocab = 49152
    poison = client.submit(prompt_token_ids=[300, poison_token, 301], max_tokens=8, **GREEDY)
    # Sent raw, past the client's checks: what once passed validation and broke a step.
    raw = {
        "stop-beyond-vocab": {"stop_token_ids": [vocab + 5], "min_tokens": 2},
        "tiny-penalty": {"repetition_penalty": 1e-300},
        "every-id-a-stop": {"stop_token_ids": list(range(vocab)), "min_tokens": 2},
        "infinite-bias-key": {"logit_bias": {float("inf"): 1.0}},
        "nan-temperature": {"temperature": float("nan")},
    }
    for jid, params in raw.items():
        payload = {"prompt": "x", "params": {"max_tokens": 4, **params}}
        add_raw(conn, keys, {"v": "2", "id": jid, "data": pack(payload)})
    tiny_temperature = client.submit("x", temperature=1e-300, max_tokens=6, seed=1)

    engine = make_engine(tiny_model)
    forward = engine.model_runner.model.forward

    def poisoned(input_ids: Any, positions: Any, *rest: Any) -> Any:
        if bool((input_ids == poison_token).any()):
            raise RuntimeError("poisoned batch")
        return forward(input_ids, positions, *rest)

    monkeypatch.setattr(engine.model_runner.model, "forward", poisoned)
    runner = WorkerThread(Worker(engine, conn, fast_config(redis_namespace)))
    with runner:
        wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=60)
        (error,) = poison.stream(timeout=30)
        assert isinstance(error, ErrorEvent) and error.code == "internal_error"
        assert "poisoned batch" in error.message
        for jid in raw:
            (error,) = client.job(jid).stream(timeout=30)
            assert isinstance(error, ErrorEvent) and error.code == "invalid_params", jid
        assert tiny_temperature.result(timeout=30).usage.completion_tokens == 6
        assert runner.alive()
    run.check(tiny_model)
    dead = sorted(d["job_id"].decode() for d in dead_letters(conn, keys))
    assert dead == sorted([poison.id, *raw])
    client.close()


def test_the_worker_waits_out_a_refusing_redis_but_not_a_bug() -> None:
    """Refusals that pass (as redis-py raises them) are waited out; an error that says the
    worker or the setup is wrong still ends the worker, rather than being retried forever."""
    waited = [
        redis.ConnectionError("Connection refused"),
        redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'"),
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but ..."),
        redis.ResponseError("BUSY Redis is busy running a script."),
    ]
    fatal = [
        redis.ResponseError("BUSYGROUP Consumer Group name already exists"),
        redis.ResponseError("NOGROUP No such key or consumer group"),
        redis.exceptions.NoPermissionError("this user has no permissions to run 'evalsha'"),
        redis.ResponseError("ERR Error running script: attempt to index a nil value"),
    ]
    assert all(retry.passing(exc) for exc in waited)
    assert not any(retry.passing(exc) for exc in fatal)


def test_a_full_redis_stalls_publishing_and_every_job_still_ends_once_whole(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Redis at maxmemory under noeviction refuses writes (OOM) for a second while jobs
    run: the worker waits it out as it does an outage (it used to die of it), and drops no
    event (a refused one was taken for a duplicate, and a refused end still acknowledged
    its entry): every reply is whole and ends once."""
    with RedisServer(tmp_path / "redis", aof=False) as server:
        client = Client(server.url, namespace="full", **CLIENT)
        run = Run.submit(client, 8, 300)
        config = fast_config("full", max_outbox_events=64, max_backoff_s=0.2)
        conn = redis.Redis.from_url(server.url, socket_timeout=5)
        admin = server.client()
        with WorkerThread(Worker(make_engine(tiny_model), conn, config)) as worker:
            wait_for(lambda: min(run.tokens_so_far(admin)) > 20, timeout=60)
            admin.config_set("maxmemory", "1")
            before = run.tokens_so_far(admin)
            time.sleep(1.0)  # the second of refused writes
            assert run.tokens_so_far(admin) == before  # nothing got through meanwhile
            admin.config_set("maxmemory", "0")
            wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=60)
        # Counted once stopped: a job's count follows the script call that ended it.
        assert sum(worker.metrics.request_success_total.values()) == 8
        run.check(tiny_model, admin)
        client.close()


@pytest.mark.parametrize("side", ["threads", "process"], ids=["threads", "two-processes"])
def test_the_engine_keeps_stepping_while_redis_stalls(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
    side: str,
) -> None:
    """Redis frozen for a second (DEBUG SLEEP) while jobs run: the engine steps on through
    it (its events wait in the outboxes), and every job still ends once, seamlessly; with
    the Redis side on threads beside the engine, and in a process of its own."""
    with RedisServer(tmp_path / "redis", aof=False) as server:
        client = Client(server.url, namespace="stall", **CLIENT)
        run = Run.submit(client, 8, 400)
        config = fast_config("stall", claim_idle_ms=5000)
        worker = make_worker(make_engine(tiny_model), server.url, config, side)
        with WorkerThread(worker):
            wait_for(lambda: min(run.tokens_so_far()) > 20)
            steps_before = worker.driver.engine.stats().counters["steps"]
            server.client().execute_command("DEBUG", "SLEEP", "1")  # returns after the stall
            steps_during = worker.driver.engine.stats().counters["steps"] - steps_before
            wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=60)
        assert steps_during >= 20, f"only {steps_during} engine steps while Redis slept 1 s"
        run.check(tiny_model)
        client.close()


def test_a_stop_while_redis_is_frozen_waits_out_two_socket_timeouts_at_most(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """SIGTERM's path with Redis frozen (SIGSTOP) under running jobs. The worker cannot hand
    its jobs back and leaves them to another worker's XAUTOCLAIM, but it must not wait out a
    socket timeout for each of its timers' calls (events, heartbeat, metrics, registry) in
    turn first: after the grace, at most the call each Redis thread is in, then the last
    publish. The other worker then finishes every job, once."""
    timeout = 1.0
    with RedisServer(tmp_path / "redis", aof=False) as server:
        client = Client(server.url, namespace="frozen", **CLIENT)
        run = Run.submit(client, 8, 400)
        timers = {"claim_idle_ms": 1000, "registry_interval_s": 0.2}
        conn = redis.Redis.from_url(server.url, socket_timeout=timeout)
        worker = Worker(make_engine(tiny_model), conn, fast_config("frozen", **timers))
        serving = WorkerThread(worker)
        with serving:
            wait_for(lambda: min(run.tokens_so_far()) > 20)
            server.freeze()
            frozen = time.monotonic()
            worker.stop(grace=0.2)
            serving.thread.join(timeout=30)
            took = time.monotonic() - frozen
            server.thaw()
        assert took < 0.2 + 2 * timeout + 1.0, f"stopping took {took:.1f} s"
        other = fast_config("frozen", consumer="other", **timers)
        with WorkerThread(Worker(make_engine(tiny_model), server.client(), other)):
            wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=60)
        run.check(tiny_model)
        client.close()


@pytest.mark.parametrize("side", ["threads", "process"], ids=["threads", "two-processes"])
def test_the_engine_stops_once_what_a_frozen_redis_is_owed_fills_the_outbox(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
    side: str,
) -> None:
    """Redis frozen (SIGSTOP) while 8 jobs run, an outbox of 64 events: the publisher
    waits in a Redis call, and the engine must still stop after about 64 / 8 steps, not
    run its jobs to their end into memory; after the thaw every job ends once, whole."""
    with RedisServer(tmp_path / "redis", aof=False) as server:
        client = Client(server.url, namespace="owed", **CLIENT)
        run = Run.submit(client, 8, 600)
        config = fast_config("owed", max_outbox_events=64, claim_idle_ms=30_000)
        worker = make_worker(make_engine(tiny_model), server.url, config, side)
        with WorkerThread(worker):
            wait_for(lambda: min(run.tokens_so_far()) > 20)
            driver = worker.driver
            before = driver.engine.stats().counters["steps"]
            server.freeze()
            # Held (no step starts), and the step in flight then, if any, has ended.
            wait_for(lambda: driver.paused or driver.backed_up, timeout=60)
            stepped = wait_still(lambda: driver.engine.stats().counters["steps"]) - before
            time.sleep(1.0)  # the second measured
            assert driver.engine.stats().counters["steps"] - before == stepped  # it stays stopped
            server.thaw()
            wait_for(lambda: all(j.status() == "done" for j in run.jobs), timeout=60)
        assert stepped <= 64 // 8 + 4, f"{stepped} steps with Redis frozen"
        run.check(tiny_model)
        client.close()
