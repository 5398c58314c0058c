"""What every command of `tokenq` shares: options that read their environment variable
(``--max-num-seqs`` <- ``TOKENQ_MAX_NUM_SEQS``, so containers are configured without a
command line), where the queue is, the exit statuses, and how a URL or a refusing Redis is
named in one line.

Exit statuses: 0 done; 1 the job failed (its error printed); 2 usage, a bad request, an
unknown id, or Redis unreachable (one line naming the URL); 3 QueueFull; 4 no result within
--timeout (or, for `result`, the job has not ended); 130 interrupted. `batch run`: 1 when
some lines failed (their answers in the errors file).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import redis

from tokenq.protocol import DEFAULT_NAMESPACE
from tokenq.protocol.connection import DEFAULT_REDIS_URL, cluster_seeds, redacted

EXIT_JOB_FAILED, EXIT_USAGE, EXIT_QUEUE_FULL, EXIT_TIMEOUT = 1, 2, 3, 4
EXIT_NO_REDIS = EXIT_USAGE
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `2147483648`, `2GiB`, `512M`."""
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512M, 1048576)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()])


def env_name(flag: str) -> str:
    return "TOKENQ_" + flag.lstrip("-").replace("-", "_").upper()


def option(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str = "",
    env: str | None = None,
    shown: Any = None,
    **kwargs: Any,
) -> None:
    """An option whose default comes from its environment variable when that is set
    (`env`, else one named for the flag). `shown`: the default to state when the flag's own
    is None because a settings dataclass fills it in; none is stated when neither is set."""
    env = env or env_name(flag)
    raw = os.environ.get(env)
    value = default
    if raw is not None:
        try:
            value = type(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            # Every command's parser is built at start: not the usage of whichever is first.
            print(f"tokenq: {env}: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
    stated = default if shown is None else shown
    suffix = f"[env {env}]" if stated is None else f"[env {env}; default {stated}]"
    parser.add_argument(flag, type=type, default=value, help=f"{help} {suffix}", **kwargs)


# The model a job names, for the client's commands: not TOKENQ_MODEL, which is the worker's
# model to load (a path or an alias, as vLLM's --model).
JOB_MODEL_ENV = "TOKENQ_JOB_MODEL"


def durable_option(parser: argparse.ArgumentParser) -> None:
    """`--durable-submit` of the commands that submit for others (docs/protocol.md)."""
    flag_option(
        parser,
        "--durable-submit",
        "a submit returns once a replica holds the job (WAIT 1): a failover then loses no "
        "acknowledged job",
    )


def flag_option(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    env = env_name(flag)
    default = os.environ.get(env, "").lower() in ("1", "true", "yes", "on")
    parser.add_argument(flag, action="store_true", default=default, help=f"{help} [env {env}]")


def redis_url(text: str) -> str:
    """A --redis-url read as redis-py will read it: a malformed one is a usage error at
    once, not a traceback when the first connection is made (a worker's, after it loaded
    its model)."""
    try:
        seeds = cluster_seeds(text)
        redis.connection.parse_url(text if seeds is None else seeds[0])
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
        help="Redis server: redis://, rediss:// or unix:// (a socket file); any node of a "
        "Redis Cluster, or redis+cluster://host:port,host:port/ (seed nodes)",
    )
    option(parser, "--namespace", default=DEFAULT_NAMESPACE, help="prefix of every Redis key")


def refused(url: str, exc: redis.RedisError) -> str:
    """A command Redis refused (out of memory, read-only, no permission, a cluster), for a
    one-line message."""
    return f"Redis at {redacted(url)} refused: {exc}"
