"""The step-level engine: requests in, one batched forward pass per ``step()``, deltas out.

The worker drives it; ``engine.llm.LLM`` wraps it for offline use. Nothing here knows
about Redis: admission control is exposed as ``free_capacity()`` so the caller can pull
only as much work as the engine can take.
"""

from __future__ import annotations

import collections.abc
import itertools
import logging
import time
from collections import Counter
from typing import Any

import torch
from tokenq.engine.attention import AttentionBackend, AttentionMetadata
from tokenq.engine.block_manager import BlockManager
from tokenq.engine.config import EngineConfig
from tokenq.engine.errors import InvalidRequest, StepFailed, clip
from tokenq.engine.loader import load_checkpoint, resolve_model
from tokenq.engine.model import LlamaModel
from tokenq.engine.outputs import EngineStats, RequestOutput
from tokenq.engine.sampler import SampleResult, sample
from tokenq.engine.sampling_params import SamplingParams
from tokenq.engine.scheduler import ScheduledSeq, Scheduler
from tokenq.engine.sequence import RequestMetrics, RequestState, Sequence
from tokenq.engine.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        checkpoint = load_checkpoint(resolve_model(config.model), self.dtype)
        if checkpoint.tokenizer is None:
            raise FileNotFoundError(f"{checkpoint.path} has no tokenizer.json")
        self.model_config = mc = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        weights = checkpoint.weights

        block_size = config.block_size
        bytes_per_block = 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim
        bytes_per_block *= torch.empty((), dtype=self.dtype).element_size()
        num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_bytes(self.device) // bytes_per_block
        )
        # A request must always fit in the pool alone, or preemption could never help it.
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, num_blocks * block_size
        )
        self.kv_cache = torch.zeros(
            (mc.num_layers, 2, num_blocks, block_size, mc.num_kv_heads, mc.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.backend = AttentionBackend(config.attention_backend, self.device, self.dtype)
        self.model = LlamaModel(
            mc,
            weights,
            device=self.device,
            dtype=self.dtype,
            max_positions=self.max_model_len,
            backend=self.backend,
        )
        del weights
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.eos_token_ids = set(checkpoint.eos_token_ids)
        del checkpoint
        # Text longer than this cannot tokenize to fewer than max_model_len tokens (None:
        # this tokenizer gives no such bound, so every prompt is tokenized to be measured).
        chars = self.tokenizer.max_token_chars()
        self.max_prompt_chars = None if chars is None else self.max_model_len * chars
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._recent_request_tokens = 256.0  # running mean of prompt + max_tokens, for admission
        self.counters: Counter[str] = Counter()

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
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            priority=priority,
            arrival_order=next(self._arrivals),
            deadline=deadline,
            metrics=RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()),
        )
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        want = len(token_ids) + (params.max_tokens or self.max_model_len)
        self._recent_request_tokens += 0.1 * (
            min(want, self.max_model_len) - self._recent_request_tokens
        )
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
        """A request's input (exactly one of the three) validated and tokenized, and checked
        to fit the context; ``InvalidRequest`` (``invalid_input``, ``empty_prompt``,
        ``prompt_too_long``) otherwise.

        Thread-safe: it reads only what ``__init__`` set and never changes, so a caller can
        tokenize big prompts on other threads (the tokenizer releases the GIL) while the
        engine steps, then pass the ids to ``add_request``. Text too long for the context
        whatever its tokens (see ``max_prompt_chars``) is refused without tokenizing it.
        """
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise InvalidRequest(
                "invalid_input", "give exactly one of prompt, prompt_token_ids, messages"
            )
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequest("invalid_input", "prompt must be a string")
            ids = self._encode_text(prompt, add_special_tokens=True)
        elif messages is not None:
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise InvalidRequest(
                    "invalid_input",
                    "messages must be a non-empty list of {role: str, content: str}",
                )
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except Exception as exc:  # the template's own raise_exception, bad roles
                raise InvalidRequest(
                    "invalid_input", f"chat template failed: {clip(str(exc))}"
                ) from None
            ids = self._encode_text(text, add_special_tokens=False)
        else:
            vocab = self.model_config.vocab_size
            if not isinstance(prompt_token_ids, list):
                raise InvalidRequest("invalid_input", "prompt_token_ids must be a list")
            if len(prompt_token_ids) >= self.max_model_len:  # before a pass over a huge list
                raise self._too_long(f"{len(prompt_token_ids)} tokens")
            if not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                for t in prompt_token_ids
            ):
                raise InvalidRequest(
                    "invalid_input", f"prompt_token_ids must be a list of ids in [0, {vocab})"
                )
            ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequest("empty_prompt", "the prompt has no tokens")
        if len(ids) >= self.max_model_len:
            raise self._too_long(f"{len(ids)} tokens")
        return ids

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise self._too_long(
                f"{len(text)} characters, more than {self.max_model_len} tokens of this "
                f"vocabulary can spell ({self.max_prompt_chars})"
            )
        if not text.isascii():
            try:  # a lone surrogate ("\ud800" is valid JSON) is no UTF-8: no tokens for it
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequest(
                    "invalid_input", f"the prompt is not valid text: {exc.reason} at {exc.start}"
                ) from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _too_long(self, size: str) -> InvalidRequest:
        return InvalidRequest(
            "prompt_too_long",
            f"prompt has {size}; this worker's limit is {self.max_model_len - 1} tokens "
            f"(context {self.max_model_len})",
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; its blocks are free when this returns."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "cancelled", RequestState.CANCELLED)

    def fail_all(self) -> list[RequestOutput]:
        """End every request as failed (after a step raised): the caller reports them."""
        return [
            self._finish(seq, "error", RequestState.FAILED)
            if seq.state in (RequestState.PREFILLING, RequestState.DECODING)
            else self._finish(seq, "cancelled", RequestState.CANCELLED)
            for seq in list(self.requests.values())
        ]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def free_capacity(self) -> int:
        """How many more requests to take now: free sequence slots, and KV blocks left
        after what the queued requests will need, at the recent mean request size."""
        slots = self.config.max_num_seqs - len(self.requests)
        bm = self.block_manager
        queued = sum(bm.blocks_needed(seq.num_tokens + 1) for _, seq in self.scheduler.waiting)
        running_growth = self.scheduler.num_running  # one block of headroom each
        spare = bm.num_free_blocks - queued - running_growth
        per_request = bm.blocks_needed(int(self._recent_request_tokens))
        return max(0, min(slots, spare // max(1, per_request)))

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=bm.usage(),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            counters={**self.counters, "prefix_cache_hit_tokens": bm.num_cache_hit_tokens},
        )

    # -- the step ----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One forward pass over what the scheduler picked, and the tokens it yields.

        A request whose own processing raises (its forward pass, sampling its row,
        detokenizing, stop checks) ends alone with finish reason ``error`` and a message in
        ``RequestOutput.error``; every other request carries on with its normal tokens.
        Raises ``StepFailed`` only when the forward pass fails for every request of a batch
        of several, each run alone too: then no request has advanced.
        """
        outputs = self._expire_deadlines()
        sched = self.scheduler.schedule()
        self.counters["preemptions"] += len(sched.preempted)
        if not sched.scheduled:
            return outputs
        try:
            logits = self._forward(sched.scheduled)
        except Exception as exc:
            return outputs + self._isolate(sched.scheduled, exc, outputs)
        return outputs + self._complete(sched.scheduled, logits)

    def _isolate(
        self, batch: list[ScheduledSeq], exc: Exception, finished: list[RequestOutput]
    ) -> list[RequestOutput]:
        """The batched forward pass raised: find the request(s) it fails for, by bisection.

        Nothing has advanced: ``schedule()`` only allocated blocks and admitted or preempted
        requests, which stays valid for any part of the batch, and ``num_computed_tokens``
        moves only after a successful pass (K/V a failed pass wrote lie beyond it, in blocks
        no other request shares, and are overwritten). So each half of a failing group is
        run again: a half that succeeds is completed as usual, a request that fails alone
        ends with ``error``. Costs at most 2n - 1 passes, on the failing path only.
        """
        outputs: list[RequestOutput] = []
        culprits: list[tuple[Sequence, Exception]] = []
        failing = [(batch, exc)]
        while failing:
            group, error = failing.pop()
            if len(group) == 1:
                culprits.append((group[0].seq, error))
                continue
            mid = len(group) // 2
            for half in (group[:mid], group[mid:]):
                try:
                    logits = self._forward(half)
                except Exception as half_error:
                    failing.append((half, half_error))
                else:
                    outputs += self._complete(half, logits)
        if len(culprits) == len(batch) > 1:
            raise StepFailed(
                f"the forward pass failed for each of its {len(batch)} requests alone: "
                f"{_describe(exc)}",
                finished,
            ) from exc
        return outputs + [self._fail(seq, error) for seq, error in culprits]

    def _complete(self, scheduled: list[ScheduledSeq], logits: torch.Tensor) -> list[RequestOutput]:
        """Book a successful forward pass, then take a token for each request that reached
        the end of its known tokens. Each request's post-processing fails only itself."""
        for s in scheduled:
            prev = s.seq.num_computed_tokens
            s.seq.num_computed_tokens = s.start + s.num_tokens
            self.block_manager.commit_full_blocks(s.seq, prev)
        self.counters["prompt_tokens"] += sum(
            max(0, min(s.start + s.num_tokens, s.seq.num_prompt_tokens) - s.start)
            for s in scheduled
        )
        self.counters["steps"] += 1
        seqs = [s.seq for s in scheduled if s.samples]
        outputs: list[RequestOutput] = []
        for seq, result in zip(seqs, self._sample(seqs, logits), strict=True):
            if isinstance(result, Exception):
                outputs.append(self._fail(seq, result))
                continue
            try:
                outputs.append(self._accept(seq, result))
            except Exception as exc:
                outputs.append(self._fail(seq, exc))
        return outputs

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> collections.abc.Sequence[SampleResult | Exception]:
        """One token per request, batched; if that raises, row by row, so that a row that
        cannot be sampled fails only its own request."""
        if not seqs:
            return []
        try:
            return sample(
                logits,
                [q.params for q in seqs],
                [q.prompt_token_ids for q in seqs],
                [q.output_token_ids for q in seqs],
                [self._banned(q) for q in seqs],
            )
        except Exception:
            return [self._sample_alone(q, logits[i : i + 1]) for i, q in enumerate(seqs)]

    def _sample_alone(self, seq: Sequence, logits: torch.Tensor) -> SampleResult | Exception:
        """This request's token, or the exception that sampling its row raised."""
        try:
            banned = self._banned(seq)
            return sample(
                logits, [seq.params], [seq.prompt_token_ids], [seq.output_token_ids], [banned]
            )[0]
        except Exception as exc:
            return exc

    def _accept(self, seq: Sequence, result: SampleResult) -> RequestOutput:
        """Record a sampled token, then detokenize it and apply the stop rules."""
        if seq.state is RequestState.PREFILLING:
            seq.transition(RequestState.DECODING)
        seq.append_token(result.token_id)
        if result.logprobs is not None:
            seq.logprobs.append(result.logprobs)
        self.counters["generation_tokens"] += 1
        return self._advance(seq, result.token_id)

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """End one request whose own processing raised (no flush: the detokenizer may be
        what raised); the step goes on without it."""
        logger.warning("request %s failed", seq.request_id, exc_info=exc)
        seq.error = _describe(exc)
        return self._finish(seq, "error", RequestState.FAILED, flush=False)

    def _forward(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        bs = self.block_manager.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for s in scheduled:
            end = s.start + s.num_tokens
            input_ids += s.seq.token_ids[s.start : end]
            positions += range(s.start, end)
            table = s.seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(s.start, end)]
            cu.append(cu[-1] + s.num_tokens)
            seq_lens.append(end)
            if s.samples:
                logits_indices.append(cu[-1] - 1)
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = [
            s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in scheduled
        ]
        dev = self.device

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=dev)

        meta = AttentionMetadata(
            cu_seqlens_q=t(cu, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            block_tables=t(tables, torch.int32),
            slot_mapping=t(slots, torch.int64),
            max_query_len=max(s.num_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
        )
        logits = self.model.forward(
            t(input_ids, torch.long),
            t(positions, torch.long),
            meta,
            self.kv_cache,
            t(logits_indices, torch.long),
        )
        return logits.to("cpu", torch.float32)

    def _banned(self, seq: Sequence) -> list[int]:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        banned = list(p.stop_token_ids)
        if not p.ignore_eos:
            banned += self.eos_token_ids
        return banned

    def _advance(self, seq: Sequence, token: int) -> RequestOutput:
        """Detokenize the new token, then apply the stop rules in vLLM's order."""
        p = seq.params
        seq.text += seq.detokenizer.push([token])
        reason = None
        # A stop token stops only past min_tokens. Before, the sampler bans them, unless the
        # ban would have covered the whole vocabulary and was dropped.
        if seq.num_output_tokens > p.min_tokens and (
            (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        ):
            reason = "stop"
        if p.stop and reason is None:
            cut = self._find_stop(seq)
            if cut is not None:
                seq.text = seq.text[:cut]
                return self._finish(seq, "stop", RequestState.COMPLETED, flush=False)
        if reason is None and (
            (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            return self._finish(seq, reason, RequestState.COMPLETED)
        return self._delta(seq, self._safe_text_len(seq))

    def _find_stop(self, seq: Sequence) -> int | None:
        """Where the earliest stop string starts, searching only text that could hold a
        stop string which was not there before this token."""
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, seq.emitted_text_len - longest)
        hits = [i for s in seq.params.stop if (i := seq.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _safe_text_len(self, seq: Sequence) -> int:
        """Text that can be streamed: hold back a tail that may still grow into a stop."""
        text = seq.text
        hold = 0
        for stop in seq.params.stop:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return len(text) - hold

    def _delta(self, seq: Sequence, text_end: int, finished: bool = False) -> RequestOutput:
        sent = seq.num_sent_tokens
        new_ids = seq.output_token_ids[sent:]
        seq.num_sent_tokens = seq.num_output_tokens
        new_text = seq.text[seq.emitted_text_len : text_end]
        seq.emitted_text_len = max(seq.emitted_text_len, text_end)
        logprobs = seq.logprobs[sent:] if seq.params.logprobs is not None else None
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            metrics=seq.metrics,
            logprobs=logprobs,
            text=seq.text if finished else None,
            token_ids=list(seq.output_token_ids) if finished else None,
            error=seq.error,
        )

    def _finish(
        self, seq: Sequence, reason: str, state: RequestState, flush: bool = True
    ) -> RequestOutput:
        """End a request; ``flush`` adds the bytes of a character the output ended inside
        (not wanted after a stop string cut the text)."""
        if flush and seq.detokenizer is not None:
            seq.text += seq.detokenizer.flush()
        seq.finish_reason = reason
        seq.transition(state)
        self.scheduler.remove(seq)
        del self.requests[seq.request_id]
        self.counters[f"finished_{reason}"] += 1
        return self._delta(seq, len(seq.text), finished=True)

    def _expire_deadlines(self) -> list[RequestOutput]:
        now = time.monotonic()
        late = [s for s in self.requests.values() if s.deadline is not None and now >= s.deadline]
        return [self._finish(s, "deadline", RequestState.CANCELLED) for s in late]


def _describe(exc: BaseException) -> str:
    """An exception as a short message for a client: its type and its (clipped) text."""
    return clip(f"{type(exc).__name__}: {exc}")
