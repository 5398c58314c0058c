"""`tokenq webhooks run | add | list | remove | secret`: the dispatcher and the namespace's
endpoints (docs/protocol.md, "Webhooks"). Needs tokenq[webhooks]."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any

import redis
import redis.asyncio as aioredis

from tokenq.cli.options import EXIT_NO_REDIS, EXIT_USAGE, common_options, flag_option, option
from tokenq.protocol import Keys
from tokenq.protocol.connection import connect_async, redacted

EXTRA = "pip install 'tokenq[webhooks]'"


def add_commands(sub: Any) -> None:
    p = sub.add_parser("webhooks", help="deliver webhook events; the namespace's endpoints")
    cmds = p.add_subparsers(dest="webhooks_command", required=True)

    run = cmds.add_parser("run", help="a dispatcher: deliver webhook events, signed and retried")
    common_options(run)
    _secret_option(run)
    flag_option(
        run,
        "--allow-private-webhooks",
        "allow http and loopback, private and link-local addresses (development and tests)",
    )
    option(run, "--retry-for", type=float, default=24 * 3600.0, help="seconds to retry an event")
    option(run, "--first-backoff", type=float, default=1.0, help="first retry's pause (s)")
    option(run, "--max-backoff", type=float, default=600.0, help="longest pause between tries (s)")
    option(run, "--attempt-timeout", type=float, default=10.0, help="seconds per attempt")
    option(run, "--per-endpoint", type=int, default=8, help="attempts at once to one endpoint")
    option(run, "--max-held", type=int, default=1000, help="events held at once")
    option(
        run, "--claim-idle-ms", type=int, default=60_000, help="take over entries idle this long"
    )
    option(run, "--max-body", type=int, default=256 * 1024, help="bytes of a body (text cut)")
    option(run, "--consumer", default=None, help="consumer name (default host-pid-random)")
    option(run, "--metrics-port", type=int, default=None, help="serve Prometheus metrics here")
    run.set_defaults(run=_run)

    add = cmds.add_parser("add", help="register an endpoint; prints its secret once")
    common_options(add)
    _secret_option(add)
    add.add_argument("url")
    add.add_argument(
        "--events",
        default="job.completed",
        help="comma-separated event types (job.completed, "
        "batch.completed, batch.failed, batch.cancelled, batch.expired)",
    )
    add.set_defaults(run=_reaching_redis(_add))

    listing = cmds.add_parser("list", help="the namespace's endpoints (no secrets)")
    common_options(listing)
    listing.set_defaults(run=_reaching_redis(_list))

    remove = cmds.add_parser("remove", help="delete an endpoint")
    common_options(remove)
    remove.add_argument("endpoint_id")
    remove.set_defaults(run=_reaching_redis(_remove))

    secret = cmds.add_parser("secret", help="print a fresh whsec_ secret for --webhook-secret")
    secret.set_defaults(run=_new_secret)


def _secret_option(parser: argparse.ArgumentParser) -> None:
    option(
        parser,
        "--webhook-secret",
        help="the namespace's whsec_ secret: signs jobs' webhooks, derives endpoints' secrets",
    )


def _secret(args: argparse.Namespace) -> str | None:
    if not args.webhook_secret:
        print(
            "tokenq webhooks: --webhook-secret (TOKENQ_WEBHOOK_SECRET) is required", file=sys.stderr
        )
        return None
    from tokenq.webhooks.whsec import secret_bytes

    try:
        secret_bytes(args.webhook_secret)
    except ValueError as exc:
        print(f"tokenq webhooks: {exc}", file=sys.stderr)
        return None
    return args.webhook_secret


def _imports() -> bool:
    try:
        import httpx  # noqa: F401
        import standardwebhooks  # noqa: F401
    except ImportError as exc:
        print(f"tokenq webhooks: {exc.name} is not installed: {EXTRA}", file=sys.stderr)
        return False
    return True


def _run(args: argparse.Namespace) -> int:
    secret = _secret(args) if _imports() else None
    if secret is None:
        return EXIT_USAGE
    from tokenq.webhooks.dispatcher import Dispatcher, DispatcherConfig

    fields: dict[str, Any] = {}
    if args.consumer:
        fields["consumer"] = args.consumer
    config = DispatcherConfig(
        secret=secret,
        namespace=args.namespace,
        allow_private=args.allow_private_webhooks,
        retry_for_s=args.retry_for,
        first_backoff_s=args.first_backoff,
        max_backoff_s=args.max_backoff,
        attempt_timeout_s=args.attempt_timeout,
        per_endpoint=args.per_endpoint,
        max_held=args.max_held,
        claim_idle_ms=args.claim_idle_ms,
        max_body_bytes=args.max_body,
        **fields,
    )

    async def main() -> None:
        conn = await connect_async(args.redis_url)
        dispatcher = Dispatcher(conn, config)
        if args.metrics_port is not None:
            dispatcher.metrics.serve(args.metrics_port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, dispatcher.stop)
        try:
            await dispatcher.run()
        finally:
            await conn.aclose()

    try:
        asyncio.run(main())
    except (redis.ConnectionError, OSError) as exc:
        print(f"tokenq webhooks: Redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
        return EXIT_NO_REDIS
    return 0


class _NoRedis(Exception):
    """Redis could not be reached: one line on stderr, exit 1 (no traceback)."""


def _reaching_redis(command: Any) -> Any:
    """`command`, answering exit 1 when Redis could not be reached (said in one line)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except _NoRedis:
            return EXIT_NO_REDIS

    return run


def _with_redis(args: argparse.Namespace, work: Any) -> Any:
    async def main() -> Any:
        conn = await connect_async(args.redis_url)
        try:  # the endpoints' keys are the namespace's own: any node of a cluster routes them
            return await work(
                conn if isinstance(conn, aioredis.Redis) else conn.redis, Keys(args.namespace)
            )
        finally:
            await conn.aclose()

    try:
        return asyncio.run(main())
    except (redis.ConnectionError, OSError) as exc:
        print(f"tokenq webhooks: Redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
        raise _NoRedis from None


def _add(args: argparse.Namespace) -> int:
    secret = _secret(args) if _imports() else None
    if secret is None:
        return EXIT_USAGE
    from tokenq.webhooks import endpoints

    events = [e.strip() for e in args.events.split(",") if e.strip()]
    try:
        endpoint, its_secret = _with_redis(
            args, lambda conn, keys: endpoints.add(conn, keys, args.url, events, "", secret)
        )
    except ValueError as exc:
        print(f"tokenq webhooks add: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps({**endpoint.shown(), "secret": its_secret}, indent=2))
    print("the secret is shown once: keep it with the receiver", file=sys.stderr)
    return 0


def _list(args: argparse.Namespace) -> int:
    if not _imports():
        return EXIT_USAGE
    from tokenq.webhooks import endpoints

    found = _with_redis(args, lambda conn, keys: endpoints.listed(conn, keys))
    print(json.dumps([e.shown() for e in found], indent=2))
    return 0


def _remove(args: argparse.Namespace) -> int:
    if not _imports():
        return EXIT_USAGE
    from tokenq.webhooks import endpoints

    removed = _with_redis(args, lambda conn, keys: endpoints.remove(conn, keys, args.endpoint_id))
    if not removed:
        print(f"tokenq webhooks remove: no endpoint {args.endpoint_id}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _new_secret(args: argparse.Namespace) -> int:
    if not _imports():
        return EXIT_USAGE
    from tokenq.webhooks.whsec import new_secret

    print(new_secret())
    return 0
