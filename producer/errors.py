"""Exceptions a producer sees."""

from __future__ import annotations

import redis


class QueueFull(Exception):
    """The job stream already holds ``max_backlog`` jobs; retry later or shed the load.

    Raised instead of letting the stream grow without bound when producers outrun workers.
    """

    def __init__(self, backlog: int, max_backlog: int) -> None:
        # args are the constructor's arguments: pickle and Celery's JSON result serializer
        # both rebuild an exception as cls(*args) (a Celery task failing with it, say).
        super().__init__(backlog, max_backlog)
        self.backlog = backlog
        self.max_backlog = max_backlog

    def __str__(self) -> str:
        return f"queue full: {self.backlog} jobs waiting or running (max {self.max_backlog})"


class JobFailed(Exception):
    """The worker answered the job with an ``error`` event."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(job_id, code, message)  # rebuildable from args, as QueueFull
        self.job_id = job_id
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"job {self.job_id} failed: {self.code}: {self.message}"


class ClientClosed(Exception):
    """The client was closed; create a new one to submit again."""


class RedisUnavailable(redis.ConnectionError):
    """Redis stayed unreachable for the client's whole ``retry_for``.

    A subclass of ``redis.ConnectionError``, so code that already handles a lost connection
    handles this too; ``last_error`` (also the ``__cause__``) is the failure of the last try.
    """

    def __init__(self, where: str, waited: float, last_error: BaseException) -> None:
        super().__init__(
            f"Redis at {where} unavailable: retried for {waited:.1f}s, last error: "
            f"{type(last_error).__name__}: {last_error}"
        )
        self.where = where
        self.waited = waited
        self.last_error = last_error
