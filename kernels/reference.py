"""Plain torch paged attention, KV-cache writes, and the elementwise ops of a layer.

This is the engine's attention on the CPU where the C kernels do not build, the reference
every Triton kernel in this package is tested against, and the fallback for what
``cpu_ops`` fuses (the ``*_torch`` ops at the end take the same arguments as its ``*_cpu``
ones). Layout (shared with the kernels, read in place, never copied
into another layout):

- ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer.
- A batch is a list of sequences. Sequence ``i`` brings ``query_len = cu_seqlens_q[i+1] -
  cu_seqlens_q[i]`` new tokens (a prefill chunk, or 1 for a decode) and has ``seq_lens[i]``
  tokens in total, the new ones included and already written to the cache.
- ``block_tables[i, j]`` is the physical block holding that sequence's tokens
  ``j*block_size .. (j+1)*block_size-1``; rows are padded with any valid block id.
- New query ``q`` (position ``p = context_len + q``, where ``context_len = seq_len -
  query_len``) sees keys at positions ``<= p``; with a sliding ``window`` of W > 0 only those
  ``> p - W`` (W keys, its own included: transformers' sliding-window mask). Blocks that lie
  wholly before every window of a batch are never read, so their table entries may name any
  block (the engine frees them).

Decodes read whole blocks and mask the unused tail, so those slots must hold finite values
(the engine allocates its cache zero-filled); the Triton kernels never read past
``seq_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    ``slot_mapping[t] = block_id * block_size + offset``; a negative slot skips the token.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep])


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks ``[..., n]`` of a cache as ``[..., num_kv_heads, n * block_size, head_dim]``."""
    # index_select over whole blocks copies contiguous rows: several times faster on the
    # CPU than advanced indexing of the 4-d cache.
    flat = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    g = flat.view(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])
    return g.transpose(-3, -2)  # [..., kvh, n * block_size, d]


def _length_buckets(rows: list[int], lens: list[int], ratio: float = 3.0) -> list[list[int]]:
    """Rows sorted by length, cut wherever padding to the bucket's longest would cost more
    than ``ratio`` times the shortest: the gathered K/V stay near what is really needed."""
    buckets: list[list[int]] = []
    for i in sorted(rows, key=lens.__getitem__):
        if buckets and lens[i] <= ratio * lens[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


@dataclass
class DecodeBucket:
    """Decodes attended in one padded SDPA call."""

    rows: torch.Tensor  # their query rows
    lens: torch.Tensor  # [S] their sequence lengths, int64
    tables: torch.Tensor  # [S, nblk] their block tables up to the longest one's last block
    block_size: int
    # window -> (blocks [S, n], additive mask [S, 1, 1, n * block_size]); built on first use,
    # then shared by every layer of that window
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def view(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks each row reads under ``window`` (0: all of them) and its mask: a row's
        first block is the one holding its oldest visible key, so a short window gathers a
        few blocks however long the sequences are."""
        if window in self.views:
            return self.views[window]
        bs, lens = self.block_size, self.lens
        lo = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
        first, last = lo // bs, (lens - 1) // bs
        n = int((last - first).max()) + 1
        cols = (first[:, None] + torch.arange(n, device=lens.device)[None, :]).clamp(
            max=last[:, None]
        )
        blocks = self.tables.gather(1, cols)
        pos = first[:, None] * bs + torch.arange(n * bs, device=lens.device)[None, :]
        valid = (pos >= lo[:, None]) & (pos < lens[:, None])
        # An additive float mask keeps SDPA off its slower boolean-mask checks.
        mask = torch.zeros(valid.shape, device=lens.device).masked_fill_(~valid, float("-inf"))
        self.views[window] = (blocks, mask[:, None, None, :])
        return self.views[window]


@dataclass
class PrefillChunk:
    start: int  # first query row
    end: int
    seq_len: int
    blocks: torch.Tensor  # int64 block ids covering seq_len


@dataclass
class TorchAttentionPlan:
    """Everything about a batch's shape that every layer would otherwise recompute: the
    engine builds it once per step and each layer only gathers and attends."""

    decodes: list[DecodeBucket]
    prefills: list[PrefillChunk]


def plan_attention_torch(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> TorchAttentionPlan:
    """Split a batch into decode buckets and prefill chunks.

    Decodes are batched into padded attention calls, since a step usually holds many of
    them, bucketed by length so that short ones are not padded to the longest.
    """
    dev = cu_seqlens_q.device
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decodes = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
    buckets = []
    for group in _length_buckets(decodes, lens):
        nblk = -(-lens[group[-1]] // block_size)
        idx = torch.tensor(group, dtype=torch.long, device=dev)
        buckets.append(
            DecodeBucket(
                rows=cu_seqlens_q.to(torch.long)[idx],
                lens=seq_lens[idx].to(torch.long),
                tables=block_tables[idx, :nblk].to(torch.long),
                block_size=block_size,
            )
        )
    prefills = [
        PrefillChunk(
            cu[i], cu[i + 1], lens[i], block_tables[i, : -(-lens[i] // block_size)].to(torch.long)
        )
        for i in range(len(lens))
        if cu[i + 1] - cu[i] > 1
    ]
    return TorchAttentionPlan(buckets, prefills)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: TorchAttentionPlan | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[num_tokens, num_heads, head_dim]`` over the paged cache,
    within a sliding ``window`` of keys when it is positive.

    Each decode bucket is one padded SDPA call; each prefill chunk gets its own call with
    its causal offset mask. GQA is left to SDPA's ``enable_gqa`` so K/V are never repeated
    per query head. A ``plan`` from ``plan_attention_torch`` skips re-planning.
    """
    if out is None:
        out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    if plan is None:
        plan = plan_attention_torch(cu_seqlens_q, seq_lens, block_tables, block_size)
    for b in plan.decodes:
        blocks, mask = b.view(window)
        k = _gather(k_cache, blocks)  # [S, kvh, n*bs, d]
        v = _gather(v_cache, blocks)
        qd = q[b.rows].unsqueeze(2)  # [S, h, 1, d]
        o = F.scaled_dot_product_attention(
            qd, k, v, attn_mask=mask.to(q.dtype), scale=scale, enable_gqa=True
        )
        out[b.rows] = o.squeeze(2).to(out.dtype)

    for c in plan.prefills:
        qlen, seq_len = c.end - c.start, c.seq_len
        ctx = seq_len - qlen
        # the first block holding a key the chunk's first query sees
        first = max(0, ctx - window + 1) // block_size if window else 0
        keys = seq_len - first * block_size
        k = _gather(k_cache, c.blocks[first:])[:, :keys]  # [kvh, keys, d]
        v = _gather(v_cache, c.blocks[first:])[:, :keys]
        qp = q[c.start : c.end].transpose(0, 1)  # [h, qlen, d]
        if ctx == 0 and (not window or qlen <= window):
            o = F.scaled_dot_product_attention(
                qp, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kpos = torch.arange(first * block_size, seq_len, device=q.device)
            qpos = torch.arange(ctx, seq_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            if window:
                mask &= kpos[None, :] > qpos[:, None] - window
            o = F.scaled_dot_product_attention(
                qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[c.start : c.end] = o.transpose(0, 1).to(out.dtype)
    return out


def add_rms_norm_torch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """``rms_norm(x + delta) * weight``, with ``x`` updated in place to ``x + delta``.

    Returns a new tensor: ``out`` is the scratch the fused op writes into, unused here.
    """
    if delta is not None:
        x.add_(delta)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_torch(
    x: torch.Tensor,
    num_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Rotate the first ``num_heads`` heads of each row of ``x`` in place (rotate-half), with
    the rows of the ``cos``/``sin`` tables that ``positions`` pick. The tables' width is the
    rotary dimension: a head's dimensions past it (partial rotary) are left as they are."""
    rot = cos.shape[-1]
    heads = x[:, : num_heads * head_dim].view(x.shape[0], num_heads, head_dim)[..., :rot]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = rot // 2
    rotated = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    heads.copy_(heads * c + rotated * s)
    return x


def rms_norm_heads_torch(
    x: torch.Tensor, num_heads: int, head_dim: int, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMS-normalise each of the first ``num_heads`` heads of each row of ``x`` in place, with
    one ``weight`` of ``head_dim`` for all of them (the q/k norms of Qwen3 and Gemma 3)."""
    heads = x[:, : num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
    heads.copy_(F.rms_norm(heads, (head_dim,), weight, eps))
    return x


def silu_mul_torch(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows ``[gate | up]`` (a new tensor; ``out`` is unused)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_torch(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for rows ``[gate | up]`` (a new tensor; ``out`` is unused)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def argmax_rows_torch(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum (max() rather than argmax(): the same index,
    measured 2.5x faster on the CPU)."""
    return x.max(-1).indices
