"""Redis faults are ordinary for a worker: a call that fails leaves the state as it was,
and the work is tried again after a backoff (the scripts make a re-sent call harmless)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from tokenq.protocol.connection import CLUSTER_CHANGES

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
# Redis answering but refusing for a while, waited out as an unreachable server is: full
# under noeviction (OOM), a replica since a failover (READONLY), writes stopped after a
# failed save (MISCONF), a long script (BUSY). A script refused at its first write has
# written nothing, so the work is simply tried again.
# redis-py raises OOM and READONLY as classes of their own, the others as ResponseError.
# On a cluster, its answers while it changes (MOVED, CLUSTERDOWN, ...) too.
REFUSALS = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError, *CLUSTER_CHANGES)
REFUSAL_CODES = ("MISCONF ", "BUSY ")  # (not BUSYGROUP, a bug)


def passing(exc: redis.RedisError) -> bool:
    """Whether a Redis error is one to wait out rather than a bug or a broken setup."""
    if isinstance(exc, REDIS_ERRORS + REFUSALS):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(REFUSAL_CODES)


@dataclass
class Backoff:
    """Retry timing for one thread's Redis work while Redis does not answer."""

    cap: float
    delay: float = 0.0
    until: float = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.until

    def failed(self) -> float:
        self.delay = min(max(2 * self.delay, 0.1), self.cap)
        self.until = time.monotonic() + self.delay
        return self.delay

    def succeeded(self) -> None:
        self.delay = 0.0


class Retrying:
    """One thread's Redis work: a failure that passes schedules a retry with backoff and
    calls `failed` (the intake then resyncs) instead of unwinding the thread."""

    def __init__(self, conn: redis.Redis, cap: float, failed: Callable[[], None], log: Any) -> None:
        self.redis = conn
        self.backoff = Backoff(cap)
        self._failed = failed
        self.log = log

    def __call__(self, work: Callable[[], Any]) -> bool:
        """Run `work`; True if it ran."""
        try:
            work()
        except redis.RedisError as exc:
            if not passing(exc):
                raise
            self._failed()
            delay = self.backoff.failed()
            if isinstance(exc, REDIS_ERRORS):
                self.log.warning("redis unavailable", error=str(exc), retry_in=delay)
                return False
            self.log.warning("redis refused a command", error=str(exc), retry_in=delay)
            if isinstance(exc, redis.exceptions.ReadOnlyError) and hasattr(
                self.redis, "connection_pool"
            ):  # (a cluster's connections find the new primary themselves)
                # A failover made this server a replica: connect again, maybe to the new
                # primary (a name that moved with it).
                self.redis.connection_pool.disconnect(inuse_connections=False)
            return False
        self.backoff.succeeded()
        return True
