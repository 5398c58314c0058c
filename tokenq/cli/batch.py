"""`tokenq batch run`: an OpenAI batch file through the queue, resumable."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import redis

from tokenq.cli.options import (
    EXIT_JOB_FAILED,
    EXIT_NO_REDIS,
    EXIT_USAGE,
    JOB_MODEL_ENV,
    common_options,
    durable_option,
    flag_option,
    option,
    refused,
)
from tokenq.producer.client import Client, ClientConfig
from tokenq.protocol.connection import redacted

# Enough queued jobs to keep a fleet's engines full, few enough to hold in memory.
BATCH_MAX_OUTSTANDING = 512


def add_commands(sub: Any) -> None:
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
    option(
        run,
        "--model",
        env=JOB_MODEL_ENV,
        help="run every line on this model, whatever its body names",
    )
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
    durable_option(run)
    option(
        run,
        "--retry-for",
        type=float,
        default=ClientConfig.retry_for,
        help="seconds to ride out an unreachable Redis",
    )
    run.set_defaults(run=cmd_batch_run)


def cmd_batch_run(args: argparse.Namespace) -> int:
    """Exit 0: every line answered with a result; 1: finished, some lines failed, in this
    run or an earlier one it resumed (see the errors file); 2: the batch cannot run; 130:
    interrupted (the same command resumes)."""
    # Imported here: the conversion comes with the gateway's module, and tqdm is an extra.
    try:
        from tqdm import tqdm

        from tokenq.batch import runner as batch
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

    client = Client(
        args.redis_url,
        namespace=args.namespace,
        retry_for=args.retry_for,
        durable_submit=args.durable_submit,
    )
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
        f"{counts.failed} failed, {counts.already} answered before "
        f"({counts.already_failed} of them failed); "
        f"{counts.tokens} tokens at {counts.tokens_per_s():.1f} tokens/s; "
        f"results in {args.output}, errors in {errors}",
        file=sys.stderr,
    )
    return EXIT_JOB_FAILED if counts.failed or counts.already_failed else 0
