"""One request inside the engine: its tokens, its lifecycle and its timestamps.

What it has said as text (detokenizer, stop strings, what was streamed) is the output
processor's (``output_processor.py``); this is what the scheduler and the model need.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tokenq.engine.errors import InvalidTransition
from tokenq.protocol.params import SamplingParams


class RequestState(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (RequestState.COMPLETED, RequestState.CANCELLED, RequestState.FAILED)


S = RequestState
# Preempted requests lose their KV blocks and prefill again (recompute); cancellation is
# allowed from every active state, failure only once the model has touched the request.
_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.PREFILLING, S.CANCELLED}),
    S.PREFILLING: frozenset({S.DECODING, S.PREEMPTED, S.CANCELLED, S.FAILED}),
    S.DECODING: frozenset({S.COMPLETED, S.PREEMPTED, S.CANCELLED, S.FAILED}),
    S.PREEMPTED: frozenset({S.PREFILLING, S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.CANCELLED: frozenset(),
    S.FAILED: frozenset(),
}


@dataclass
class RequestMetrics:
    """Monotonic timestamps (``time.monotonic()``) of a request's milestones."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(eq=False)
class Sequence:
    """A request's full token history and scheduling state.

    ``num_computed_tokens`` counts tokens whose K/V sit in this request's blocks; the next
    forward pass feeds ``token_ids[num_computed_tokens:]`` (a prefill chunk, or the one
    newest token in decode). Preemption resets it to zero and frees the blocks, so a
    resumed request prefills prompt and output again and continues exactly where it was.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_order: int = 0
    deadline: float | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None  # what made the engine fail this request, if it did
    error_code: str | None = None  # the client's code for that failure, when not internal
    # The llguidance matcher of a request with structured outputs: it has consumed every
    # output token, so it lives through preemption (the output is kept) unchanged.
    grammar: Any = None
    index: int = 0  # which of its request's n outputs this is
    group: SeqGroup | None = None  # the request's outputs, when it has more than one
    # prompt_logprobs: per prompt position, None or {token: logprob} (the token's own and
    # the top-k); filled as the prompt is computed (None: not asked for)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Lower priority value first, then arrival, then output index: the order of service
        and of survival (a request's outputs stay side by side)."""
        return (self.priority, self.arrival_order, self.index)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions still lack their log-probabilities: then its prefill
        skips the prefix cache and every prompt position gives logits."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) > 1 and lps[-1] is None

    @property
    def unforked(self) -> bool:
        """A leader whose group's other outputs wait to fork from its computed prompt."""
        return self.group is not None and not self.group.forked and self.index == 0

    def transition(self, new_state: RequestState) -> None:
        if new_state not in _ALLOWED[self.state]:
            raise InvalidTransition(
                f"request {self.request_id}: {self.state.value} -> {new_state.value} not allowed"
            )
        now = time.monotonic()
        if new_state is S.PREFILLING and self.metrics.first_scheduled is None:
            self.metrics.first_scheduled = now
        if new_state.finished:
            self.metrics.finished = now
        self.state = new_state

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and its time; the first one sets time-to-first-token."""
        now = time.monotonic()
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if self.metrics.first_token is None:
            self.metrics.first_token = now
        self.metrics.token_times.append(now)


@dataclass(eq=False)
class SeqGroup:
    """The n outputs of one request. ``seqs[0]`` prefills the prompt; in the step that
    computes its last prompt token the others fork from it (``forked``), sharing its blocks
    by reference count, and sample their first token from the same logits."""

    seqs: list[Sequence]
    forked: bool = False

    @property
    def finished(self) -> bool:
        return all(s.state.finished for s in self.seqs)
