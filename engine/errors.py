"""Errors the engine raises: bad requests (each with a stable code for the wire), and a step
that failed for reasons no single request explains."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenq.engine.outputs import RequestOutput

# How much of a client's value an error message may quote: enough to recognise it, never
# enough to turn a 10 MB parameter into a 10 MB error reply and log line.
CLIP_CHARS = 100


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marking (with the full length) that it was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


def describe(exc: BaseException) -> str:
    """An exception as a short message for a client: its type and its (clipped) text."""
    return clip(f"{type(exc).__name__}: {exc}")


class InvalidRequest(ValueError):
    """A request the engine refuses before it runs; ``code`` is what clients match on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InvalidTransition(RuntimeError):
    """A request state change that the lifecycle does not allow (a bug, never input)."""


class StepFailed(RuntimeError):
    """The forward pass failed for every request of the step, each of them run alone too: the
    fault is the engine's (out of memory, a broken device), not any one job's, so no request
    is blamed and none has advanced. ``outputs`` are what the step had already finished
    before the forward pass (deadline expiries): the caller must still deliver them.
    The original exception is the ``__cause__``."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs
