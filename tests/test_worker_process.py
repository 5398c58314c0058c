"""`tokenq worker` as a real process: SIGTERM drains or hands back, SIGKILL loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from tests.faults import RedisServer, TcpProxy, WorkerProcess
from tests.redis_fixtures import CLIENT
from tests.worker_support import (
    WorkerThread,
    check_reply,
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
from tokenq.bench.queue import process_cpu
from tokenq.producer.client import AsyncClient, Client, Job, make_request
from tokenq.protocol import TokenEvent, decode_event
from tokenq.worker.worker import Worker

pytestmark = pytest.mark.usefixtures("single_torch_thread")

GREEDY = {"temperature": 0, "ignore_eos": True}
CLAIM_IDLE_MS = 1000


# Tokens: a job still running when the test interrupts it, however fast the host (at 200 a
# faster host had finished them before a SIGTERM's hand-back).
LONG = 1000


def worker_process(
    model: Path, url: str, namespace: str, tmp_path: Path, grace: float
) -> WorkerProcess:
    extra = ["--claim-idle-ms", str(CLAIM_IDLE_MS), "--grace-period", str(grace)]
    return WorkerProcess(model, url, namespace, tmp_path / "w.log", extra=extra)


def tokens_so_far(conn: redis.Redis, client: Client, job: Job) -> int:
    events = [decode_event(i, f) for i, f in conn.xrange(client.keys.reply(job.id))]
    return sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent))


def wait_started(conn: redis.Redis, client: Client, jobs: list[Job]) -> None:
    """Until every job has a token in its reply stream: all are mid-generation."""
    wait_for(lambda: all(tokens_so_far(conn, client, j) > 0 for j in jobs), timeout=60)


def submit(client: Client, n: int, max_tokens: int) -> tuple[list[Job], list[dict]]:
    prompts = [f"story number {i}" for i in range(n)]
    jobs = client.submit_many(make_request(p, max_tokens=max_tokens, **GREEDY) for p in prompts)
    requests = [{"prompt": p, "params": {"max_tokens": max_tokens, **GREEDY}} for p in prompts]
    return jobs, requests


def test_a_worker_and_both_clients_reach_redis_over_a_unix_socket(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A worker beside its Redis may skip TCP: `unix://` URLs serve `tokenq worker`, the
    client and the async client (which the gateway uses). redis-py refuses TCP keepalive
    on a socket file, at the first command: each refused to start before."""
    with RedisServer(tmp_path / "redis", aof=False, unix_socket=True) as server:
        url = server.unix_url
        client = Client(url, namespace="unix", **CLIENT)
        jobs, requests = submit(client, 2, 12)
        with worker_process(tiny_model, url, "unix", tmp_path, 5) as worker:
            replies = [check_reply(list(j.stream(timeout=60))) for j in jobs]

            async def through_the_async_client() -> list[int]:
                aclient = AsyncClient(url, namespace="unix", **CLIENT)
                try:
                    job = await aclient.submit(requests[0]["prompt"], **requests[0]["params"])
                    return (await job.result(timeout=60)).token_ids
                finally:
                    await aclient.aclose()

            again = asyncio.run(through_the_async_client())
            worker.proc.send_signal(signal.SIGTERM)
            worker.wait_clean_exit(timeout=30)
        expected = reference_run(tiny_model, requests)
        for reply, (_, final) in zip(replies, expected, strict=True):
            assert reply.done.token_ids == final.token_ids
        assert again == expected[0][1].token_ids
        assert pending(client.redis, client.keys) == []
        client.close()


def test_a_worker_warns_at_start_when_redis_may_evict_its_keys(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """At maxmemory an evicting Redis may drop a queued job or the owner key that fences
    it, silently: the worker says so in its log, and stays quiet under noeviction."""

    def log_of_a_start(server: RedisServer, name: str) -> str:
        log = tmp_path / f"{name}.log"
        with WorkerProcess(tiny_model, server.url, "evict", log, consumer=name) as worker:
            worker.wait_registered()
            worker.proc.send_signal(signal.SIGTERM)
            worker.wait_clean_exit(timeout=30)
        return log.read_text()

    with RedisServer(tmp_path / "redis", aof=False) as server:
        assert "jobs can be lost" not in log_of_a_start(server, "default")
        conn = server.client()
        conn.config_set("maxmemory", "256mb")
        conn.config_set("maxmemory-policy", "volatile-lru")  # evicts keys with a TTL
        lines = log_of_a_start(server, "lru").splitlines()
        (warning,) = [json.loads(line) for line in lines if "jobs can be lost" in line]
        assert warning["level"] == "warning"
        assert warning["maxmemory_policy"] == "volatile-lru"
        assert warning["maxmemory"] == str(256 * 1024 * 1024)


def refusal(model: Path, url: str, namespace: str, log: Path) -> dict:
    """`tokenq worker` on a server it cannot run on: it exits 1 with one error line (its
    log entry, returned) and no traceback."""
    with WorkerProcess(model, url, namespace, log) as worker:
        assert worker.proc.wait(timeout=120) == 1, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text
    (line,) = [json.loads(row) for row in text.splitlines() if '"worker not started"' in row]
    assert line["level"] == "error"
    return line


def test_a_worker_refuses_a_redis_older_than_its_scripts_need(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Before 6.2 Redis has no XAUTOCLAIM, and a worker there would quietly never take over
    a dead worker's jobs: it says so in one line and exits, without registering."""
    with RedisServer(tmp_path / "redis", aof=False) as server, TcpProxy(server.port) as proxy:
        real = str(server.client().info("server")["redis_version"])
        proxy.report_version("6.0." + "1" * (len(real) - 4))  # as long as the real one
        line = refusal(tiny_model, proxy.url, "old", tmp_path / "w.log")
        assert line["error"].startswith("Redis 6.0.1")
        assert line["error"].endswith("is too old: tokenq needs Redis 6.2 or newer")
        assert server.client().zcard("old:workers") == 0


def test_a_worker_refuses_a_redis_cluster_node(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A cluster node whose slots are not served (here a lone node, none assigned) cannot
    hold the queue: one line, exit 1 (it was a traceback from the first registration)."""
    with RedisServer(tmp_path / "redis", aof=False, cluster=True) as server:
        line = refusal(tiny_model, server.url, "cluster", tmp_path / "w.log")
        assert line["error"].startswith("a Redis Cluster node not usable as a cluster: ")


def test_sigterm_finishes_jobs_in_flight_within_the_grace_period(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    jobs, _ = submit(client, 3, 300)
    with worker_process(tiny_model, redis_url, redis_namespace, tmp_path, 60) as worker:
        wait_started(conn, client, jobs)
        worker.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "taking no more jobs" in worker.log.read_text(), timeout=60)
        later = client.submit("submitted after the stop", max_tokens=4)
        worker.wait_clean_exit(timeout=60)
    for job in jobs:
        reply = check_reply(list(job.stream(timeout=5)))
        assert reply.done.usage.completion_tokens == 300
    assert later.status() == "queued"  # a stopping worker takes no new job
    assert queued(conn, client.keys) == 1
    assert pending(conn, client.keys) == []
    client.close()


def test_sigterm_past_the_grace_leaves_jobs_for_another_worker(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    jobs, requests = submit(client, 3, LONG)
    with worker_process(tiny_model, redis_url, redis_namespace, tmp_path, 0) as worker:
        wait_started(conn, client, jobs)
        worker.proc.send_signal(signal.SIGTERM)
        worker.wait_clean_exit(timeout=30)
    held = pending(conn, client.keys)
    assert len(held) == 3
    # Handed back: idle already long enough for any worker's XAUTOCLAIM.
    assert all(p["time_since_delivered"] >= CLAIM_IDLE_MS for p in held)
    assert all(j.status() == "running" for j in jobs)  # started, not finished
    check_seamless_takeover(tiny_model, client, jobs, requests, redis_namespace)


def test_a_killed_worker_loses_no_job_and_duplicates_no_token(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    jobs, requests = submit(client, 3, LONG)
    with worker_process(tiny_model, redis_url, redis_namespace, tmp_path, 30) as worker:
        wait_started(conn, client, jobs)
        worker.kill()
    assert len(pending(conn, client.keys)) == 3
    check_seamless_takeover(tiny_model, client, jobs, requests, redis_namespace)


def check_seamless_takeover(
    model: Path, client: Client, jobs: list[Job], requests: list[dict], namespace: str
) -> None:
    """Another worker finishes the jobs; each reply reads as one uninterrupted run."""
    already = [tokens_so_far(client.redis, client, j) for j in jobs]
    start = time.monotonic()
    config = fast_config(namespace, consumer="rescuer", claim_idle_ms=CLAIM_IDLE_MS)
    with WorkerThread(Worker(make_engine(model), client.redis, config)):
        replies = [check_reply(list(j.stream(timeout=60))) for j in jobs]
    assert time.monotonic() - start < 60
    expected = reference_run(model, requests)
    for reply, (_, final), before in zip(replies, expected, already, strict=True):
        assert not any(e.type == "restart" for e in reply.events)
        assert reply.done.token_ids == final.token_ids
        assert len(reply.token_ids) == len(final.token_ids) > before
    assert queued(client.redis, client.keys) == 0
    assert pending(client.redis, client.keys) == []
    client.close()


# -- two processes: the engine's and the queue process it spawns (worker/host.py) ------------


def test_ctrl_c_reaching_both_processes_counts_as_one_stop(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> None:
    """A terminal's ctrl-C signals every process of the worker; counted twice it would
    hand the jobs back at once instead of draining them."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    jobs, _ = submit(client, 3, 300)
    with worker_process(tiny_model, redis_url, redis_namespace, tmp_path, 60) as worker:
        wait_started(conn, client, jobs)
        worker.signal_all(signal.SIGINT)
        worker.wait_clean_exit(timeout=60)
    for job in jobs:
        assert check_reply(list(job.stream(timeout=5))).done.usage.completion_tokens == 300
    assert pending(conn, client.keys) == []
    client.close()


def test_a_killed_engine_process_has_its_jobs_handed_back_at_once(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> None:
    """The OOM killer picks the biggest process, the engine's: the queue process sees its
    pipe close, publishes what it had, hands the jobs back and exits."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    jobs, requests = submit(client, 3, LONG)
    with worker_process(tiny_model, redis_url, redis_namespace, tmp_path, 30) as worker:
        wait_started(conn, client, jobs)
        queue_pid = worker.queue_pid()
        os.kill(worker.pid, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{queue_pid}").exists(), timeout=30)
        assert "its jobs were handed back" in worker.log.read_text()
    held = pending(conn, client.keys)
    assert len(held) == 3
    assert all(p["time_since_delivered"] >= CLAIM_IDLE_MS for p in held)
    assert conn.zscore(client.keys.workers, "proc") is None  # deregistered on the way out
    check_seamless_takeover(tiny_model, client, jobs, requests, redis_namespace)


def test_a_killed_queue_process_ends_the_worker_and_its_jobs_wait_for_another(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    jobs, requests = submit(client, 3, LONG)
    with worker_process(tiny_model, redis_url, redis_namespace, tmp_path, 30) as worker:
        wait_started(conn, client, jobs)
        os.kill(worker.queue_pid(), signal.SIGKILL)
        assert worker.proc.wait(timeout=30) != 0
        assert "the queue process failed" in worker.log.read_text()
    assert len(pending(conn, client.keys)) == 3
    check_seamless_takeover(tiny_model, client, jobs, requests, redis_namespace)


def test_a_frozen_queue_process_stops_the_engine_and_its_jobs_end_whole_after_the_thaw(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> None:
    """The engine's process keeps stepping only while the pipe to a queue process that
    stopped reading (SIGSTOP, a swapped-out or debugged process) has room: then it waits
    in its write, holding nothing more, and the jobs go on where they were at the thaw.
    Every step is a write here (`--stream-interval 0`), so the pipe fills long before the
    jobs could end."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    jobs, requests = submit(client, 8, LONG)
    extra = ["--stream-interval", "0", "--max-num-seqs", "8"]
    log = tmp_path / "w.log"
    with WorkerProcess(tiny_model, redis_url, redis_namespace, log, extra=extra) as worker:
        wait_started(conn, client, jobs)
        queue_pid = worker.queue_pid()
        os.kill(queue_pid, signal.SIGSTOP)
        try:
            used = wait_still(lambda: process_cpu(worker.pid), by=0.1, over=1.0, timeout=60)
            time.sleep(1)  # the second measured
            assert process_cpu(worker.pid) - used < 0.2  # waiting in its write, not stepping
        finally:
            os.kill(queue_pid, signal.SIGCONT)
        assert min(tokens_so_far(conn, client, j) for j in jobs) < LONG
        replies = [check_reply(list(j.stream(timeout=60))) for j in jobs]
        worker.proc.send_signal(signal.SIGTERM)
        worker.wait_clean_exit(timeout=30)
    for reply, (_, final) in zip(replies, reference_run(tiny_model, requests), strict=True):
        assert not any(e.type == "restart" for e in reply.events)
        assert reply.done.token_ids == final.token_ids
    assert pending(conn, client.keys) == []
    assert conn.xlen(client.keys.dead) == 0
    client.close()


def test_auto_gives_the_redis_side_a_process_only_where_torch_leaves_a_core(
    tiny_model: Path,  # noqa: F811
) -> None:
    import torch

    from tokenq.worker.host import make_worker, own_process_pays

    engine = make_engine(tiny_model)
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        assert not own_process_pays(engine)
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert own_process_pays(engine)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="process"):
        make_worker(engine, "redis://127.0.0.1:1", fast_config("x"), side="elsewhere")


def test_the_workers_log_names_its_model_and_the_dtype_it_computes_in_and_why(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
    redis_url: str,
    redis_namespace: str,
) -> None:
    log = tmp_path / "worker.log"
    with WorkerProcess(tiny_model, redis_url, redis_namespace, log) as worker:
        worker.wait_registered()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    loading = next(line for line in lines if line["event"] == "loading model")
    assert loading["model"] == str(tiny_model)
    dtype = next(line for line in lines if line["event"].startswith("computing in"))
    assert dtype["event"] == "computing in float32 on cpu (dtype given)"
    assert dtype["level"] == "info" and dtype["logger"].startswith("tokenq.engine")
