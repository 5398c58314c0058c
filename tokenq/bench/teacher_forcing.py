"""Teacher-forced next-token distributions from the engine's model and from transformers.

Both sides read the same token sequences; the engine gets them as its scheduler would feed
them (a prefill chunk, then further chunks and single-token decodes, all sequences batched
in each step), through its paged KV cache, and returns every position's logits. Comparing
distributions position by position measures the numerics, not the luck of a sampled path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenq.engine.attention import AttentionMetadata
from tokenq.engine.llm_engine import LLMEngine


def engine_logits(engine: LLMEngine, seqs: list[list[int]], chunks: list[int]) -> torch.Tensor:
    """Float32 logits ``[num_seqs, seq_len, vocab]``: all sequences (equal lengths) fed
    together, ``chunks[i]`` tokens of each in step i, every position's logits kept."""
    runner = engine.model_runner
    length = len(seqs[0])
    assert all(len(s) == length for s in seqs) and sum(chunks) == length
    bs = runner.block_size
    nblk = -(-length // bs)
    assert len(seqs) * nblk <= runner.num_blocks, "KV pool too small for the test"
    tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(len(seqs))]
    out = torch.empty(len(seqs), length, engine.model_config.vocab_size)
    start = 0
    for n in chunks:
        end = start + n
        ids, positions, slots, cu = [], [], [], [0]
        for s, table in zip(seqs, tables, strict=True):
            ids += s[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor([end] * len(seqs), dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=n,
            max_seq_len=end,
        )
        with torch.inference_mode():
            logits = runner.model.forward(
                torch.tensor(ids),
                torch.tensor(positions),
                meta,
                runner.kv_cache,
                torch.arange(len(ids)),
            )
        out[:, start:end] = logits.float().view(len(seqs), n, -1)
        start = end
    return out


def hf_logits(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """Float32 logits ``[num_seqs, seq_len, vocab]`` of one transformers forward pass."""
    with torch.inference_mode():
        return model(torch.tensor(seqs)).logits.float()


@dataclass
class Agreement:
    """How close two sets of next-token distributions are, over every position."""

    positions: int
    top1: float  # fraction of positions where both pick the same most likely token
    mean_abs_logprob: float  # |log p - log q| of the reference's top token, averaged
    max_abs_logprob: float  # the same, the worst position
    mean_kl: float  # KL(reference || other) in nats, averaged

    def __str__(self) -> str:
        return (
            f"{self.positions} positions: top-1 {self.top1:.4f}, |dlogp| mean "
            f"{self.mean_abs_logprob:.4f} max {self.max_abs_logprob:.4f}, KL {self.mean_kl:.2e}"
        )


def agreement(reference: torch.Tensor, other: torch.Tensor) -> Agreement:
    ref = torch.log_softmax(reference.reshape(-1, reference.shape[-1]).double(), -1)
    oth = torch.log_softmax(other.reshape(-1, other.shape[-1]).double(), -1)
    top = ref.argmax(-1)
    diff = (ref.gather(1, top[:, None]) - oth.gather(1, top[:, None])).abs()
    kl = (ref.exp() * (ref - oth)).sum(-1)
    return Agreement(
        positions=ref.shape[0],
        top1=(top == oth.argmax(-1)).double().mean().item(),
        mean_abs_logprob=diff.mean().item(),
        max_abs_logprob=diff.max().item(),
        mean_kl=kl.mean().item(),
    )
