"""From engine outputs to a job's reply events, resume included.

Every event a worker writes for a running job is made here: token events from the
engine's deltas, the final `done` or `error`, and, when a job is re-run, only what its
reply stream does not already hold.

Re-running a job whose reply stream already holds tokens, without showing duplicates:

A worker that dies mid-job leaves its tokens in the reply stream; the job stays pending
and another worker runs it again from the start. The reply stream is the record of what
the client has seen, so the new run reads it first and then:

- suppresses its own tokens while they equal the ones already published (token ids and
  text), and streams only what comes after them: the client sees one seamless reply;
- if the new run diverges from what was published (a sampled job run on a different
  batch, a different model), it writes one ``restart`` event and streams its own tokens
  from index 0: the client discards what it had and nothing is ever shown twice.

Greedy jobs and seeded jobs reproduce their tokens, and the worker gives every sampled
job without a seed one derived from its job id, so divergence is the rare case.

A job of n outputs is n such records side by side: token and restart events name their
output, and each output resumes where its own published tokens end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenq.protocol import (
    TERMINAL_EVENTS,
    DoneEvent,
    ErrorEvent,
    Event,
    OutputResult,
    RestartEvent,
    Timings,
    TokenEvent,
    Usage,
    decode_event,
)

if TYPE_CHECKING:
    from tokenq.engine.outputs import RequestDelta

Logprobs = list[list[tuple[int, float]]]
ENGINE_FAILURE = "internal_error"  # the code of a job the engine isolated as failing


def wire_logprobs(logprobs: list[dict[int, float]] | None) -> Logprobs | None:
    """The engine's per-token {id: logprob} as the wire's pairs, best first."""
    if logprobs is None:
        return None
    return [sorted(top.items(), key=lambda kv: -kv[1]) for top in logprobs]


def cancelled_before_start(history: ReplyHistory, waited: float, metadata: Any) -> DoneEvent:
    """The end of a job cancelled before any worker ran it (an earlier run may have)."""
    return DoneEvent(
        text=history.text,
        finish_reason="cancelled",
        token_ids=history.token_ids,
        usage=Usage(0, len(history.token_ids)),
        timings=Timings(queue_time=waited, total=waited),
        metadata=metadata,
    )


@dataclass
class Published:
    """One output's tokens and text in its reply stream's current run."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""


@dataclass
class ReplyHistory:
    """What a reply stream holds: each output's tokens of its current run, and whether
    it ended."""

    outputs: dict[int, Published] = field(default_factory=dict)
    terminal: Event | None = None

    def output(self, index: int) -> Published:
        return self.outputs.get(index) or Published()

    @property
    def token_ids(self) -> list[int]:
        return self.output(0).token_ids

    @property
    def text(self) -> str:
        return self.output(0).text

    @property
    def num_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.outputs.values())

    @classmethod
    def from_entries(cls, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> ReplyHistory:
        history = cls()
        for event_id, fields in entries:
            event = decode_event(event_id, fields)
            if isinstance(event, RestartEvent):
                history.outputs[event.output] = Published()
            elif isinstance(event, TokenEvent):
                published = history.outputs.setdefault(event.output, Published())
                published.token_ids += event.token_ids
                published.text += event.text
            elif event.type in TERMINAL_EVENTS:
                history.terminal = event
        return history


class OutputContinuation:
    """Turns one output's engine deltas into the token events still owed to the client."""

    def __init__(self, published: Published, with_logprobs: bool) -> None:
        self._published_ids = published.token_ids
        self._published_text = published.text
        self._verifying = bool(published.token_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self._logprobs: Logprobs | None = [] if with_logprobs else None

    @property
    def skipped(self) -> int:
        """Tokens of this run that an earlier run had already published."""
        return len(self._published_ids)

    def feed(
        self, ids: list[int], text: str, logprobs: Logprobs | None, finished: bool
    ) -> list[Event]:
        start = len(self.token_ids)
        self.token_ids += ids
        self.text += text
        if not self._verifying and self._logprobs is None:  # most jobs, most steps
            return [TokenEvent(start, ids, text)] if ids or text else []
        if self._logprobs is not None and logprobs is not None:
            self._logprobs += logprobs
        if not self._verifying:
            return self._token_event(start, len(text)) if ids or text else []
        n, p = len(self.token_ids), len(self._published_ids)
        k = min(n, p)
        diverged = (
            self.token_ids[:k] != self._published_ids[:k]
            or (n >= p and not self.text.startswith(self._published_text))
            or (finished and n < p)
        )
        if diverged:
            self._verifying = False
            return [RestartEvent("re-run diverged from the published tokens"), *self._all()]
        if n < p:
            return []
        self._verifying = False
        return self._token_event(p, len(self.text) - len(self._published_text))

    @property
    def logprobs(self) -> Logprobs | None:
        return self._logprobs

    def _token_event(self, index: int, text_len: int) -> list[Event]:
        if index == len(self.token_ids) and text_len == 0:
            return []
        lp = None if self._logprobs is None else self._logprobs[index:]
        text = self.text[len(self.text) - text_len :] if text_len else ""
        return [TokenEvent(index, self.token_ids[index:], text, lp)]

    def _all(self) -> list[Event]:
        return self._token_event(0, len(self.text))


class Continuation:
    """Turns a run's engine deltas into the events still owed to the client, per output."""

    def __init__(self, history: ReplyHistory, with_logprobs: bool, n: int = 1) -> None:
        self.outputs = [OutputContinuation(history.output(i), with_logprobs) for i in range(n)]

    @property
    def skipped(self) -> int:
        """Tokens of this run that an earlier run had already published."""
        return sum(o.skipped for o in self.outputs)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    def feed(
        self, ids: list[int], text: str, logprobs: Logprobs | None, finished: bool, index: int = 0
    ) -> list[Event]:
        events = self.outputs[index].feed(ids, text, logprobs, finished)
        if index:
            for event in events:
                if isinstance(event, TokenEvent | RestartEvent):
                    event.output = index
        return events

    def translate(self, out: RequestDelta, metadata: Any) -> list[Event]:
        """The events one engine output owes the client: its tokens (what an earlier run
        published left out), then, if the job finished, the `done` (every output's text
        and finish reason) or, when the engine isolated this job as the one breaking its
        steps, the `error`."""
        ended = out.finished or out.finish_reason is not None
        logprobs = wire_logprobs(out.logprobs)
        events = self.feed(out.new_token_ids, out.new_text, logprobs, ended, out.index)
        if not out.finished:
            return events
        if out.finish_reason == "error":
            message = out.error or "the engine failed on this job"
            return [*events, ErrorEvent(out.error_code or ENGINE_FAILURE, message, metadata)]
        m = out.metrics
        finals = out.outputs or [out]
        results = [
            OutputResult(
                o.index,
                o.text if o.text is not None else self.outputs[o.index].text,
                self.outputs[o.index].token_ids,
                o.finish_reason or "stop",
                self.outputs[o.index].logprobs,
            )
            for o in finals
        ]
        first = results[0]
        done = DoneEvent(
            text=first.text,
            finish_reason=first.finish_reason,
            token_ids=first.token_ids,
            usage=Usage(out.prompt_tokens, sum(o.completion_tokens for o in finals)),
            timings=Timings(m.queue_time, m.ttft, m.e2e),
            metadata=metadata,
            outputs=results if out.outputs else None,
            prompt_logprobs=wire_prompt_logprobs(out.prompt_logprobs),
            prompt_token_ids=out.prompt_token_ids,
            prompt_text=out.prompt_text,
        )
        return [*events, done]


def wire_prompt_logprobs(
    logprobs: list[dict[int, float] | None] | None,
) -> list[list[tuple[int, float]] | None] | None:
    """The engine's prompt log-probabilities as the wire's pairs, the prompt's own token
    first, then the top-k best first (the first position's None stays None)."""
    if logprobs is None:
        return None
    return [None if top is None else list(top.items()) for top in logprobs]
