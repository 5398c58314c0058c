"""`tokenq serve`: the OpenAI API gateway over the queue (tokenq/server/)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from tokenq.cli.options import (
    EXIT_NO_REDIS,
    EXIT_USAGE,
    common_options,
    durable_option,
    flag_option,
    option,
    parse_size,
)


def add_commands(sub: Any) -> None:
    """`tokenq serve`, the OpenAI API gateway (tokenq/server/gateway.py). Its options are parsed
    by `serve_parser` once the command runs: importing the gateway (fastapi) when any other
    command builds its parser would cost every command about half a second to start."""
    serve = sub.add_parser(
        "serve", help="the OpenAI API over the queue (needs tokenq[serve])", add_help=False
    )
    serve.add_argument("args", nargs=argparse.REMAINDER)
    serve.set_defaults(run=lambda parsed: serve_main(parsed.args))


def serve_parser() -> argparse.ArgumentParser:
    from tokenq.server.batch_api import BatchConfig
    from tokenq.server.gateway import GatewayConfig

    serve = argparse.ArgumentParser(
        prog="tokenq serve", description="The OpenAI API over the queue."
    )
    common_options(serve)
    option(serve, "--host", default="127.0.0.1", help="address to listen on")
    option(serve, "--port", type=int, default=8000, help="port to listen on")
    option(
        serve,
        "--max-body",
        type=parse_size,
        default=GatewayConfig.max_body_bytes,
        help="request bodies over this many bytes get 413",
    )
    option(
        serve,
        "--request-timeout",
        type=float,
        default=GatewayConfig.request_timeout,
        help="seconds: a job's deadline (the X-Tokenq-Timeout header may shorten it); 504",
    )
    option(
        serve,
        "--cancel-grace",
        type=float,
        default=GatewayConfig.cancel_grace,
        help="seconds a job whose client left waits for a retry before it is cancelled",
    )
    option(
        serve,
        "--retry-after",
        type=int,
        default=GatewayConfig.retry_after,
        help="seconds, in the Retry-After of a 429 (queue full)",
    )
    option(
        serve,
        "--max-backlog",
        type=int,
        help="429 beyond this many outputs in a model's lane (a job of n counts n)",
    )
    durable_option(serve)
    option(
        serve,
        "--max-file",
        type=parse_size,
        default=BatchConfig.max_file_bytes,
        help="batch input files over this many bytes get 413",
    )
    option(
        serve,
        "--batch-lock-ttl",
        type=float,
        default=BatchConfig.lock_ttl_s,
        help="seconds after which a dead gateway's batches are taken over",
    )
    option(
        serve,
        "--batch-poll",
        type=float,
        default=BatchConfig.poll_s,
        help="seconds between the batch runner's looks at Redis",
    )
    option(
        serve,
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="the gateway's and uvicorn's log level",
    )
    flag_option(
        serve, "--log-payloads", "log prompts and outputs at INFO (debugging: never in production)"
    )
    access_options(serve)
    return serve


def access_options(serve: argparse.ArgumentParser) -> None:
    """Keys, limits and the admin address (docs/security.md)."""
    from tokenq.server.auth import Policy

    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a key /v1/* accepts as 'Authorization: Bearer KEY' (repeatable) "
        "[env TOKENQ_API_KEY: comma-separated]",
    )
    option(
        serve,
        "--api-keys-file",
        type=Path,
        help="keys with their tenants and limits, one a line; reread on SIGHUP",
    )
    option(serve, "--admin-key", help="needed for /metrics and /dashboard")
    option(
        serve,
        "--webhook-secret",
        help="the namespace's whsec_ secret: enables /v1/webhooks (each endpoint's secret "
        "derives from it)",
    )
    option(
        serve,
        "--admin-port",
        type=int,
        help="serve /metrics and /dashboard on this port instead of the public one",
    )
    option(serve, "--admin-host", default="127.0.0.1", help="the admin port's address")
    defaults = Policy()
    for flag, default, what in (
        ("--requests-per-minute", 0, "requests a minute per key (0: no limit)"),
        ("--tokens-per-minute", 0, "prompt and max_tokens a minute per key (0: no limit)"),
        ("--max-concurrent-jobs", 0, "jobs a key runs at once (0: no limit)"),
    ):
        option(serve, flag, type=int, default=default, help=what)
    option(
        serve,
        "--storage-per-key",
        type=parse_size,
        default=defaults.storage_bytes,
        help="bytes of files a key may hold at once (0: no limit)",
    )


def api_keys(given: list[str]) -> tuple[str, ...]:
    """--api-key flags, else TOKENQ_API_KEY (comma-separated)."""
    if given:
        return tuple(given)
    return tuple(k.strip() for k in os.environ.get("TOKENQ_API_KEY", "").split(",") if k.strip())


def _not_installed(missing: str | None) -> int:
    print(f"tokenq serve: {missing} is not installed: pip install 'tokenq[serve]'", file=sys.stderr)
    return EXIT_USAGE


def serve_main(argv: list[str]) -> int:
    """`tokenq serve ...` (the dispatcher sends it here before any other parsing)."""
    try:
        parser = serve_parser()
    except ImportError as exc:
        return _not_installed(exc.name)
    from redis import ConnectionError as Unreachable

    from tokenq.protocol.connection import redacted
    from tokenq.server.auth import KeyFileError, Policy
    from tokenq.server.batch_api import BatchConfig
    from tokenq.server.gateway import GatewayConfig, serve

    args = parser.parse_args(argv)
    if args.webhook_secret:
        from tokenq.webhooks.whsec import secret_bytes

        try:
            secret_bytes(args.webhook_secret)
        except ValueError as exc:
            print(f"tokenq serve: --webhook-secret: {exc}", file=sys.stderr)
            return EXIT_USAGE
    policy = Policy(
        requests_per_minute=args.requests_per_minute,
        tokens_per_minute=args.tokens_per_minute,
        concurrent_jobs=args.max_concurrent_jobs,
        storage_bytes=args.storage_per_key,
    )
    config = GatewayConfig(
        redis_url=args.redis_url,
        namespace=args.namespace,
        max_body_bytes=args.max_body,
        request_timeout=args.request_timeout,
        cancel_grace=args.cancel_grace,
        retry_after=args.retry_after,
        max_backlog=args.max_backlog,
        durable_submit=args.durable_submit,
        api_keys=api_keys(args.api_key),
        api_keys_file=args.api_keys_file,
        key_policy=policy,
        admin_key=args.admin_key,
        admin_port=args.admin_port,
        admin_host=args.admin_host,
        log_payloads=args.log_payloads,
        webhook_secret=args.webhook_secret,
    )
    batches = BatchConfig(
        max_file_bytes=args.max_file, poll_s=args.batch_poll, lock_ttl_s=args.batch_lock_ttl
    )
    try:
        serve(config, args.host, args.port, args.log_level, batches)
    except KeyFileError as exc:
        print(f"tokenq serve: --api-keys-file: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Unreachable as exc:  # no seed of a redis+cluster:// URL answered
        where = redacted(args.redis_url)
        print(f"tokenq serve: cannot reach Redis at {where}: {exc}", file=sys.stderr)
        return EXIT_NO_REDIS
    return 0
