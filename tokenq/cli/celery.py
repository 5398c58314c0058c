"""`tokenq celery`: the bridge (tokenq/celery/bridge.py), a Celery worker that serves the
task ``tokenq.generate`` through the queue. Declared with redis alone; it needs celery only
when it runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tokenq.celery.bridge import DEFAULT_QUEUE, INSTALL_HINT
from tokenq.cli.options import (
    JOB_MODEL_ENV,
    common_options,
    durable_option,
    flag_option,
    option,
)


def add_commands(sub: Any) -> None:
    """The ``celery`` subcommand's options (each also an environment variable)."""
    parser = sub.add_parser("celery", help="serve the Celery task tokenq.generate (a worker)")
    common_options(parser)
    option(parser, "--broker", help="Celery broker URL (redis://host:6379/1, amqp://...)")
    option(parser, "--backend", help="Celery result backend URL (progress and results)")
    option(parser, "--queue", default=DEFAULT_QUEUE, help="the Celery queue to consume")
    option(parser, "--concurrency", type=int, default=64, help="tasks followed at once")
    option(parser, "--celery-config", help="module of Celery settings (like celeryconfig)")
    option(parser, "--max-backlog", type=int, help="QueueFull beyond this, every lane")
    option(parser, "--model", env=JOB_MODEL_ENV, help="the model of tasks that name none")
    flag_option(parser, "--queue-anyway", "queue jobs for models no live worker serves yet")
    durable_option(parser)
    option(parser, "--max-retries", type=int, default=10, help="retries: QueueFull, Redis down")
    option(parser, "--retry-backoff", type=float, default=1.0, help="first retry's pause (s)")
    option(parser, "--log-level", default="info", help="debug, info, warning")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import celery  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    from tokenq.celery.bridge import serve

    return serve(args)
