"""The `tokenq` command: one entry point for the client's commands and the worker's.

Client commands (`submit`) are declared by ``tokenq.producer.cli`` and run with redis and
msgpack alone. Worker commands (`worker`, `demo`, `bench`) belong to ``tokenq.worker.cli``,
which is imported only when one of them runs: it needs torch, and on a client-only install
the command says in one line what to install instead of failing with a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tokenq.producer import cli as client_cli
from tokenq.producer.cli import (  # the exit statuses, documented there
    EXIT_JOB_FAILED,
    EXIT_QUEUE_FULL,
    EXIT_TIMEOUT,
    EXIT_USAGE,
)

__all__ = ["EXIT_JOB_FAILED", "EXIT_QUEUE_FULL", "EXIT_TIMEOUT", "EXIT_USAGE", "main"]

WORKER_COMMANDS = {
    "worker": "serve jobs from the job stream (needs tokenq[worker])",
    "demo": "everything in one process, no Redis server needed (needs tokenq[worker])",
    "bench": "benchmarks: engine, queue, gateway, fleet, batch, kernels (needs tokenq[worker])",
}
WORKER_EXTRA = "pip install 'tokenq[worker]'"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenq", description="LLM inference as a message-queue worker service."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    client_cli.add_commands(sub)
    for name, help in WORKER_COMMANDS.items():
        sub.add_parser(name, help=help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in WORKER_COMMANDS:
            return _worker_command(argv)
        if argv[:1] == ["serve"]:  # its own parser, built only when it runs
            return client_cli.serve_main(argv[1:])
        args = build_parser().parse_args(argv)
        return args.run(args)
    except KeyboardInterrupt:
        return 130


def _worker_command(argv: list[str]) -> int:
    try:
        from tokenq.worker import cli as worker_cli
    except ImportError as exc:
        missing = exc.name or str(exc)
        print(f"tokenq {argv[0]}: {missing} is not installed: {WORKER_EXTRA}", file=sys.stderr)
        return EXIT_USAGE
    return worker_cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
