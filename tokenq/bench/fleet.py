"""`tokenq bench fleet`: priority lanes on one worker: interactive TTFT under a batch backlog
against idle (target p99 at most 2x), batch throughput beside them against alone (0.9)."""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tokenq.bench.common import GREEDY, add_engine_options, engine_from, warm_up
from tokenq.bench.queue import delete_namespace, percentile, run_beside
from tokenq.producer.client import Client, make_request
from tokenq.protocol import DoneEvent, ErrorEvent, TokenEvent
from tokenq.protocol.connection import DEFAULT_REDIS_URL
from tokenq.worker.config import WorkerConfig
from tokenq.worker.logs import LogSettings, configure_logging

NAME = "bench-fleet"


@dataclass
class Workload:
    batch: list[list[int]]  # prompts
    batch_gen: int
    interactive: list[list[int]]
    interactive_gen: int
    interval: float


def prompts(n: int, length: int, offset: int) -> list[list[int]]:
    return [[200 + (offset + i * 7 + j) % 30000 for j in range(length)] for i in range(n)]


def client_side(url: str, namespace: str, work: Workload, mode: str, results: Any) -> None:
    """Submit and follow the jobs of one run; put {batch_tok_s, ttfts} on `results`."""
    client = Client(url, namespace=namespace, model=NAME, require_worker=False)
    out: dict[str, Any] = {"ttfts": []}
    try:
        batch_done = threading.Event()
        if mode in ("batch", "both"):
            reqs = [
                make_request(prompt_token_ids=p, lane="batch", max_tokens=work.batch_gen, **GREEDY)
                for p in work.batch
            ]
            start = time.monotonic()
            jobs = client.submit_many(reqs)

            def follow_batch() -> None:
                tokens = 0
                for _, event in client.stream_many(jobs, timeout=24 * 3600):
                    if isinstance(event, DoneEvent):
                        tokens += event.usage.completion_tokens
                    elif isinstance(event, ErrorEvent):
                        raise RuntimeError(f"{event.code}: {event.message}")
                out["batch_tok_s"] = tokens / (time.monotonic() - start)
                batch_done.set()

            follower = threading.Thread(target=follow_batch, daemon=True)
            follower.start()
            time.sleep(work.interval)  # the backlog is being served
        if mode in ("interactive", "both"):
            for ids in work.interactive:
                if batch_done.is_set():
                    break
                sent = time.monotonic()
                job = client.submit(
                    prompt_token_ids=ids, lane="interactive", max_tokens=work.interactive_gen,
                    **GREEDY,
                )  # fmt: skip
                for event in job.stream(timeout=600):
                    if isinstance(event, TokenEvent) and event.token_ids:
                        out["ttfts"].append(time.monotonic() - sent)
                        break
                job.result(timeout=600)
                time.sleep(max(0.0, work.interval - (time.monotonic() - sent)))
        if mode in ("batch", "both"):
            follower.join()
        results.put(out)
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        client.close()


def run(engine: Any, url: str, work: Workload, mode: str) -> dict[str, Any]:
    from tokenq.worker.host import make_worker

    namespace = f"bench-fleet-{uuid.uuid4().hex[:8]}"
    conn = Client(url).redis
    config = WorkerConfig(namespace=namespace, served_names=(NAME,))
    worker = make_worker(engine, url, config, logs=LogSettings(json=False, level="warning"))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    proc = ctx.Process(target=client_side, args=(url, namespace, work, mode, results))
    proc.start()
    outcome: dict[str, Any] = {}

    def wait() -> None:
        outcome.update(results.get())
        worker.stop(grace=0)

    try:
        run_beside(worker, wait)
    finally:
        proc.join()
        delete_namespace(conn, namespace)
    if "error" in outcome:
        raise RuntimeError(outcome["error"])
    return outcome


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tokenq bench fleet", description=__doc__)
    add_engine_options(ap)  # --max-num-seqs and --max-num-batched-tokens set a step's length
    ap.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    ap.add_argument("--batch-jobs", type=int, default=2000)
    ap.add_argument("--batch-prompt-len", type=int, default=64)
    ap.add_argument("--batch-gen", type=int, default=32)
    ap.add_argument("--interactive", type=int, default=10, help="interactive jobs at most")
    ap.add_argument("--interactive-prompt-len", type=int, default=64)
    ap.add_argument("--interactive-gen", type=int, default=16)
    ap.add_argument("--interval", type=float, default=3.0, help="seconds between interactive")
    args = ap.parse_args(argv)

    configure_logging(json=False, level="warning")
    engine = engine_from(args)
    work = Workload(
        prompts(args.batch_jobs, args.batch_prompt_len, 0),
        args.batch_gen,
        prompts(args.interactive, args.interactive_prompt_len, 10_000),
        args.interactive_gen,
        args.interval,
    )
    warm_up(engine, work.batch[: engine.config.max_num_seqs] + work.interactive)
    alone = run(engine, args.redis_url, work, "batch")
    idle = run(engine, args.redis_url, work, "interactive")
    both = run(engine, args.redis_url, work, "both")
    n = len(both["ttfts"])
    if n == 0:
        sys.exit(
            "tokenq bench fleet: the batch backlog was served before any interactive job was "
            "sent under load: give it more --batch-jobs or a shorter --interval"
        )
    print(
        f"{args.batch_jobs} batch jobs ({args.batch_prompt_len}+{args.batch_gen} tokens), "
        f"interactive ({args.interactive_prompt_len}+{args.interactive_gen}) every "
        f"{args.interval}s; {engine.model_config.num_layers}-layer model on {engine.device}, "
        f"max_num_seqs {engine.config.max_num_seqs}, max_num_batched_tokens "
        f"{engine.config.max_num_batched_tokens}"
    )
    idle_ttft = idle["ttfts"][:n] or idle["ttfts"]
    print(f"{'':<26}{'p50':>9}{'p99':>9}")
    for name, values in (
        ("interactive TTFT, idle", idle_ttft),
        ("under batch load", both["ttfts"]),
    ):
        print(f"{name:<26}{percentile(values, 50):>8.3f}s{percentile(values, 99):>8.3f}s")
    ratio = percentile(both["ttfts"], 99) / percentile(idle_ttft, 99)
    throughput = both["batch_tok_s"] / alone["batch_tok_s"]
    print(f"interactive jobs under load: {n}; p99 TTFT {ratio:.2f}x idle (target <= 2)")
    print(
        f"batch tok/s: alone {alone['batch_tok_s']:.1f}, with interactive "
        f"{both['batch_tok_s']:.1f} ({throughput:.3f}, target >= 0.9)"
    )
