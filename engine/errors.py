"""Errors the engine raises for bad requests: each carries a stable code for the wire."""

from __future__ import annotations

# How much of a client's value an error message may quote: enough to recognise it, never
# enough to turn a 10 MB parameter into a 10 MB error reply and log line.
CLIP_CHARS = 100


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marking (with the full length) that it was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


class InvalidRequest(ValueError):
    """A request the engine refuses before it runs; ``code`` is what clients match on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InvalidTransition(RuntimeError):
    """A request state change that the lifecycle does not allow (a bug, never input)."""
