"""What the engine hands back: per-step deltas (the step API), finished generations in vLLM's
shape (the offline ``LLM``), and aggregate statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenq.engine.sequence import RequestMetrics


@dataclass
class RequestDelta:
    """What one output of a request did in one step (or its final state when it ended:
    ``finish_reason`` set, ``text`` and ``token_ids`` whole).

    ``new_text`` never contains a stop string or a piece of one that may still complete;
    the deltas of an output joined equal its final ``text``. ``finished``: the request
    ended (all its outputs): for n > 1 that delta's ``outputs`` holds every output's last
    delta, by index.
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
    index: int = 0  # which of the request's n outputs
    outputs: list[RequestDelta] | None = None  # n > 1, on the request's last delta
    # prompt_logprobs, on the request's last delta: per prompt position, None (the first)
    # or {token: logprob} of the prompt's token and the top-k
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ids: list[int] | None = None  # set with prompt_logprobs
    prompt_text: str | None = None  # the prompt decoded, set with prompt_logprobs


@dataclass
class CompletionOutput:
    """One generated sequence of a request, as vLLM's ``CompletionOutput``: ``index`` is
    its place among the request's ``n`` samples."""

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
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    peak_used_blocks: int = 0  # the most KV blocks held at once
    counters: dict[str, int] = field(default_factory=dict)
