"""The step-level engine: requests in, one batched forward pass per ``step()``, deltas out.

The worker drives it; ``engine.llm.LLM`` wraps it for offline use. Nothing here knows about
Redis: admission control is exposed as ``free_capacity()`` so the caller can pull only as
much work as the engine can take. A step reads: schedule (``Scheduler``), run
(``ModelRunner``: forward pass, sampling), update (the scheduler's books, the stop rules),
outputs (``OutputProcessor``: text, stop strings, deltas).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from tokenq.engine import quantization
from tokenq.engine.attention import AttentionBackend
from tokenq.engine.block_manager import BlockManager
from tokenq.engine.config import EngineConfig
from tokenq.engine.errors import StepFailed
from tokenq.engine.loader import load_checkpoint, resolve_model
from tokenq.engine.model_runner import ModelRunner
from tokenq.engine.output_processor import OutputProcessor
from tokenq.engine.outputs import EngineStats, RequestDelta
from tokenq.engine.prompts import Prompts
from tokenq.engine.sampler import SampleResult
from tokenq.engine.scheduler import ScheduledSeq, Scheduler
from tokenq.engine.sequence import RequestMetrics, RequestState, SeqGroup, Sequence
from tokenq.engine.structured import GrammarCompiler, StructuredStats
from tokenq.protocol.errors import InvalidRequest, clip, describe
from tokenq.protocol.params import SamplingParams

logger = logging.getLogger(__name__)

# Parts of a batch that ran, each with its sampled tokens; requests whose pass failed alone.
Ran = list[tuple[list[ScheduledSeq], list[SampleResult | Exception]]]
Culprits = list[tuple[Sequence, Exception]]
_COMPILE_POLL = 0.01  # seconds an idle step waits for a grammar to compile


class CompileTimeout(InvalidRequest):
    """A request's grammar compiled for longer than ``grammar_compile_timeout``."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = config.resolved_device()
        self.dtype, why = config.dtype_choice(self.device)
        dtype_name = str(self.dtype).removeprefix("torch.")
        logger.info("computing in %s on %s (%s)", dtype_name, self.device, why)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model(config.model)
        self.quantization = quantization.choose(config.quantization, self.device, path)
        logger.info("quantization: %s (%s)", self.quantization.name, self.quantization.reason)
        checkpoint = load_checkpoint(path, self.dtype, self.quantization.keep_quantized)
        if checkpoint.tokenizer is None:
            raise FileNotFoundError(f"{checkpoint.path} has no tokenizer.json")
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.eos_token_ids = set(checkpoint.eos_token_ids)
        self.model_runner = ModelRunner(
            config, checkpoint, self.device, self.dtype, int8=self.quantization.int8
        )
        del checkpoint  # the model holds what it needs of the weights
        self.max_model_len = self.model_runner.max_model_len
        self.block_manager = BlockManager(
            self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.model_config.kv_window,
        )
        self.counters: Counter[str] = Counter()
        structured = StructuredStats(self.counters)
        self.grammars = GrammarCompiler(
            self.tokenizer, self.model_config.vocab_size, config.grammar_cache_size, structured
        )
        self.model_runner.masks.stats = structured
        # Requests whose grammar compiles: they hold no batch slot until it is ready.
        self._compiling: dict[str, tuple[Sequence, Future[Any], float]] = {}
        self.output_processor = OutputProcessor(self.tokenizer)
        self.prompts = Prompts(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._in_flight: list[ScheduledSeq] = []  # the step whose pass runs now
        # the last deltas of a request's outputs that ended while others run, by index
        self._finals: dict[str, dict[int, RequestDelta]] = {}

    @property
    def backend(self) -> AttentionBackend:
        """The kernels the model runs on (``backend.name``: cpu, torch or triton)."""
        return self.model_runner.backend

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        params: SamplingParams | dict[str, Any] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        deadline: float | None = None,
    ) -> None:
        """Queue a request. Bad input raises ``InvalidRequest`` here, never later.

        ``arrival_time`` and ``deadline`` are ``time.monotonic()`` values; a request still
        unfinished at its deadline ends with finish reason ``deadline``. A caller that must
        not block on tokenizing a big prompt runs ``encode_prompt`` elsewhere first and
        passes its ids as ``prompt_token_ids``.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("invalid_request_id", "request id must be a non-empty string")
        if request_id in self.requests:
            raise InvalidRequest(
                "duplicate_request", f"request {clip(request_id)} is already running"
            )
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequest("invalid_params", "params must be SamplingParams or a mapping")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequest("invalid_priority", "priority must be an integer")
        self._check_vocabulary(params)
        token_ids = self.encode_prompt(prompt, prompt_token_ids, messages)
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequest(
                "invalid_params",
                f"max_tokens: {params.max_tokens} tokens after a prompt of {len(token_ids)} "
                f"pass the context of {self.max_model_len} tokens (at most {room} fit)",
                "max_tokens",
            )
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        order = next(self._arrivals)
        seqs = [
            Sequence(
                request_id=request_id,
                prompt_token_ids=token_ids,
                params=_output_params(params, i),
                priority=priority,
                arrival_order=order,
                deadline=deadline,
                metrics=RequestMetrics(arrival),
                index=i,
            )
            for i in range(params.n)
        ]
        if params.n > 1:
            group = SeqGroup(seqs)
            for seq in seqs:
                seq.group = group
        seq = seqs[0]
        self.requests[request_id] = seq
        if params.structured_outputs is not None:  # one grammar for all n outputs
            future = self.grammars.submit(params.structured_outputs)
            self._compiling[request_id] = (seq, future, time.monotonic())
            self.counters["structured_requests"] += 1
        else:
            self.scheduler.add(seq)  # the others fork from it once its prompt is computed
        for s in seqs:
            self.output_processor.add_request(s)
        self.counters["requests_added"] += 1

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """Token ids in the parameters must exist: the sampler indexes the logits with them."""
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    "invalid_params",
                    f"{name}: token id {clip(str(bad))} is outside the vocabulary [0, {vocab})",
                )

    def encode_prompt(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """``Prompts.encode`` for this engine's model: thread-safe, for callers that
        tokenize big prompts off the engine's thread (see engine/prompts.py)."""
        return self.prompts.encode(prompt, prompt_token_ids, messages)

    def abort(self, request_id: str) -> RequestDelta | None:
        """Cancel a request wherever it is; its blocks are free when this returns."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        return self._end(seq, "cancelled", RequestState.CANCELLED)[-1]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def free_capacity(self, priority: int | None = None) -> int:
        """How many more requests to take now (see ``Scheduler.free_capacity``). With a
        ``priority``, how many of that priority: running and waiting requests of strictly
        lower priority count as room, since admitting such a request preempts them."""
        return self.scheduler.free_capacity(priority)

    def free_capacities(self, priorities: Iterable[int | None]) -> list[int]:
        """``free_capacity`` of each priority, in one pass (``Scheduler.free_capacities``)."""
        return self.scheduler.free_capacities(priorities)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=bm.usage(),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            peak_used_blocks=bm.peak_used_blocks,
            counters={**self.counters, "prefix_cache_hit_tokens": bm.num_cache_hit_tokens},
        )

    # -- the step ----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, between_layers: Callable[[], object] | None = None) -> list[RequestDelta]:
        """One forward pass over what the scheduler picked, and the tokens it yields.

        A request whose own processing raises (its forward pass, sampling its row,
        detokenizing, stop checks) ends alone with finish reason ``error`` and a message in
        ``RequestDelta.error``; every other request carries on with its normal tokens.
        Raises ``StepFailed`` only when the forward pass fails for every request of a batch
        of several, each run alone too: then no request has advanced.

        ``between_layers`` is called between two layers of the pass; it may add requests
        and run ``step_ahead`` (and nothing else of this engine's). Requests it added that
        the step has room for then join the pass there (``Scheduler.schedule_join``).
        """
        outputs = self._expire_deadlines() + self._admit_compiled()
        sched = self.scheduler.schedule()
        causes = Counter(sched.preempted.values())
        self.counters["preemptions"] += len(sched.preempted)
        self.counters["preemptions_kv_cache"] += causes["kv_cache"]
        self.counters["preemptions_priority"] += causes["priority"]
        if not sched.scheduled:
            if self._compiling:  # nothing else to do: wait a little for a grammar
                wait([f for _, f, _ in self._compiling.values()], _COMPILE_POLL, FIRST_COMPLETED)
            return outputs
        self.model_runner.copy_blocks(self.block_manager.take_copies())
        self._in_flight = sched.scheduled
        join = None if sched.preempted else self._join
        try:
            ran, culprits = self._run(sched.scheduled, outputs, between_layers, join)
        finally:
            self._in_flight = []
        return outputs + self._deltas(ran, culprits)

    @torch.inference_mode()
    def step_ahead(self) -> list[RequestDelta]:
        """From ``between_layers`` only: a step of its own, run now, for waiting requests
        that outrank every request of the step in flight (``Scheduler.schedule_ahead``),
        so that a request which cannot wait (an interactive one behind a batch step that
        takes seconds on a CPU) has its first token without waiting for that step to end.
        Nothing if no waiting request outranks it. Its requests fail alone, if at all:
        the step in flight goes on."""
        if not self._in_flight or not self.scheduler.waiting:
            return []
        best = min(s.seq.priority for s in self._in_flight)
        sched = self.scheduler.schedule_ahead(best)
        if not sched.scheduled:
            return []
        self.counters["steps_ahead"] += 1
        try:
            ran, culprits = self._run(sched.scheduled, [])
        except StepFailed as exc:
            ran, culprits = [], [(s.seq, exc) for s in sched.scheduled]
        return self._deltas(ran, culprits)

    def _admit_compiled(self) -> list[RequestDelta]:
        """Requests whose grammar is ready join the scheduler (their matcher first consumes
        any output they already hold); those whose grammar failed, or compiled for longer
        than ``grammar_compile_timeout``, end with ``invalid_params``."""
        outputs: list[RequestDelta] = []
        now = time.monotonic()
        for rid, (seq, future, since) in list(self._compiling.items()):
            if not future.done():
                if now - since > self.config.grammar_compile_timeout:
                    limit = self.config.grammar_compile_timeout
                    why = f"structured_outputs took more than {limit:g} s to compile"
                    outputs += self._refuse(seq, CompileTimeout("invalid_params", why))
                continue
            del self._compiling[rid]
            error = future.exception()
            if error is not None:
                outputs += self._refuse(seq, error)
                continue
            refused = self._give_matchers(seq, future.result())
            if refused is not None:
                outputs += self._refuse(seq, refused)
                continue
            self.scheduler.add(seq)
        return outputs

    @staticmethod
    def _give_matchers(seq: Sequence, matcher: Any) -> ValueError | None:
        """Each output of ``seq``'s request its own matcher (copies of the fresh one: the n
        outputs sample apart, so each follows the grammar alone), which consumes the
        tokens that output already holds; the error if the grammar refuses them."""
        members = [seq] if seq.group is None else seq.group.seqs
        for i, member in enumerate(members):
            member.grammar = matcher.deep_copy() if i < len(members) - 1 else matcher
        for member in members:
            held = member.output_token_ids
            if held and not member.grammar.consume_tokens(held):
                return ValueError(member.grammar.get_error())
        return None

    def _refuse(self, seq: Sequence, exc: BaseException) -> list[RequestDelta]:
        """End a request whose grammar could not be built, before it ran: its other
        outputs first (cancelled), then ``seq`` with the error, whose delta ends it."""
        self._compiling.pop(seq.request_id, None)
        if isinstance(exc, InvalidRequest):
            seq.error, seq.error_code = exc.message, exc.code
        else:
            seq.error, seq.error_code = describe(exc), "invalid_params"
        reason = "timeout" if isinstance(exc, CompileTimeout) else "compile"
        self.counters[f"structured_refused_{reason}"] += 1
        others = [] if seq.group is None else [s for s in seq.group.seqs if s is not seq]
        ended = [self._finish(s, "cancelled", RequestState.CANCELLED) for s in others]
        return [*ended, self._finish(seq, "error", RequestState.CANCELLED, flush=False)]

    def _join(self) -> list[ScheduledSeq]:
        """Between two layers of the step in flight: waiting requests that join it."""
        if not self.scheduler.waiting:
            return []
        joining = self.scheduler.schedule_join(self._in_flight)
        if joining:
            self.counters["joins"] += 1
            self.counters["requests_joined"] += len(joining)
        return joining

    def _deltas(self, ran: Ran, culprits: Culprits) -> list[RequestDelta]:
        """A pass's outcome: the parts that ran, booked with their tokens, then the
        requests that failed alone."""
        outputs: list[RequestDelta] = []
        for scheduled, samples in ran:
            outputs += self._update(scheduled, samples)
        return outputs + [self._fail(seq, error) for seq, error in culprits]

    def _run(
        self,
        batch: list[ScheduledSeq],
        finished: list[RequestDelta],
        between_layers: Callable[[], object] | None = None,
        join: Callable[[], list[ScheduledSeq]] | None = None,
    ) -> tuple[Ran, Culprits]:
        """The batch on the model runner (forward pass, sampling); if the forward pass
        raises, the request(s) it fails for, found by bisection (without
        ``between_layers``: what it took in was taken, and may have raised). Requests that
        ``join`` the pass are appended to ``batch``, and so are bisected with the rest.

        Nothing has advanced: ``schedule()`` only allocated blocks and admitted or preempted
        requests, which stays valid for any part of the batch, and ``num_computed_tokens``
        moves only when the scheduler books a pass that ran (K/V a failed pass wrote lie
        beyond it, in blocks no other request shares, and are overwritten). So each half of
        a failing group is run again: a half that runs is updated as usual, a request that
        fails alone ends with ``error``. Costs at most 2n - 1 passes, on the failing path
        only. ``finished`` is what the step already finished, for ``StepFailed``.
        """
        try:
            return [(batch, self.model_runner.run(batch, between_layers, join))], []
        except Exception as exc:
            first_error = exc
        ran: Ran = []
        culprits: Culprits = []
        failing = [(batch, first_error)]
        while failing:
            group, error = failing.pop()
            if len(group) == 1:
                culprits.append((group[0].seq, error))
                continue
            mid = len(group) // 2
            for half in (group[:mid], group[mid:]):
                try:
                    ran.append((half, self.model_runner.run(half)))
                except Exception as half_error:
                    failing.append((half, half_error))
        if len(culprits) == len(batch) > 1:
            raise StepFailed(
                f"the forward pass failed for each of its {len(batch)} requests alone: "
                f"{describe(first_error)}",
                finished,
            ) from first_error
        return ran, culprits

    def _update(
        self, scheduled: list[ScheduledSeq], samples: list[SampleResult | Exception]
    ) -> list[RequestDelta]:
        """Book a pass that ran, then each sampled token: its request's delta. Each request's
        own failure (sampling its row, detokenizing, stop checks) ends only itself."""
        self.scheduler.commit(scheduled)
        self.counters["prompt_tokens"] += sum(s.num_prompt_tokens for s in scheduled)
        self.counters["steps"] += 1
        seqs = [s.seq for s in scheduled if s.samples]
        outputs: list[RequestDelta] = []
        for seq, result in zip(seqs, samples, strict=True):
            if isinstance(result, Exception):
                outputs.append(self._fail(seq, result))
                continue
            try:
                outputs.append(self._accept(seq, result))
            except Exception as exc:
                outputs.append(self._fail(seq, exc))
        return outputs

    def _accept(self, seq: Sequence, result: SampleResult) -> RequestDelta:
        """Record a sampled token, then apply the stop rules in vLLM's order: a stop token
        (only past ``min_tokens``: before, the sampler bans them, unless the ban would have
        covered the whole vocabulary and was dropped), a stop string, the length limits."""
        if seq.state is RequestState.PREFILLING:
            seq.transition(RequestState.DECODING)
        token = result.token_id
        seq.append_token(token)
        self.counters["generation_tokens"] += 1
        grammar_done = False
        if seq.grammar is not None:
            if not seq.grammar.consume_token(token):
                raise ValueError(f"the grammar refused token {token}: {seq.grammar.get_error()}")
            grammar_done = seq.grammar.is_stopped()  # nothing may follow: complete
        p = seq.params
        stop_token = seq.num_output_tokens > p.min_tokens and (
            (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        )
        stop_string = self.output_processor.add_token(
            seq, token, result.logprobs, find_stop=not stop_token
        )
        if stop_token or stop_string or grammar_done:
            # Text cut at a stop string is final: nothing after it is flushed.
            return self._finish(seq, "stop", RequestState.COMPLETED, flush=not stop_string)
        if (
            p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens
        ) or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length", RequestState.COMPLETED)
        return self.output_processor.delta(seq)

    def _fail(self, seq: Sequence, exc: Exception) -> RequestDelta:
        """End one request whose own processing raised (no flush: the detokenizer may be
        what raised); the step goes on without it."""
        logger.warning("request %s failed", seq.request_id, exc_info=exc)
        seq.error = describe(exc)
        if seq.group is None:
            return self._finish(seq, "error", RequestState.FAILED, flush=False)
        # one output failing fails its request: the others end first, cancelled
        for other in seq.group.seqs:
            if other is not seq and not other.state.finished:
                self._finish(other, "cancelled", RequestState.CANCELLED)
        return self._finish(seq, "error", RequestState.FAILED, flush=False)

    def _finish(
        self, seq: Sequence, reason: str, state: RequestState, flush: bool = True
    ) -> RequestDelta:
        """End a request; ``flush`` adds the bytes of a character the output ended inside.
        The flush comes first: if it raises, the request is still as it was. One output of
        several ends alone (``finished`` False) until the last, whose delta carries all.
        An output that never started (waiting to fork) can only be cancelled."""
        if flush:
            self.output_processor.flush(seq)
        seq.finish_reason = reason
        if seq.state is RequestState.WAITING:
            state = RequestState.CANCELLED
        seq.transition(state)
        compiling = self._compiling.pop(seq.request_id, None)
        if compiling is not None:
            compiling[1].cancel()
        self.scheduler.remove(seq)
        self.counters[f"finished_{reason}"] += 1
        delta = self.output_processor.finish(seq)
        group = seq.group
        if group is None:
            del self.requests[seq.request_id]
            self._scored(delta, seq)
            return delta
        finals = self._finals.setdefault(seq.request_id, {})
        finals[seq.index] = delta
        if not group.finished:
            delta.finished = False
            return delta
        del self.requests[seq.request_id], self._finals[seq.request_id]
        delta.outputs = [finals[i] for i in range(len(group.seqs))]
        self._scored(delta, group.seqs[0])
        return delta

    def _scored(self, delta: RequestDelta, seq: Sequence) -> None:
        """A request's last delta gets its prompt's scores, ids and text, if it asked."""
        if seq.prompt_logprobs is not None:
            delta.prompt_logprobs = seq.prompt_logprobs
            delta.prompt_token_ids = seq.prompt_token_ids
            delta.prompt_text = self.tokenizer.decode(seq.prompt_token_ids, False)

    def _end(self, seq: Sequence, reason: str, state: RequestState) -> list[RequestDelta]:
        """End every unfinished output of ``seq``'s request; the last delta ends it."""
        members = [seq] if seq.group is None else seq.group.seqs
        return [self._finish(m, reason, state) for m in members if not m.state.finished]

    def _expire_deadlines(self) -> list[RequestDelta]:
        now = time.monotonic()
        late = [s for s in self.requests.values() if s.deadline is not None and now >= s.deadline]
        return [d for s in late for d in self._end(s, "deadline", RequestState.CANCELLED)]


def _output_params(params: SamplingParams, index: int) -> SamplingParams:
    """Output ``index``'s parameters: one output, and with a seed ``seed + index``, so that
    it samples as a request of its own with that seed would. Only the first output scores
    the prompt (it prefills it)."""
    if params.n == 1:
        return params
    own = copy.copy(params)
    own.n = 1
    if params.seed is not None:
        own.seed = params.seed + index
    if index:
        own.prompt_logprobs = None
    return own
