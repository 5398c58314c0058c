"""What the engine hands back: per-step deltas and aggregate statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenq.engine.sequence import RequestMetrics


@dataclass
class RequestOutput:
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


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    counters: dict[str, int] = field(default_factory=dict)
