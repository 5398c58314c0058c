"""The errors of the contract: a request refused before it runs (`InvalidRequest`, with
the stable code clients match on) and a stream entry that breaks the protocol
(`ProtocolError`, which also carries the job id), and how their messages quote bad input."""

from __future__ import annotations

from typing import Any

# How much of a client's value an error message may quote: enough to recognise it, never
# enough to turn a 10 MB parameter into a 10 MB error reply, dead letter and log line.
CLIP_CHARS = 100


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marking (with the full length) that it was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


def quote(value: Any, limit: int = CLIP_CHARS) -> str:
    """A bad value as a message quotes it: its ``repr``, clipped. A long string or bytes
    is cut before its ``repr`` is made, so a hostile megabyte is never copied whole."""
    if isinstance(value, str | bytes | bytearray) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} long)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def describe(exc: BaseException) -> str:
    """An exception as a short message for a client: its type and its (clipped) text."""
    return clip(f"{type(exc).__name__}: {exc}")


class InvalidRequest(ValueError):
    """A request refused before it runs; ``code`` is what clients match on, ``param`` the
    parameter at fault where one is (the gateway answers with it as OpenAI's ``param``)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class ProtocolError(InvalidRequest):
    """A job that breaks the protocol; ``code`` is the error code sent to the client, with
    the job's id when it could be read."""

    def __init__(
        self, code: str, message: str, job_id: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(code, message, param)
        self.args = (f"{code}: {message}",)  # str(): the code first, as the wire shows it
        self.job_id = job_id

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None, str | None]]:
        return type(self), (self.code, self.message, self.job_id, self.param)
