"""Errors the engine raises for bad requests: each carries a stable code for the wire."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses before it runs; ``code`` is what clients match on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InvalidTransition(RuntimeError):
    """A request state change that the lifecycle does not allow (a bug, never input)."""


class StepFailed(RuntimeError):
    """An engine step failed for every request in it, each tried alone: the device or the
    engine is broken, not one request. The caller should hand its work back."""
