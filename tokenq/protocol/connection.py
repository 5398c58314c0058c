"""How every part of tokenq connects to Redis: the default server, TCP keepalive where it
applies, how a server's version is compared, and how a URL is named in messages (never
with its password)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def keepalive_for(url: str) -> dict[str, bool]:
    """TCP keepalive, which finds a peer that vanished under an idle connection, for a
    redis:// or rediss:// URL; none for a unix:// socket, where the kernel knows when the
    server is gone (and redis-py refuses the option: a TypeError at the first command)."""
    return {} if urlsplit(url).scheme == "unix" else {"socket_keepalive": True}


def version_tuple(version: str) -> tuple[int, ...]:
    """A server's `redis_version` as (major, minor), to compare; () when it has none."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def redacted(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url)
