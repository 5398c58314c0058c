"""Text out of tokens: everything a request's output needs between sampling and the caller.

One place for incremental detokenization, stop strings (cut from the text, never streamed,
not even in part), logprobs, and the deltas the step API returns. The engine core only
records token ids; it hands each new token here and gets the request's delta back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenq.engine.outputs import RequestDelta
from tokenq.engine.sequence import Sequence
from tokenq.engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens to decode in front of the first generated ones: enough context for
# decoders whose output for a token depends on its neighbour (sentencepiece's leading space).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    Decodes only a small window of recent ids, like vLLM's prefix/read offsets: the window
    starts at the ids whose text was emitted last (context for the decoder, `_prefix_text`) and
    `_read` marks where the not-yet-emitted ids begin. A multi-byte character split across
    tokens decodes to U+FFFD until its last byte arrives, so text ending in U+FFFD is held back.
    The deltas, plus `flush()` at the end, join to `tokenizer.decode(pushed_ids)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        self._read = len(self._ids)
        # The window's context decoded when first needed (None: not yet), not here: a
        # detokenizer is made as its request is admitted, on the way to its first step.
        self._prefix_text: str | None = None
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def prepare(self) -> None:
        """Decode the context now (a fresh one's: the prompt's tail), so that the first
        `push`, on the way to a job's first token, decodes once instead of twice."""
        self._prefix()

    def push(self, token_ids: Iterable[int]) -> str:
        """Add generated ids; return the text they completed (possibly "")."""
        out = []
        for token_id in token_ids:
            prefix = self._prefix()
            self._ids.append(token_id)
            new_text = self._decode(self._ids)
            if len(new_text) > len(prefix) and not new_text.endswith(_REPLACEMENT_CHAR):
                out.append(new_text[len(prefix) :])
                self._advance()
        return self._emit("".join(out))

    def flush(self) -> str:
        """At the end of generation: emit what is still held back, even an incomplete char
        (as U+FFFD, exactly as a full decode renders it)."""
        delta = self._decode(self._ids)[len(self._prefix()) :]
        self._advance()
        return self._emit(delta)

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        return self._prefix_text

    def _advance(self) -> None:
        """The ids before `_read` are never decoded again: drop them, keeping the window
        small. The new context is decoded by the next push: the last one's is never used
        (a job's end), and a job's first token is not held up by it."""
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = None

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


@dataclass
class OutputState:
    """A request's text so far, and how much of it and of its tokens was sent."""

    detokenizer: IncrementalDetokenizer | None  # None: no text wanted (detokenize=False)
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)


class OutputProcessor:
    """The output state of every unfinished output, by its sequence (a request of n
    outputs has n)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[Sequence, OutputState] = {}

    def add_request(self, seq: Sequence) -> None:
        self.states[seq] = OutputState(
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
            if seq.params.detokenize
            else None
        )

    def add_token(
        self,
        seq: Sequence,
        token: int,
        logprobs: dict[int, float] | None,
        find_stop: bool = True,
    ) -> bool:
        """Take the request's newest token (already in ``seq``) into its text. With
        ``find_stop``, look for a stop string: True when one was found, and the text cut
        where it starts (the request then stops, without flushing: what follows is gone)."""
        state = self.states[seq]
        if logprobs is not None:
            state.logprobs.append(logprobs)
        if state.detokenizer is None:
            return False  # no text, so no stop strings (SamplingParams refuses them)
        state.text += state.detokenizer.push([token])
        if not (find_stop and seq.params.stop):
            return False
        cut = _find_stop(state, seq.params.stop)
        if cut is None:
            return False
        state.text = state.text[:cut]
        return True

    def delta(self, seq: Sequence) -> RequestDelta:
        """What is new since the last delta: all new tokens, and the new text except a tail
        that may still grow into a stop string."""
        state = self.states[seq]
        return self._delta(seq, state, _safe_text_len(state.text, seq.params.stop))

    def flush(self, seq: Sequence) -> None:
        """The request ends: add the bytes of a character its output ended inside."""
        state = self.states[seq]
        if state.detokenizer is not None:
            state.text += state.detokenizer.flush()

    def finish(self, seq: Sequence) -> RequestDelta:
        """The last delta of a finished output (all its text), forgetting it."""
        state = self.states.pop(seq)
        return self._delta(seq, state, len(state.text), finished=True)

    def _delta(
        self, seq: Sequence, state: OutputState, text_end: int, finished: bool = False
    ) -> RequestDelta:
        sent = state.num_sent_tokens
        state.num_sent_tokens = seq.num_output_tokens
        new_text = state.text[state.num_sent_chars : text_end]
        state.num_sent_chars = max(state.num_sent_chars, text_end)
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=seq.output_token_ids[sent:],
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            metrics=seq.metrics,
            logprobs=state.logprobs[sent:] if seq.params.logprobs is not None else None,
            text=state.text if finished else None,
            token_ids=list(seq.output_token_ids) if finished else None,
            error=seq.error,
            error_code=seq.error_code,
            index=seq.index,
        )


def _find_stop(state: OutputState, stops: list[str]) -> int | None:
    """Where the earliest stop string starts, searching only text that could hold a stop
    string which was not there before this token."""
    start = max(0, state.num_sent_chars - max(len(s) for s in stops))
    hits = [i for s in stops if (i := state.text.find(s, start)) >= 0]
    return min(hits) if hits else None


def _safe_text_len(text: str, stops: list[str]) -> int:
    """Text that can be streamed: hold back a tail that may still grow into a stop."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return len(text) - hold
