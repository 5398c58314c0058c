"""Exceptions a producer sees."""

from __future__ import annotations

import redis


class QueueFull(Exception):
    """A model's lane cannot take the jobs within its ``max_backlog``; retry later or shed
    the load. The backlog counts outputs: a job of n counts n, as n jobs of one would.

    Raised instead of letting a queue grow without bound when producers outrun workers.
    Each lane has its own cap, so a flood of batch jobs never refuses interactive ones.
    """

    def __init__(
        self, backlog: int, max_backlog: int, lane: str = "default", model: str = ""
    ) -> None:
        # args are the constructor's arguments: pickle and Celery's JSON result serializer
        # both rebuild an exception as cls(*args) (a Celery task failing with it, say).
        super().__init__(backlog, max_backlog, lane, model)
        self.backlog = backlog
        self.max_backlog = max_backlog
        self.lane = lane
        self.model = model

    def __str__(self) -> str:
        where = f"{self.model} {self.lane} lane" if self.model else f"{self.lane} lane"
        return (
            f"queue full: {where} holds {self.backlog} outputs of jobs waiting or running "
            f"(max {self.max_backlog}; a job of n counts n)"
        )


class UnknownModel(Exception):
    """No live worker serves the model a job names (submit with ``queue_anyway=True`` to
    queue it for workers that start later)."""

    def __init__(self, model: str | None, served: list[str]) -> None:
        super().__init__(model, served)
        self.model = model
        self.served = served

    def __str__(self) -> str:
        served = ", ".join(self.served) or "none"
        if self.model is None:
            return f"no model given and no single model to default to (served: {served})"
        return f"no live worker serves model {self.model!r} (served: {served})"


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


class NotReplicated(redis.TimeoutError):
    """A durable submit that no replica confirmed (WAIT) in time: the job may be queued on
    the primary only. Retried within ``retry_for`` like a timeout (resubmitting is safe:
    the job id is the idempotency key), then raised inside ``RedisUnavailable``."""
