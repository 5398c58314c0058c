"""`tokenq submit` and `tokenq models`: the client's commands, with redis and msgpack
alone, never torch."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

import redis

from tokenq.cli.options import (
    EXIT_JOB_FAILED,
    EXIT_NO_REDIS,
    EXIT_QUEUE_FULL,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    JOB_MODEL_ENV,
    common_options,
    flag_option,
    option,
    refused,
)
from tokenq.producer.client import Client, ClientConfig
from tokenq.producer.errors import JobFailed, QueueFull, UnknownModel
from tokenq.protocol import LANES, DoneEvent, ErrorEvent, ProtocolError, RestartEvent, TokenEvent
from tokenq.protocol.connection import redacted


def add_commands(sub: Any) -> None:
    submit = sub.add_parser("submit", help="submit one job and print its reply")
    common_options(submit)
    submit.add_argument("prompt", help="the user message (or raw prompt with --raw)")
    flag_option(submit, "--raw", "send the text as a raw prompt, not a chat message")
    flag_option(submit, "--stream", "print tokens as they arrive")
    flag_option(submit, "--json", "print JSON (one line per event with --stream)")
    flag_option(submit, "--no-wait", "print the job id and exit")
    option(submit, "--max-tokens", type=int, default=128, help="tokens to generate at most")
    option(submit, "--temperature", type=float, default=0.0, help="0 is greedy")
    option(submit, "--top-p", type=float, help="nucleus sampling")
    option(submit, "--seed", type=int, help="sampling seed")
    option(
        submit,
        "--model",
        env=JOB_MODEL_ENV,
        help="the model's name (default: the one model served)",
    )
    option(submit, "--priority", type=int, help="lower runs first; its sign picks the lane")
    option(submit, "--lane", choices=LANES, help="interactive, default or batch")
    option(submit, "--tenant", help="whose job: lanes serve tenants in turn")
    flag_option(submit, "--queue-anyway", "queue even if no live worker serves the model")
    option(submit, "--job-id", help="idempotency key (default: random)")
    option(submit, "--timeout", type=float, default=600.0, help="seconds to wait for the end")
    option(
        submit,
        "--max-backlog",
        type=int,
        help="QueueFull beyond this many outputs in the lane (a job of n counts n)",
    )
    option(
        submit,
        "--retry-for",
        type=float,
        default=ClientConfig.retry_for,
        help="seconds to ride out an unreachable Redis",
    )
    submit.set_defaults(run=cmd_submit)

    models = sub.add_parser("models", help="list the models live workers serve")
    common_options(models)
    flag_option(models, "--json", "print JSON")
    models.set_defaults(run=cmd_models)


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
    options: dict[str, Any] = {"retry_for": args.retry_for}
    if args.max_backlog is not None:
        options["max_backlog"] = args.max_backlog
    try:  # opening a redis+cluster:// URL asks its nodes at once
        with Client(args.redis_url, namespace=args.namespace, **options) as client:
            return _submit(client, args, prompt, params)
    except redis.ConnectionError as exc:
        print(f"tokenq: cannot reach Redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
        return EXIT_NO_REDIS
    except redis.RedisError as exc:
        print(f"tokenq: {refused(args.redis_url, exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (ProtocolError, UnknownModel, ValueError) as exc:
        print(f"tokenq: {exc}", file=sys.stderr)
        return EXIT_USAGE


def cmd_models(args: argparse.Namespace) -> int:
    try:
        with Client(args.redis_url, namespace=args.namespace, retry_for=5.0) as client:
            models = client.models()
    except redis.ConnectionError as exc:
        print(f"tokenq: cannot reach Redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
        return EXIT_NO_REDIS
    except redis.RedisError as exc:
        print(f"tokenq: {refused(args.redis_url, exc)}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps([asdict(m) for m in models]))
    elif not models:
        print("no live worker")
    for m in models if not args.json else []:
        aliases = f" (also {', '.join(m.aliases)})" if m.aliases else ""
        print(f"{m.id}{aliases}: {m.workers} worker(s), context {m.max_model_len}")
    return 0


def _submit(
    client: Client, args: argparse.Namespace, prompt: dict[str, Any], params: dict[str, Any]
) -> int:
    try:
        job = client.submit(
            job_id=args.job_id,
            model=args.model,
            priority=args.priority,
            lane=args.lane,
            tenant=args.tenant,
            queue_anyway=args.queue_anyway,
            **prompt,
            **params,
        )
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
        print(json.dumps({"job_id": job.id, **event_json(done)}))
    else:
        print(done.text)
    return 0


def event_json(event: Any) -> dict[str, Any]:
    data = asdict(event)
    if isinstance(event, DoneEvent):
        data["usage"]["total_tokens"] = event.usage.total_tokens
    return data


def _print_stream(events: Any, as_json: bool) -> int:
    for event in events:
        if as_json:
            print(json.dumps(event_json(event)), flush=True)
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
