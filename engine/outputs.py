"""What the engine hands back: per-step deltas (the step API), finished generations in vLLM's
shape (the offline ``LLM``), and aggregate statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenq.engine.sequence import RequestMetrics


@dataclass
class RequestDelta:
    """What one request did in one step (or its final state when ``finished``).

    ``new_text`` never contains a stop string or a piece of one that may still complete;
    the deltas of a request joined equal its final ``text``.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None
    text: str | None = None  # the full text, set when finished
    token_ids: list[int] | None = None  # all generated ids, set when finished
    # Why the request failed, when finish_reason is "error" (exception type and message,
    # clipped); the other requests of its step were not affected.
    error: str | None = None
    # The client's error code when the request itself was at fault (a grammar that does not
    # compile: invalid_params); None for the engine's own failures.
    error_code: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request, as vLLM's ``CompletionOutput``: ``index`` is
    its place among the request's ``n`` samples (always 0 here: n is 1)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None  # per token, when asked for


@dataclass
class RequestOutput:
    """A finished request of ``LLM.generate`` / ``LLM.chat``, as vLLM's ``RequestOutput``:
    ``out.outputs[0].text`` is the generation. ``prompt`` is the text given (None for token
    ids); ``metrics`` and ``error`` are tokenq's own."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    counters: dict[str, int] = field(default_factory=dict)
