"""Exceptions a producer sees."""

from __future__ import annotations


class QueueFull(Exception):
    """The job stream already holds ``max_backlog`` jobs; retry later or shed the load.

    Raised instead of letting the stream grow without bound when producers outrun workers.
    """

    def __init__(self, backlog: int, max_backlog: int) -> None:
        super().__init__(f"queue full: {backlog} jobs waiting or running (max {max_backlog})")
        self.backlog = backlog
        self.max_backlog = max_backlog


class JobFailed(Exception):
    """The worker answered the job with an ``error`` event."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(f"job {job_id} failed: {code}: {message}")
        self.job_id = job_id
        self.code = code
        self.message = message


class ClientClosed(Exception):
    """The client was closed; create a new one to submit again."""
