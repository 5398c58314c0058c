"""The model on its device: the KV cache, a scheduled batch turned into model inputs, the
forward pass, and sampling.

It knows nothing of request lifecycles or text: it gets the scheduler's batch and gives back
one sampled token for each request that reached the end of its known tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenq.engine.attention import AttentionBackend, AttentionMetadata
from tokenq.engine.checkpoint import Checkpoint
from tokenq.engine.config import EngineConfig
from tokenq.engine.model import CausalLM, Join, ModelInputs
from tokenq.engine.sampler import SampleResult, sample
from tokenq.engine.scheduler import ScheduledSeq
from tokenq.engine.sequence import Sequence
from tokenq.engine.structured import MaskFiller, StructuredStats
from tokenq.kernels import cpu_ops
from tokenq.kernels.reference import argmax_rows_torch


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        device: torch.device,
        dtype: torch.dtype,
        *,
        int8: bool = False,
    ) -> None:
        """Size and allocate the KV cache, then build the model from the checkpoint's weights.

        The pool gets ``num_kv_blocks`` blocks, else as many as ``kv_cache_bytes`` holds; a
        request's context is capped by what the pool holds, since a request must always fit
        in the pool alone, or preemption could never help it (for a model whose every layer
        slides, what it holds at once: its window and a chunk).
        """
        mc = checkpoint.config
        self.device = device
        self.block_size = bs = config.block_size
        bytes_per_block = 2 * mc.num_layers * bs * mc.num_kv_heads * mc.head_dim
        bytes_per_block *= torch.empty((), dtype=dtype).element_size()
        self.num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_bytes(device) // bytes_per_block
        )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        # A model whose every layer slides holds at most its window, the last full block
        # and a step's chunk, however long the request: a pool that holds that caps nothing.
        window_blocks = (
            -(-(mc.kv_window + config.max_num_batched_tokens) // bs) + 2 if mc.kv_window else None
        )
        if window_blocks is None or self.num_blocks < window_blocks:
            self.max_model_len = min(self.max_model_len, self.num_blocks * bs)
        self.kv_cache = torch.zeros(
            (mc.num_layers, 2, self.num_blocks, bs, mc.num_kv_heads, mc.head_dim),
            dtype=dtype,
            device=device,
        )
        self.backend = AttentionBackend(config.attention_backend, device, dtype)
        self.model = CausalLM(
            mc,
            checkpoint.weights,
            device=device,
            dtype=dtype,
            max_positions=self.max_model_len,
            backend=self.backend,
            int8=int8,
        )
        self.eos_token_ids = checkpoint.eos_token_ids
        self.frees_blocks = mc.kv_window is not None  # the scheduler frees left-behind blocks
        # Greedy rows' argmax over the vocabulary: torch's took 3.3 ms a decode step of 64
        # rows on the CPU (a quarter of a tiny model's step), the C kernel 0.6 ms.
        self.argmax = cpu_ops.argmax_rows_cpu if self.backend.name == "cpu" else argmax_rows_torch
        self.masks = MaskFiller(mc.vocab_size, StructuredStats())  # the engine shares its stats

    def run(
        self,
        scheduled: list[ScheduledSeq],
        between_layers: Callable[[], object] | None = None,
        join: Callable[[], list[ScheduledSeq]] | None = None,
    ) -> list[SampleResult | Exception]:
        """The forward pass over the batch (raising if it fails), then a token for each
        request that reaches the end of its known tokens (``ScheduledSeq.samples``), in
        batch order; a request whose own sampling fails gets its exception instead.

        ``between_layers``: see ``CausalLM.forward``. After each call, ``join`` gives the
        requests (if any) that join the pass there: they are appended to ``scheduled``, so
        that the caller books them with the rest."""
        inputs, prompt_rows = self._inputs(scheduled)
        masks = self.masks.start([s.seq.grammar for s in scheduled if s.samples])
        hook = between_layers
        if between_layers is not None and join is not None:
            merged = inputs

            def hook() -> Join | None:
                nonlocal merged
                between_layers()
                joining = join()
                if not joining:
                    return None
                scheduled.extend(joining)
                new, _ = self._inputs(joining)  # none scores its prompt (scheduler)
                merged = _merged(merged, new)
                return Join(new, merged)

        logits = self.model.forward(
            inputs.input_ids,
            inputs.positions,
            inputs.meta,
            self.kv_cache,
            inputs.logits_indices,
            hook,
        )
        logits = logits.to("cpu", torch.float32)
        num_prompt_rows = sum(count for _, _, count in prompt_rows)
        if prompt_rows:
            _score_prompts(prompt_rows, logits[:num_prompt_rows])
        seqs = [s.seq for s in scheduled if s.samples]
        allowed = self.masks.allowed(masks, [q.grammar for q in seqs])
        return self._sample(seqs, logits[num_prompt_rows:], allowed)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's K/V, in every layer."""
        if copies:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*copies, strict=True))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _inputs(self, scheduled: list[ScheduledSeq]) -> tuple[ModelInputs, PromptRows]:
        """The batch's tokens as one flat row, with what attention needs to find each
        request's tokens and blocks; logits where a request samples (a forked output of no
        tokens samples from its leader's row, just before it), and first, at every prompt
        position of a request that scores its prompt (those rows, per request)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        prompt_indices: list[int] = []
        prompt_rows: PromptRows = []
        for s in scheduled:
            if s.num_tokens == 0:  # a fork: its leader's last row
                logits_indices.append(logits_indices[-1])
                continue
            end = s.start + s.num_tokens
            input_ids += s.seq.token_ids[s.start : end]
            positions += range(s.start, end)
            table = s.seq.block_table
            p = s.start
            while p < end:  # a run of slots per block: a prefill's are not walked one by one
                block, offset = divmod(p, bs)
                n = min(bs - offset, end - p)
                first = table[block] * bs + offset
                slots += range(first, first + n)
                p += n
            cu.append(cu[-1] + s.num_tokens)
            seq_lens.append(end)
            if s.samples:
                logits_indices.append(cu[-1] - 1)
            if s.seq.needs_prompt_logprobs:
                # row p predicts token p + 1: the prompt's rows but the one that samples
                count = min(end, s.seq.num_prompt_tokens - 1) - s.start
                if count > 0:
                    prompt_indices += range(cu[-2], cu[-2] + count)
                    prompt_rows.append((s.seq, s.start, count))
        attended = [s for s in scheduled if s.num_tokens]
        max_blocks = max(len(s.seq.block_table) for s in attended)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in attended]
        if self.frees_blocks:  # freed entries (attention never reads them) name block 0
            tables = [[max(b, 0) for b in table] for table in tables]
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
        inputs = ModelInputs(
            t(input_ids, torch.long),
            t(positions, torch.long),
            meta,
            t(prompt_indices + logits_indices, torch.long),
        )
        return inputs, prompt_rows

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor, allowed: list[torch.Tensor | None]
    ) -> list[SampleResult | Exception]:
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
                self.argmax,
                allowed,
            )
        except Exception:
            return [
                self._sample_alone(q, logits[i : i + 1], allowed[i]) for i, q in enumerate(seqs)
            ]

    def _sample_alone(
        self, seq: Sequence, logits: torch.Tensor, allowed: torch.Tensor | None
    ) -> SampleResult | Exception:
        try:
            banned = self._banned(seq)
            return sample(
                logits,
                [seq.params],
                [seq.prompt_token_ids],
                [seq.output_token_ids],
                [banned],
                self.argmax,
                [allowed],
            )[0]
        except Exception as exc:
            return exc

    def _banned(self, seq: Sequence) -> list[int]:
        """Tokens the request may not produce yet: its stop tokens, before ``min_tokens``."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        banned = list(p.stop_token_ids)
        if not p.ignore_eos:
            banned += self.eos_token_ids
        return banned


# (request, first prompt position, how many) of the rows that score prompt tokens
PromptRows = list[tuple[Sequence, int, int]]


def _score_prompts(prompt_rows: PromptRows, logits: torch.Tensor) -> None:
    """Each prompt token's log-probability given the tokens before it, with the top-k
    alternatives (``prompt_logprobs``), into its request, from the rows predicting it."""
    row = 0
    for seq, start, count in prompt_rows:
        logprobs = torch.log_softmax(logits[row : row + count], -1)
        row += count
        targets = seq.prompt_token_ids[start + 1 : start + 1 + count]
        chosen = logprobs.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1).tolist()
        k = seq.params.prompt_logprobs or 0
        top = torch.topk(logprobs, k) if k else None
        for j, (token, lp) in enumerate(zip(targets, chosen, strict=True)):
            entry = {token: lp}  # the prompt's own token first, then the top-k
            if top is not None:
                for alt, alt_lp in zip(
                    top.indices[j].tolist(), top.values[j].tolist(), strict=True
                ):
                    entry.setdefault(alt, alt_lp)
            seq.prompt_logprobs[start + 1 + j] = entry  # type: ignore[index]


def _merged(a: ModelInputs, b: ModelInputs) -> ModelInputs:
    """``b``'s batch appended to ``a``'s, the same as ``_inputs`` of both requests' lists:
    the inputs of a pass that requests joined are its own and theirs joined as tensors,
    not all its tokens walked again in Python (2,048 of them for 64 prompts of 32)."""
    ma, mb = a.meta, b.meta
    n = a.input_ids.shape[0]  # a's tokens (a shape: no device sync)
    width = max(ma.block_tables.shape[1], mb.block_tables.shape[1])

    def padded(tables: torch.Tensor) -> torch.Tensor:  # as _inputs pads: with block 0
        return torch.nn.functional.pad(tables, (0, width - tables.shape[1]))

    meta = AttentionMetadata(
        cu_seqlens_q=torch.cat([ma.cu_seqlens_q, mb.cu_seqlens_q[1:] + n]),
        seq_lens=torch.cat([ma.seq_lens, mb.seq_lens]),
        block_tables=torch.cat([padded(ma.block_tables), padded(mb.block_tables)]),
        slot_mapping=torch.cat([ma.slot_mapping, mb.slot_mapping]),
        max_query_len=max(ma.max_query_len, mb.max_query_len),
        max_seq_len=max(ma.max_seq_len, mb.max_seq_len),
    )
    return ModelInputs(
        torch.cat([a.input_ids, b.input_ids]),
        torch.cat([a.positions, b.positions]),
        meta,
        torch.cat([a.logits_indices, b.logits_indices + n]),
    )
