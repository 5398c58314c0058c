"""The `tokenq` command: one entry point for every command, each declared by its module
in this folder.

The client's and operator's commands (`submit`, `models`, `batch run`, `celery`, `inspect`,
`result`, `cancel`, `dlq`, `exporter`) run with redis and msgpack alone; `serve` builds its
parser only when it runs (fastapi). The worker's (`worker`, `demo`, `bench`, in
``tokenq.cli.worker``) are imported only when one of them runs: they need torch, and on a
client-only install the command says in one line what to install instead of failing with a
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tokenq.cli import batch, celery, client, ops, serve, webhooks
from tokenq.cli.options import (  # the exit statuses, documented there
    EXIT_JOB_FAILED,
    EXIT_QUEUE_FULL,
    EXIT_TIMEOUT,
    EXIT_USAGE,
)

__all__ = ["EXIT_JOB_FAILED", "EXIT_QUEUE_FULL", "EXIT_TIMEOUT", "EXIT_USAGE", "main"]

WORKER_COMMANDS = {
    "worker": "serve jobs from the job stream (needs tokenq[worker])",
    "demo": "everything in one process, no Redis server needed (needs tokenq[worker])",
    "bench": "benchmarks: engine, queue, gateway, fleet, batch, kernels, invariance (needs "
    "tokenq[worker])",
}
WORKER_EXTRA = "pip install 'tokenq[worker]'"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenq", description="LLM inference as a message-queue worker service."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    client.add_commands(sub)
    celery.add_commands(sub)
    batch.add_commands(sub)
    serve.add_commands(sub)
    ops.add_commands(sub)
    webhooks.add_commands(sub)
    for name, help in WORKER_COMMANDS.items():
        sub.add_parser(name, help=help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in WORKER_COMMANDS:
            return _worker_command(argv)
        if argv[:1] == ["serve"]:  # its own parser, built only when it runs
            return serve.serve_main(argv[1:])
        args = build_parser().parse_args(argv)
        return args.run(args)
    except KeyboardInterrupt:
        return 130


def _worker_command(argv: list[str]) -> int:
    try:
        from tokenq.cli import worker as worker_cli
    except ImportError as exc:
        missing = exc.name or str(exc)
        print(f"tokenq {argv[0]}: {missing} is not installed: {WORKER_EXTRA}", file=sys.stderr)
        return EXIT_USAGE
    return worker_cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
