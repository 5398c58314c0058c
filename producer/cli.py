"""The client's share of the `tokenq` command (`submit`, `models`, `celery`, `batch run`,
`serve`, and the operator's commands of ``tokenq.producer.ops``: `inspect`, `result`,
`cancel`, `dlq`, `exporter`), and the option helpers every command uses.

Every option also reads an environment variable (``--max-num-seqs`` <- ``TOKENQ_MAX_NUM_SEQS``)
so containers are configured without a command line. Nothing here needs torch; the worker's
commands live in ``tokenq.worker.cli`` and ``tokenq.cli`` dispatches between the two.

Exit statuses: 0 done; 1 the job failed (its error printed); 2 usage, a bad request, an
unknown id, or Redis unreachable (one line naming the URL); 3 QueueFull; 4 no result within
--timeout (or, for `result`, the job has not ended); 130 interrupted. `batch run`: 1 when
some lines failed (their answers in the errors file).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis

from tokenq.producer import celery_bridge
from tokenq.producer.client import DEFAULT_REDIS_URL, Client, ClientConfig
from tokenq.producer.errors import JobFailed, QueueFull, UnknownModel
from tokenq.producer.protocol import (
    DEFAULT_NAMESPACE,
    LANES,
    DoneEvent,
    ErrorEvent,
    ProtocolError,
    RestartEvent,
    TokenEvent,
)

EXIT_JOB_FAILED, EXIT_USAGE, EXIT_QUEUE_FULL, EXIT_TIMEOUT = 1, 2, 3, 4
EXIT_NO_REDIS = EXIT_USAGE
# Enough queued jobs to keep a fleet's engines full, few enough to hold in memory.
BATCH_MAX_OUTSTANDING = 512
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
    value = default
    if raw is not None:
        try:
            value = type(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            # Every command's parser is built at start: not the usage of whichever is first.
            print(f"tokenq: {env}: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
    parser.add_argument(
        flag, type=type, default=value, help=f"{help} [env {env}; default {default}]", **kwargs
    )


def flag_option(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    env = _env_name(flag)
    default = os.environ.get(env, "").lower() in ("1", "true", "yes", "on")
    parser.add_argument(flag, action="store_true", default=default, help=f"{help} [env {env}]")


def redis_url(text: str) -> str:
    """A --redis-url read as redis-py will read it: a malformed one is a usage error at
    once, not a traceback when the first connection is made (a worker's, after it loaded
    its model)."""
    try:
        redis.connection.parse_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{redacted(text)}: {exc}") from None
    return text


def common_options(parser: argparse.ArgumentParser) -> None:
    """Where the queue is: every command that talks to Redis takes these."""
    option(
        parser,
        "--redis-url",
        type=redis_url,
        default=DEFAULT_REDIS_URL,
        help="Redis server: redis://, rediss:// or unix:// (a socket file)",
    )
    option(parser, "--namespace", default=DEFAULT_NAMESPACE, help="prefix of every Redis key")


def add_commands(sub: Any) -> None:
    """The client's commands: they need redis and msgpack, never torch."""
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
    option(submit, "--model", help="the model's name (default: the one model served)")
    option(submit, "--priority", type=int, help="lower runs first; its sign picks the lane")
    option(submit, "--lane", choices=LANES, help="interactive, default or batch")
    option(submit, "--tenant", help="whose job: lanes serve tenants in turn")
    flag_option(submit, "--queue-anyway", "queue even if no live worker serves the model")
    option(submit, "--job-id", help="idempotency key (default: random)")
    option(submit, "--timeout", type=float, default=600.0, help="seconds to wait for the end")
    option(submit, "--max-backlog", type=int, help="QueueFull beyond this many jobs in the lane")
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
    celery_bridge.add_parser(sub)
    _add_batch(sub)
    add_serve(sub)
    from tokenq.producer import ops  # ops uses this module's helpers: import it once they exist

    ops.add_commands(sub)


def _add_batch(sub: Any) -> None:
    batch = sub.add_parser("batch", help="OpenAI batch files: run one through the queue")
    actions = batch.add_subparsers(dest="action", required=True)
    run = actions.add_parser(
        "run",
        help="submit every line of an OpenAI batch file, write the answers; rerun to resume",
    )
    common_options(run)
    run.add_argument("input", type=Path, help="requests, one OpenAI batch line each (JSONL)")
    run.add_argument("output", type=Path, help="answers, appended (OpenAI batch output lines)")
    option(run, "--errors", type=Path, help="failed lines (default: OUTPUT's name + .errors)")
    option(run, "--model", help="run every line on this model, whatever its body names")
    option(
        run,
        "--max-outstanding",
        type=int,
        default=BATCH_MAX_OUTSTANDING,
        help="jobs queued and not yet written at most",
    )
    option(run, "--batch-id", help="the batch's name (default: from the input's bytes)")
    flag_option(run, "--queue-anyway", "queue even if no live worker serves a line's model")
    flag_option(run, "--no-progress", "no progress bar")
    option(
        run,
        "--retry-for",
        type=float,
        default=ClientConfig.retry_for,
        help="seconds to ride out an unreachable Redis",
    )
    run.set_defaults(run=cmd_batch_run)


def cmd_batch_run(args: argparse.Namespace) -> int:
    """Exit 0: every line answered with a result; 1: finished, some lines failed (see the
    errors file); 2: the batch cannot run; 130: interrupted (the same command resumes)."""
    # Imported here: the conversion comes with the gateway's module, and tqdm is an extra.
    try:
        from tqdm import tqdm

        from tokenq.producer import batch
    except ImportError as exc:
        print(
            f"tokenq batch: {exc.name} is not installed: pip install 'tokenq[batch]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    errors = args.errors or args.output.with_name(args.output.name + ".errors")
    if not args.input.is_file():
        print(f"tokenq batch: no input file {args.input}", file=sys.stderr)
        return EXIT_USAGE
    if args.max_outstanding < 1:
        print("tokenq batch: --max-outstanding must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    content_id, total = batch.scan_input(args.input)
    batch_id = args.batch_id or content_id
    if not batch.BATCH_ID_RE.fullmatch(batch_id):
        print(f"tokenq batch: --batch-id must match {batch.BATCH_ID_RE.pattern}", file=sys.stderr)
        return EXIT_USAGE
    bar = tqdm(total=total, unit="req", disable=args.no_progress, dynamic_ncols=True)

    def on_answer(counts: Any) -> None:  # called under the run's lock: one at a time
        rate = f"{counts.tokens_per_s():.0f}"
        bar.set_postfix(ok=counts.succeeded, failed=counts.failed, tok_s=rate, refresh=False)
        bar.update(counts.answered - bar.n)

    client = Client(args.redis_url, namespace=args.namespace, retry_for=args.retry_for)
    files = None
    run = None
    interrupted = False
    try:
        done = batch.load_done([args.output, errors], batch_id)
        files = batch.ResultFiles(args.output, errors)
        run = batch.BatchRun(
            client,
            files,
            batch_id,
            model=args.model,
            max_outstanding=args.max_outstanding,
            queue_anyway=args.queue_anyway,
            on_answer=on_answer,
        )
        run.counts.total = total
        counts = run.run(batch.read_lines(args.input), done)
    except batch.BatchError as exc:
        print(f"tokenq batch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except redis.ConnectionError as exc:
        print(
            f"tokenq batch: cannot reach Redis at {redacted(args.redis_url)}: {exc}",
            file=sys.stderr,
        )
        return EXIT_NO_REDIS
    except redis.RedisError as exc:  # a command refused: out of memory, read-only, ACL, ...
        print(f"tokenq batch: {refused(args.redis_url, exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        if run is not None and not interrupted:  # interrupted: os._exit below ends it all
            run.close()
        client.close()
        if files is not None:
            files.close()  # every answer so far is on disk: a re-run skips them
    if interrupted:
        print("tokenq batch: interrupted; run the same command to resume", file=sys.stderr)
        sys.stderr.flush()
        # Leave at once: the interrupt may have stopped this thread inside a lock that the
        # threads following replies need, and the interpreter's exit would wait for them
        # (once, in CI, for more than 30 s). The jobs queued run on; a re-run follows them.
        os._exit(130)
    print(
        f"batch {batch_id}: {counts.total} lines: {counts.succeeded} done, "
        f"{counts.failed} failed, {counts.already} answered before; "
        f"{counts.tokens} tokens at {counts.tokens_per_s():.1f} tokens/s; "
        f"results in {args.output}, errors in {errors}",
        file=sys.stderr,
    )
    return EXIT_JOB_FAILED if counts.failed else 0


def add_serve(sub: Any) -> None:
    """`tokenq serve`, the OpenAI API gateway (producer/gateway.py). Its options are parsed
    by `serve_parser` once the command runs: importing the gateway (fastapi) when any other
    command builds its parser would cost every command about half a second to start."""
    serve = sub.add_parser(
        "serve", help="the OpenAI API over the queue (needs tokenq[serve])", add_help=False
    )
    serve.add_argument("args", nargs=argparse.REMAINDER)
    serve.set_defaults(run=lambda parsed: serve_main(parsed.args))


def serve_parser() -> argparse.ArgumentParser:
    from tokenq.producer.batch_api import BatchConfig
    from tokenq.producer.gateway import GatewayConfig

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
    option(serve, "--max-backlog", type=int, help="429 beyond this many jobs in a model's lane")
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
    option(serve, "--log-level", default="warning", help="uvicorn's log level")
    return serve


def _not_installed(missing: str | None) -> int:
    print(f"tokenq serve: {missing} is not installed: pip install 'tokenq[serve]'", file=sys.stderr)
    return EXIT_USAGE


def serve_main(argv: list[str]) -> int:
    """`tokenq serve ...` (the dispatcher sends it here before any other parsing)."""
    try:
        parser = serve_parser()
    except ImportError as exc:
        return _not_installed(exc.name)
    from tokenq.producer.batch_api import BatchConfig
    from tokenq.producer.gateway import GatewayConfig, serve

    args = parser.parse_args(argv)
    config = GatewayConfig(
        redis_url=args.redis_url,
        namespace=args.namespace,
        max_body_bytes=args.max_body,
        request_timeout=args.request_timeout,
        cancel_grace=args.cancel_grace,
        retry_after=args.retry_after,
        max_backlog=args.max_backlog,
    )
    batches = BatchConfig(
        max_file_bytes=args.max_file, poll_s=args.batch_poll, lock_ttl_s=args.batch_lock_ttl
    )
    serve(config, args.host, args.port, args.log_level, batches)
    return 0


def redacted(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url)


def refused(url: str, exc: redis.RedisError) -> str:
    """A command Redis refused (out of memory, read-only, no permission, a cluster), for a
    one-line message."""
    return f"Redis at {redacted(url)} refused: {exc}"


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
    client = Client(args.redis_url, namespace=args.namespace, **options)
    try:
        with client:
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
