"""The `tokenq` command: worker, submit, demo, bench, celery.

Every option also reads an environment variable (``--max-num-seqs`` <- ``TOKENQ_MAX_NUM_SEQS``)
so containers are configured without a command line. Only `submit` runs without torch: the
other subcommands import the engine inside their handlers, never at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from tokenq.producer import celery_bridge
from tokenq.producer.client import DEFAULT_REDIS_URL, Client
from tokenq.producer.errors import JobFailed, QueueFull
from tokenq.producer.protocol import (
    DEFAULT_NAMESPACE,
    DoneEvent,
    ErrorEvent,
    RestartEvent,
    TokenEvent,
)

EXIT_JOB_FAILED, EXIT_QUEUE_FULL, EXIT_TIMEOUT = 1, 3, 4
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `2147483648`, `2GiB`, `512M`."""
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512M, 1048576)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()])


def _env_name(flag: str) -> str:
    return "TOKENQ_" + flag.lstrip("-").replace("-", "_").upper()


def option(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str = "",
    **kwargs: Any,
) -> None:
    """An option whose default comes from its environment variable when that is set."""
    env = _env_name(flag)
    raw = os.environ.get(env)
    value = type(raw) if raw is not None else default
    parser.add_argument(
        flag, type=type, default=value, help=f"{help} [env {env}; default {default}]", **kwargs
    )


def flag_option(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    env = _env_name(flag)
    default = os.environ.get(env, "").lower() in ("1", "true", "yes", "on")
    parser.add_argument(flag, action="store_true", default=default, help=f"{help} [env {env}]")


def _common(parser: argparse.ArgumentParser) -> None:
    option(parser, "--redis-url", default=DEFAULT_REDIS_URL, help="Redis server")
    option(parser, "--namespace", default=DEFAULT_NAMESPACE, help="prefix of every Redis key")


def _engine_options(parser: argparse.ArgumentParser) -> None:
    option(parser, "--model", default="smollm2-135m", help="alias, GGUF file or HF folder")
    option(parser, "--max-num-seqs", type=int, help="requests batched at once")
    option(parser, "--max-num-batched-tokens", type=int, help="token budget per step")
    option(parser, "--block-size", type=int, help="tokens per KV block")
    option(parser, "--num-kv-blocks", type=int, help="KV pool size in blocks")
    option(parser, "--kv-cache-memory", type=parse_size, help="KV pool size in bytes (2GiB)")
    option(parser, "--max-model-len", type=int, help="context limit")
    option(parser, "--attention-backend", help="auto, cpu (C kernels), torch or triton")
    option(parser, "--device", help="auto, cpu, cuda, cuda:1")
    option(parser, "--dtype", help="auto, float32, float16, bfloat16")
    option(parser, "--num-threads", type=int, help="torch CPU threads")


ENGINE_FIELDS = (
    "model",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory",
    "max_model_len",
    "attention_backend",
    "device",
    "dtype",
    "num_threads",
)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options that were given; the rest keep EngineConfig's defaults."""
    return {f: getattr(args, f) for f in ENGINE_FIELDS if getattr(args, f) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenq", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    worker = sub.add_parser("worker", help="serve jobs from the job stream")
    _common(worker)
    _engine_options(worker)
    option(worker, "--consumer", help="consumer name; stable names replay their own jobs")
    option(worker, "--claim-idle-ms", type=int, default=60_000, help="reclaim jobs idle this long")
    option(worker, "--max-deliveries", type=int, default=3, help="dead-letter after this many")
    option(worker, "--grace-period", type=float, default=30.0, help="seconds to drain on stop")
    option(worker, "--reply-ttl", type=int, default=3600, help="reply stream TTL after the end")
    option(worker, "--metrics-interval", type=float, default=10.0, help="seconds between publishes")
    option(worker, "--log-format", default="json", choices=("json", "console"), help="log lines")
    option(worker, "--log-level", default="info", help="debug, info, warning")

    submit = sub.add_parser("submit", help="submit one job and print its reply")
    _common(submit)
    submit.add_argument("prompt", help="the user message (or raw prompt with --raw)")
    flag_option(submit, "--raw", "send the text as a raw prompt, not a chat message")
    flag_option(submit, "--stream", "print tokens as they arrive")
    flag_option(submit, "--json", "print JSON (one line per event with --stream)")
    flag_option(submit, "--no-wait", "print the job id and exit")
    option(submit, "--max-tokens", type=int, default=128, help="tokens to generate at most")
    option(submit, "--temperature", type=float, default=0.0, help="0 is greedy")
    option(submit, "--top-p", type=float, help="nucleus sampling")
    option(submit, "--seed", type=int, help="sampling seed")
    option(submit, "--priority", type=int, default=0, help="lower runs first")
    option(submit, "--job-id", help="idempotency key (default: random)")
    option(submit, "--timeout", type=float, default=600.0, help="seconds to wait for the end")
    option(submit, "--max-backlog", type=int, default=10_000, help="QueueFull beyond this")

    demo = sub.add_parser("demo", help="everything in one process, no Redis server needed")
    option(demo, "--model", default="smollm2-135m", help="alias, GGUF file or HF folder")
    option(demo, "--max-tokens", type=int, default=48, help="tokens per answer")

    celery_bridge.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks: engine, queue, kernels")
    bench.add_argument("target", choices=("engine", "queue", "kernels"))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    return parser


def cmd_worker(args: argparse.Namespace) -> int:
    from tokenq.worker.main import run_worker

    return run_worker(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from tokenq.worker.demo import run_demo

    return run_demo(model=args.model, max_tokens=args.max_tokens)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "engine":
        from tokenq.engine.bench import main as bench_engine

        bench_engine(args.args)
    elif args.target == "kernels":
        from tokenq.kernels.bench import run_kernel_bench

        run_kernel_bench()
    else:
        from tokenq.worker.bench_queue import main as bench_queue

        bench_queue(args.args)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    for name in ("top_p", "seed"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    prompt = (
        {"prompt": args.prompt}
        if args.raw
        else {"messages": [{"role": "user", "content": args.prompt}]}
    )
    with Client(args.redis_url, namespace=args.namespace, max_backlog=args.max_backlog) as client:
        try:
            job = client.submit(job_id=args.job_id, priority=args.priority, **prompt, **params)
        except QueueFull as exc:
            print(f"tokenq: {exc}", file=sys.stderr)
            return EXIT_QUEUE_FULL
        if args.no_wait:
            print(job.id)
            return 0
        try:
            if args.stream:
                return _print_stream(job.stream(timeout=args.timeout), args.json)
            done = job.result(timeout=args.timeout)
        except JobFailed as exc:
            print(f"tokenq: {exc}", file=sys.stderr)
            return EXIT_JOB_FAILED
        except TimeoutError:
            print(f"tokenq: no result for job {job.id} within {args.timeout}s", file=sys.stderr)
            return EXIT_TIMEOUT
    if args.json:
        print(json.dumps({"job_id": job.id, **_event_json(done)}))
    else:
        print(done.text)
    return 0


def _event_json(event: Any) -> dict[str, Any]:
    data = asdict(event)
    if isinstance(event, DoneEvent):
        data["usage"]["total_tokens"] = event.usage.total_tokens
    return data


def _print_stream(events: Any, as_json: bool) -> int:
    for event in events:
        if as_json:
            print(json.dumps(_event_json(event)), flush=True)
        elif isinstance(event, TokenEvent):
            print(event.text, end="", flush=True)
        elif isinstance(event, RestartEvent):
            print("\n[restarted: the worker died and the re-run differs]", flush=True)
        elif isinstance(event, DoneEvent):
            print(f"\n[{event.finish_reason}; {event.usage.completion_tokens} tokens]", flush=True)
        if isinstance(event, ErrorEvent):
            if not as_json:
                print(f"tokenq: {event.code}: {event.message}", file=sys.stderr)
            return EXIT_JOB_FAILED
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "worker": cmd_worker,
    "submit": cmd_submit,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "celery": celery_bridge.main,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
