"""`tokenq bench queue`: W1 through Redis against the same engine run directly, in tokens per
second and time to first token (the client in a process of its own, as an app server's)."""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tokenq.bench.common import (
    GREEDY,
    WARM_UP,
    add_engine_options,
    add_warm_up_option,
    engine_from,
    warm_up,
)
from tokenq.producer.client import Client, make_request
from tokenq.protocol import DoneEvent, ErrorEvent, TokenEvent
from tokenq.protocol.connection import DEFAULT_REDIS_URL
from tokenq.worker.config import REDIS_SIDES, WorkerConfig
from tokenq.worker.logs import LogSettings, configure_logging

BENCH_NAME = "bench"  # the model name the benchmark's worker serves


@dataclass
class RunResult:
    seconds: float
    tokens: int
    ttft: list[float]
    steps: tuple[float, float] | None = None  # from StepClock.time, where the run was timed
    # CPU seconds each party beside the engine used in a queue run, where they are processes
    # of their own: on a host whose cores the engine fills, that is what slows its steps.
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


class StepClock:
    """The engine's steps timed from outside: steps that take longer through the queue than
    directly show the CPU (or interpreter lock) the Redis side took."""

    def __init__(self, engine: Any) -> None:
        self._reset()
        step = engine.step

        def timed(between_layers: Any = None) -> Any:
            began = time.monotonic()
            try:
                return step(between_layers)
            finally:
                ended = time.monotonic()
                self.stepping += ended - began
                self.first = began if self.first is None else self.first
                self.last = ended

        engine.step = timed

    def _reset(self) -> None:
        self.stepping = 0.0
        self.first: float | None = None
        self.last = 0.0

    def time(self, run: Callable[[], RunResult]) -> RunResult:
        """`run()`, with (seconds stepping, seconds from first step to last) as `steps`."""
        self._reset()
        result = run()
        span = 0.0 if self.first is None else self.last - self.first
        result.steps = (self.stepping, span)
        return result


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: with 32 samples p99 is the slowest one, which is what a user sees."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run_direct(engine: Any, prompts: list[list[int]], params: dict[str, Any]) -> RunResult:
    start = time.monotonic()
    for i, ids in enumerate(prompts):
        engine.add_request(f"direct-{i}", prompt_token_ids=ids, params=dict(params))
    ttft: list[float] = []
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens += out.completion_tokens
                ttft.append(out.metrics.ttft)
    return RunResult(time.monotonic() - start, tokens, ttft)


def run_queue(
    engine: Any,
    conn: Any,
    namespace: str,
    prompts: list[list[int]],
    params: dict[str, Any],
    client_process: Callable[..., None] | None = None,
    redis_side: str = "auto",
    **worker_options: Any,
) -> RunResult:
    """The worker as `tokenq worker --redis-side` runs it, the client in a process of its
    own (`client_process`: another client, such as the gateway's SDK side; a thread with
    fakeredis). `worker_options`: WorkerConfig fields."""
    from tokenq.worker.host import EngineHost, make_worker
    from tokenq.worker.worker import Worker

    config = WorkerConfig(namespace=namespace, served_names=(BENCH_NAME,), **worker_options)
    outcome: dict[str, Any] = {}
    url = _url_of(conn)
    worker: Worker | EngineHost
    if url is None:  # fakeredis: the client must share this process
        worker = Worker(engine, conn, config)

        def client_side() -> None:
            try:
                outcome["result"] = stream_jobs(
                    Client(conn, namespace=namespace, model=BENCH_NAME), prompts, params
                )
            except BaseException as exc:  # re-raised in the main thread
                outcome["error"] = exc
            finally:
                worker.stop(grace=0)

    else:
        # Started before the client: spawning a queue process takes a second or two.
        logs = LogSettings(json=False, level="warning")
        worker = make_worker(engine, url, config, redis_side, logs)
        ctx = multiprocessing.get_context("spawn")
        results = ctx.SimpleQueue()
        target = client_process or _client_process
        proc = ctx.Process(target=target, args=(url, namespace, prompts, params, results))
        before = _side_cpu(conn, worker)
        proc.start()

        def client_side() -> None:
            try:
                outcome.update(results.get())
                result = outcome.get("result")
                if isinstance(result, RunResult):  # (other benches' clients return others)
                    after = _side_cpu(conn, worker)
                    result.cpu.update({k: after[k] - before[k] for k in after})
            finally:
                worker.stop(grace=0)

    run_beside(worker, client_side)
    if "error" in outcome:
        raise (
            RuntimeError(outcome["error"])
            if isinstance(outcome["error"], str)
            else outcome["error"]
        )
    return outcome["result"]


def run_beside(worker: Any, side: Callable[[], None]) -> None:
    """The worker on this thread (torch is slower in another) while `side`, on a thread of
    its own, drives the run and stops the worker; raises if the queue process failed."""
    waiter = threading.Thread(target=side, daemon=True)
    waiter.start()
    code = worker.run() or 0
    waiter.join()
    if code:
        raise RuntimeError(f"the worker's queue process failed (exit code {code})")


def _client(conn: Any, namespace: str) -> Client:
    # The worker registers as it starts, maybe after the first submit: queue anyway.
    return Client(conn, namespace=namespace, model=BENCH_NAME, require_worker=False)


def _url_of(conn: Any) -> str | None:
    kwargs = conn.connection_pool.connection_kwargs
    if type(conn).__module__.startswith("fakeredis"):
        return None
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    if "host" not in kwargs:
        return None
    return f"redis://{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


def _side_cpu(conn: Any, worker: Any) -> dict[str, float]:
    """CPU seconds used so far by the queue process (where there is one) and redis-server."""
    cpu = {}
    pid = getattr(worker, "queue_pid", None)
    used = None if pid is None else process_cpu(pid)
    if used is not None:
        cpu["queue process"] = used
    info = conn.info("cpu")
    cpu["redis-server"] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return cpu


def process_cpu(pid: int) -> float | None:
    """A process's CPU seconds (user + system) so far; None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_process(
    url: str, namespace: str, prompts: list[list[int]], params: dict[str, Any], results: Any
) -> None:
    try:
        used = time.process_time()
        result = stream_jobs(Client(url, namespace=namespace, model=BENCH_NAME), prompts, params)
        result.cpu["client process"] = time.process_time() - used
        results.put({"result": result})
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def stream_jobs(client: Client, prompts: list[list[int]], params: dict[str, Any]) -> RunResult:
    # Connected, with the workers' registry read, before the clock starts: an application's
    # client is long-lived, and its first call's connection is no cost of the queue.
    client.models()
    start = time.monotonic()
    jobs = client.submit_many(make_request(prompt_token_ids=ids, **params) for ids in prompts)
    first: dict[str, float] = {}
    tokens = 0
    for job, event in client.stream_many(jobs, timeout=3600):
        if isinstance(event, TokenEvent):
            first.setdefault(job.id, time.monotonic() - start)
        elif isinstance(event, DoneEvent):
            tokens += event.usage.completion_tokens
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(f"job {job.id} failed: {event.code}: {event.message}")
    return RunResult(time.monotonic() - start, tokens, list(first.values()))


def connect(url: str, *, required: str | None = None) -> Any:
    """The given Redis server; when none answers, an in-process fakeredis, or exit with
    `required` for a bench whose other side is a process that cannot share one."""
    conn = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        conn.ping()
        return conn
    except redis.ConnectionError:
        if required is not None:
            raise SystemExit(required) from None
        import fakeredis

        print(f"no Redis at {url}: using an in-process fakeredis (slower than a server)")
        return fakeredis.FakeRedis()


def delete_namespace(conn: Any, namespace: str) -> None:
    """Every key a bench left under its fresh namespace: the server may be shared."""
    keys = list(conn.scan_iter(match=f"{namespace}:*", count=1000))
    if keys:
        conn.delete(*keys)


def main(argv: list[str] | None = None) -> None:
    from tokenq.bench.engine import w1

    ap = argparse.ArgumentParser(prog="tokenq bench queue", description=__doc__)
    add_engine_options(ap)
    ap.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument(
        "--repeat", type=int, default=2, help="alternate the two sides; keep each side's best"
    )
    ap.add_argument(
        "--stream-interval",
        type=float,
        default=WorkerConfig.stream_interval_s,
        help="the worker's (tokenq worker --stream-interval)",
    )
    ap.add_argument(
        "--redis-side",
        default="auto",
        choices=REDIS_SIDES,
        help="where the worker's Redis side runs (tokenq worker --redis-side)",
    )
    ap.add_argument(
        "--direct-ids-only",
        action="store_true",
        help="run the engine directly with detokenize=False: in two processes the worker "
        "decodes text beside the engine's thread, and this shows what the queue costs "
        "beyond that",
    )
    add_warm_up_option(ap)
    args = ap.parse_args(argv)

    configure_logging(json=False, level="warning")
    engine = engine_from(args)
    workload = w1(args.requests, args.prompt_len, args.gen)
    interval = {"stream_interval_s": args.stream_interval, "redis_side": args.redis_side}
    params = {**GREEDY, "max_tokens": args.gen}
    direct_params = {**params, "detokenize": False} if args.direct_ids_only else params
    conn = connect(args.redis_url)
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    directs: list[RunResult] = []
    queues: list[RunResult] = []
    clock = StepClock(engine)
    try:
        if args.warm_up:
            warm_up(engine, workload.prompts)
            run_queue(engine, conn, namespace, workload.prompts, WARM_UP, **interval)
        for _ in range(args.repeat):  # alternating, so drifting machine load hits both sides
            directs.append(clock.time(lambda: run_direct(engine, workload.prompts, direct_params)))
            queues.append(
                clock.time(
                    lambda: run_queue(engine, conn, namespace, workload.prompts, params, **interval)
                )
            )
    finally:
        delete_namespace(conn, namespace)
    direct = max(directs, key=lambda r: r.tokens_per_s)
    queued = max(queues, key=lambda r: r.tokens_per_s)

    print(
        f"{workload.name}, {engine.model_config.num_layers}-layer model on {engine.device}, "
        f"stream interval {args.stream_interval} s, the worker's Redis side "
        f"{args.redis_side}, best of {args.repeat}"
        + (", the engine directly without decoding text" if args.direct_ids_only else "")
    )
    print(f"{'':<10}{'tok/s':>10}{'TTFT p50':>12}{'TTFT p99':>12}")
    for name, run in (("engine", direct), ("queue", queued)):
        p50, p99 = percentile(run.ttft, 50), percentile(run.ttft, 99)
        print(f"{name:<10}{run.tokens_per_s:>10.1f}{p50:>11.3f}s{p99:>11.3f}s")
    added50 = percentile(queued.ttft, 50) - percentile(direct.ttft, 50)
    added99 = percentile(queued.ttft, 99) - percentile(direct.ttft, 99)
    print(
        f"queue/engine throughput {queued.tokens_per_s / direct.tokens_per_s:.3f}; "
        f"added TTFT p50 {added50 * 1000:+.1f} ms, p99 {added99 * 1000:+.1f} ms"
    )
    if args.repeat > 1:
        # Best against best can pair two runs minutes apart; on a noisy host each queue run
        # against the direct run just before it says more (their median most of all: one
        # burst's added TTFT moved from +5 to +35 ms between pairs on a 2-vCPU VM).
        runs = list(zip(directs, queues, strict=True))
        pairs = [q.tokens_per_s / d.tokens_per_s for d, q in runs]
        added = [(percentile(q.ttft, 50) - percentile(d.ttft, 50)) * 1000 for d, q in runs]
        print(
            f"each pair (a direct run, then a queue run): throughput "
            f"{', '.join(f'{r:.3f}' for r in pairs)} (median {statistics.median(pairs):.3f}); "
            f"added TTFT p50 {', '.join(f'{a:+.1f}' for a in added)} ms "
            f"(median {statistics.median(added):+.1f} ms)"
        )
    for name, run in (("engine", direct), ("queue", queued)):
        assert run.steps is not None
        stepping, span = run.steps
        print(
            f"{name}: steps took {stepping:.3f} s of {span:.3f} s from the first step to the "
            f"last ({stepping / span:.1%} stepping)"
        )
    if queued.cpu:
        parts = ", ".join(f"{name} {used:.2f} s" for name, used in queued.cpu.items())
        per_token = sum(queued.cpu.values()) / max(1, queued.tokens) * 1e6
        where = "" if "queue process" in queued.cpu else " (the Redis side: engine's threads)"
        print(f"CPU beside the engine in that run: {parts}: {per_token:.0f} us a token{where}")
