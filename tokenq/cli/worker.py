"""The worker's share of the `tokenq` command: `worker`, `demo` and `bench`.

Options and their defaults come from the settings they fill: `EngineConfig` and
`WorkerConfig` hold the defaults (shown in --help), this module only names the flags; an
option not given leaves the dataclass default in place. One engine per device, in the
process started; `tokenq worker` spawns its Redis side beside it (worker/host.py), never
forks: CUDA does not survive forking, and one engine already batches everything the device
holds."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

from tokenq.bench.main import TARGETS as BENCH_TARGETS
from tokenq.bench.main import main as bench_main
from tokenq.cli.options import common_options, option, parse_size
from tokenq.engine.config import EngineConfig
from tokenq.protocol import MODEL_RE
from tokenq.worker.config import REDIS_SIDES, WorkerConfig, default_consumer
from tokenq.worker.logs import LogSettings, configure_logging

# EngineConfig field -> (parser of the flag's value, help)
ENGINE_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "model": (str, "alias, GGUF file or HF folder"),
    "max_num_seqs": (int, "requests batched at once"),
    "max_num_batched_tokens": (int, "token budget per step"),
    "block_size": (int, "tokens per KV block"),
    "num_kv_blocks": (int, "KV pool size in blocks"),
    "kv_cache_memory": (parse_size, "KV pool size in bytes (2GiB)"),
    "max_model_len": (int, "context limit"),
    "attention_backend": (str, "auto, cpu (C kernels), torch or triton"),
    "device": (str, "auto, cpu, cuda, cuda:1"),
    "dtype": (
        str,
        "auto (bf16 on CUDA, and on CPUs where bf16 outruns fp32), float32, float16, bfloat16",
    ),
    "num_threads": (int, "torch CPU threads"),
    "quantization": (
        str,
        "gguf (a quantized GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K blocks run as they "
        "are on the CPU's quantized kernels), int8 (that, and float weights to int8 per "
        "channel), none; unset: every weight dequantized",
    ),
}
# WorkerConfig field -> (flag, parser, help)
WORKER_OPTIONS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "consumer": ("--consumer", str, "consumer name; stable names replay their own jobs"),
    "claim_idle_ms": ("--claim-idle-ms", int, "reclaim jobs idle this long"),
    "max_deliveries": ("--max-deliveries", int, "dead-letter after this many deliveries"),
    "grace_period_s": ("--grace-period", float, "seconds to drain on stop"),
    "reply_ttl_s": ("--reply-ttl", int, "reply stream TTL after the end"),
    "stream_interval_s": (
        "--stream-interval",
        float,
        "seconds between a job's token events after its first; longer costs Redis, clients "
        "and the engine less per token (0: every step)",
    ),
    "metrics_interval_s": ("--metrics-interval", float, "seconds between metrics publishes"),
    "registry_interval_s": (
        "--registry-interval",
        float,
        "seconds between registry heartbeats (they carry the load that /dashboard rates)",
    ),
    "metrics_port": ("--metrics-port", int, "serve Prometheus /metrics on this port; 0: off"),
    "metrics_addr": ("--metrics-addr", str, "address the metrics server binds"),
}


def _defaults(config: type) -> dict[str, Any]:
    return {
        f.name: f.default
        for f in dataclasses.fields(config)
        if f.default is not dataclasses.MISSING
    }


def engine_options(parser: argparse.ArgumentParser) -> None:
    defaults = _defaults(EngineConfig)
    for name, (parse, help) in ENGINE_OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        option(parser, flag, type=parse, help=help, shown=defaults[name])


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options that were given; the rest keep EngineConfig's defaults."""
    return {f: getattr(args, f) for f in ENGINE_OPTIONS if getattr(args, f) is not None}


def worker_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The worker options that were given; the rest keep WorkerConfig's defaults."""
    return {f: getattr(args, f) for f in WORKER_OPTIONS if getattr(args, f) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenq")
    sub = parser.add_subparsers(dest="command", required=True)

    worker = sub.add_parser("worker", help="serve jobs from the job stream")
    common_options(worker)
    engine_options(worker)
    defaults = _defaults(WorkerConfig)
    for name, (flag, parse, help) in WORKER_OPTIONS.items():
        shown = defaults.get(name, "host-pid")
        option(worker, flag, type=parse, dest=name, help=help, shown=shown)
    option(
        worker,
        "--served-model-name",
        type=_names,
        help="the names jobs use for this model, comma-separated or repeated (vLLM's flag); "
        "default: the --model alias or file/folder name",
        action="extend",
    )
    option(
        worker,
        "--redis-side",
        default="auto",
        choices=REDIS_SIDES,
        help="where the Redis work runs: a process of its own beside the engine's, which "
        "keeps the engine's interpreter lock free, or threads of the engine's process; "
        "auto: the process on a GPU or where torch leaves a CPU core free (docs/design.md)",
    )
    option(worker, "--log-format", default="json", choices=("json", "console"), help="log lines")
    option(worker, "--log-level", default="info", help="debug, info, warning")
    worker.set_defaults(run=run_worker)

    demo = sub.add_parser("demo", help="everything in one process, no Redis server needed")
    option(demo, "--model", default=EngineConfig.model, help="alias, GGUF file or HF folder")
    option(demo, "--max-tokens", type=int, default=48, help="tokens per answer")
    demo.set_defaults(run=run_demo)

    bench = sub.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(BENCH_TARGETS),
        description="\n".join(f"{name}: {what}" for name, what in BENCH_TARGETS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("target", choices=BENCH_TARGETS, help="--help after it: its options")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(run=run_bench)
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def served_names(model: str, given: list[str] | None) -> tuple[str, ...]:
    """The names jobs use to reach this worker, its model's id first: the
    --served-model-name values, else the alias or the file or folder name as given."""
    names = list(dict.fromkeys(given or [model if "/" not in model else Path(model).name]))
    bad = [n for n in names if not MODEL_RE.fullmatch(n)]
    if bad:
        raise SystemExit(f"tokenq worker: model names must match {MODEL_RE.pattern}: {bad}")
    return tuple(names)


def run_worker(args: argparse.Namespace) -> int:
    from tokenq.engine import LLMEngine
    from tokenq.worker.host import make_worker
    from tokenq.worker.worker import UnsupportedRedis

    configure_logging(json=args.log_format == "json", level=args.log_level)
    log = structlog.get_logger("tokenq.worker")
    engine_config = EngineConfig(**engine_kwargs(args))
    given = {k: v for k, v in engine_kwargs(args).items() if k != "model"}
    log.info("loading model", model=engine_config.model, **given)
    engine = LLMEngine(engine_config)
    options = worker_kwargs(args)
    options.setdefault("consumer", default_consumer())
    names = served_names(engine_config.model, args.served_model_name)
    config = WorkerConfig(namespace=args.namespace, served_names=names, **options)
    logs = LogSettings(json=args.log_format == "json", level=args.log_level)
    try:
        runner = make_worker(engine, args.redis_url, config, args.redis_side, logs)
    except RuntimeError as exc:  # the queue process did not start
        log.error("worker not started", error=str(exc))
        return 1

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # First signal: drain within the grace period. Second: hand back at once.
        runner.stop(grace=0 if runner.stopping else None)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return runner.run() or 0
    except UnsupportedRedis:  # on the Redis side's threads (logged)
        return 1


def run_demo(args: argparse.Namespace) -> int:
    from tokenq.demo import run_demo as demo

    return demo(model=args.model, max_tokens=args.max_tokens)


def run_bench(args: argparse.Namespace) -> int:
    return bench_main(args.target, args.args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
