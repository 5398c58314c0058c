"""`tokenq bench batch`: `tokenq batch run` (its own process, through Redis to a worker on
this engine) against the same engine alone, on W1's prompts as text; target at least 0.95."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tokenq.bench.common import WARM_UP, add_engine_options, engine_from, warm_up
from tokenq.bench.queue import BENCH_NAME, RunResult, connect, delete_namespace, run_beside
from tokenq.protocol.connection import DEFAULT_REDIS_URL
from tokenq.worker.config import WorkerConfig
from tokenq.worker.logs import LogSettings, configure_logging


def run_direct(engine: Any, prompts: list[str], params: dict[str, Any]) -> RunResult:
    """The requests as text straight into the engine, all at once."""
    start = time.monotonic()
    for i, text in enumerate(prompts):
        engine.add_request(f"direct-{i}", prompt=text, params=dict(params))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(out.completion_tokens for out in engine.step() if out.finished)
    return RunResult(time.monotonic() - start, tokens, [])


def batch_file(path: Path, prompts: list[str], params: dict[str, Any]) -> Path:
    with path.open("w") as f:
        for i, text in enumerate(prompts):
            body = {"model": BENCH_NAME, "prompt": text, **params}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            f.write(json.dumps(line) + "\n")
    return path


def run_batch(engine: Any, url: str, namespace: str, source: Path, workdir: Path) -> RunResult:
    """The batch command, timed from its start to its exit, against a worker on this
    engine run as `tokenq worker` runs it."""
    from tokenq.worker.host import make_worker

    config = WorkerConfig(namespace=namespace, served_names=(BENCH_NAME,))
    worker = make_worker(engine, url, config, logs=LogSettings(json=False, level="warning"))
    out = workdir / f"out-{uuid.uuid4().hex[:8]}.jsonl"
    cmd = [
        sys.executable, "-m", "tokenq.cli", "batch", "run", str(source), str(out),
        "--redis-url", url, "--namespace", namespace, "--no-progress", "--queue-anyway",
        "--batch-id", uuid.uuid4().hex[:12],
    ]  # fmt: skip
    outcome: dict[str, Any] = {}

    def command() -> None:
        start = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        outcome["seconds"] = time.monotonic() - start
        outcome["status"], outcome["stderr"] = done.returncode, done.stderr
        worker.stop(grace=0)

    run_beside(worker, command)
    if outcome["status"] != 0:
        raise RuntimeError(f"tokenq batch run failed: {outcome['stderr'][-2000:]}")
    tokens = 0
    with out.open() as f:
        for line in f:
            tokens += json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
    return RunResult(outcome["seconds"], tokens, [])


def main(argv: list[str] | None = None) -> None:
    from tokenq.bench.engine import w1

    ap = argparse.ArgumentParser(prog="tokenq bench batch", description=__doc__)
    add_engine_options(ap)
    ap.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument(
        "--repeat", type=int, default=2, help="alternate the two sides; keep each side's best"
    )
    args = ap.parse_args(argv)

    configure_logging(json=False, level="warning")
    engine = engine_from(args)
    workload = w1(args.requests, args.prompt_len, args.gen)
    prompts = [engine.tokenizer.decode(ids) for ids in workload.prompts]
    params = {"max_tokens": args.gen, "temperature": 0.0}
    conn = connect(
        args.redis_url, required=f"tokenq bench batch: no Redis server at {args.redis_url}"
    )
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    directs: list[RunResult] = []
    batches: list[RunResult] = []
    try:
        with tempfile.TemporaryDirectory(prefix="tokenq-bench-batch-") as tmp:
            work = Path(tmp)
            source = batch_file(work / "in.jsonl", prompts, params)
            warm = batch_file(work / "warm.jsonl", prompts[:8], WARM_UP)
            warm_up(engine, workload.prompts[:8])
            run_batch(engine, args.redis_url, namespace, warm, work)
            for _ in range(args.repeat):  # alternating: drifting machine load hits both
                directs.append(run_direct(engine, prompts, params))
                batches.append(run_batch(engine, args.redis_url, namespace, source, work))
    finally:
        delete_namespace(conn, namespace)
        conn.close()
    if len({r.tokens for r in directs + batches}) != 1:
        raise SystemExit(f"the runs generated different token counts: {directs} {batches}")
    direct = max(directs, key=lambda r: r.tokens_per_s)
    batch = max(batches, key=lambda r: r.tokens_per_s)
    print(
        f"{len(prompts)} requests ({args.prompt_len}-token W1 prompts as text, up to "
        f"{args.gen} tokens), {engine.model_config.num_layers}-layer model on "
        f"{engine.device}, best of {args.repeat}"
    )
    print(f"{'':<14}{'seconds':>10}{'tokens':>10}{'tok/s':>10}")
    for name, run in (("engine", direct), ("batch run", batch)):
        print(f"{name:<14}{run.seconds:>10.2f}{run.tokens:>10}{run.tokens_per_s:>10.1f}")
    print(f"batch/engine throughput {batch.tokens_per_s / direct.tokens_per_s:.3f}")
