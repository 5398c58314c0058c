"""The text of a queue process's jobs, made there from the token ids the engine sends (as
vLLM v1 splits its engine): a token's text cost the engine's thread about 5 us, 9% of a
tiny model's step for 64 jobs, which the queue process pays instead, beside the next step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import structlog

from tokenq.engine.output_processor import IncrementalDetokenizer
from tokenq.protocol.errors import describe
from tokenq.protocol.params import SamplingParams
from tokenq.worker.driver import ENGINE, QUEUE, Add, Failed, Output, Refused

if TYPE_CHECKING:
    from tokenq.engine.outputs import RequestDelta
    from tokenq.engine.tokenizer import Tokenizer


def text_side(params: SamplingParams) -> str:
    """Who makes a queue process's job's text: the queue process, unless the engine must
    see it to end the job at a stop string, or the job has several outputs (or no text is
    wanted)."""
    return QUEUE if params.detokenize and not params.stop and params.n == 1 else ENGINE


class Detokenizing:
    """Fills in the text of the jobs whose `Add.text_by` is the queue: the same incremental
    detokenizer the engine uses, an end flushed unless it is an error (the engine's rule)."""

    def __init__(self, tokenizer: Tokenizer, abort: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self._abort = abort  # ends in the engine a job whose text failed here
        # By job id; None: its text failed, and its outputs until its end are dropped.
        self._jobs: dict[str, IncrementalDetokenizer | None] = {}
        self._unprepared: list[IncrementalDetokenizer] = []  # taken, not prepared yet
        self._lock = threading.Lock()  # the intake prepares what the reader pushes

    def take(self, add: Add) -> None:
        """Before `add` is sent: a job whose text is made here gets its detokenizer."""
        if add.text_by == QUEUE:
            detokenizer = IncrementalDetokenizer(self.tokenizer, add.prompt_token_ids)
            self._jobs[add.job_id] = detokenizer
            self._unprepared.append(detokenizer)

    def prepare(self) -> None:
        """Decode the prompts' tails of the jobs taken since the last call, once their
        delivery is sent, while the engine runs their first step: the reader then gets a
        burst's first tokens without waiting on each job's prompt."""
        unprepared, self._unprepared = self._unprepared, []
        for detokenizer in unprepared:
            with self._lock:  # one at a time: the reader may need the lock meanwhile
                try:
                    detokenizer.prepare()
                except Exception:  # noqa: S110 - its first push fails alike, and ends that job
                    pass

    def output(self, output: Output) -> Output:
        """An engine output with its text; a job's end forgets it."""
        with self._lock:
            return self._output(output)

    def _output(self, output: Output) -> Output:
        if isinstance(output, list):
            return [filled for d in output if (filled := self._fill(d)) is not None]
        if isinstance(output, Refused):
            self._jobs.pop(output.job_id, None)
        elif isinstance(output, Failed):
            output.outputs = self._output(output.outputs)  # type: ignore[assignment]
            for job_id in output.dropped:
                self._jobs.pop(job_id, None)
        return output

    def _fill(self, delta: RequestDelta) -> RequestDelta | None:
        jid = delta.request_id
        if jid not in self._jobs:
            return delta  # the engine made its text, or none was wanted
        detokenizer = self._jobs[jid]
        if delta.finished:
            del self._jobs[jid]
        if detokenizer is None:
            return None
        try:
            new_text = detokenizer.push(delta.new_token_ids)
            if delta.finished and delta.finish_reason != "error":
                new_text += detokenizer.flush()
        except Exception as exc:  # as in the engine: this job ends alone, with an error
            return self._failed(delta, detokenizer, exc)
        delta.new_text = new_text
        if delta.finished:
            delta.text = detokenizer.text
        return delta

    def _failed(
        self, delta: RequestDelta, detokenizer: IncrementalDetokenizer, exc: Exception
    ) -> RequestDelta:
        jid = delta.request_id
        if not delta.finished:
            self._jobs[jid] = None
            self._abort(jid)
        error = describe(exc)  # the message the engine gives a job that fails alone
        structlog.get_logger("tokenq.worker").warning(
            "decoding a job's tokens failed", job_id=jid, error=error
        )
        return replace(
            delta,
            new_text="",
            finished=True,
            finish_reason="error",
            logprobs=None,
            text=detokenizer.text,
            token_ids=None,
            error=error,
        )
