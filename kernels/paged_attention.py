"""Triton paged attention for mixed prefill/decode batches, with an optional KV split.

Same semantics as ``kernels.reference.paged_attention_torch``, reading the paged cache in
place. Design choices:

- One kernel serves every batch shape. A program owns ``BLOCK_Q`` consecutive new tokens of
  one sequence times all query heads of one KV head (GQA packing), so each K/V tile is loaded
  once per query group instead of once per query head, and decodes still fill a tensor-core
  tile (``BLOCK_Q * group >= 16`` rows).
- Programs are numbered ``cu_seqlens_q[i] // BLOCK_Q + i + j`` for query block ``j`` of
  sequence ``i``. That bounds the grid by ``num_tokens // BLOCK_Q + num_seqs``, known on the
  host from shapes alone, so launching needs no device-to-host copy (CUDA-graph friendly); each
  program finds its sequence by a binary search over ``cu_seqlens_q`` and the few surplus
  programs exit at once.
- Flash-decoding: with ``num_splits > 1`` the key range of every query block is cut into
  ``num_splits`` parts, each program writes a normalised partial output and its log-sum-exp,
  and a second kernel merges them. Long decode-only batches need it to occupy the GPU when
  ``num_seqs * num_kv_heads`` programs are too few; the kernel itself works for any batch.
- Softmax runs online in fp32, in base 2 with ``scale * log2(e)`` folded into the scores.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Split only when every part still gets this many keys: below that the merge costs more than
# the extra parallelism brings.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16
# Enough programs for a few resident per SM, so no SM idles in the last wave.
_PROGRAMS_PER_SM = 4


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest sequence ``i`` whose first program number ``cu[i] // BLOCK_Q + i`` is <= pid."""
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    qk_scale,
    window,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    stride_bt,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    q_start = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_start >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - query_len

    # Row r is new token q_start + r // GROUP_P2 and query head kv_head * GROUP + r % GROUP_P2.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_start + rows // GROUP_P2
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (q_idx < query_len) & (rows % GROUP_P2 < GROUP)
    token = (q_begin + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h
    q = tl.load(q_ptrs + dims[None, :] * stride_q_d, mask=row_ok[:, None], other=0.0)
    last_key = context_len + q_idx  # causal: the newest key each row may see
    # sliding window: the oldest key the block's first row sees (0 without a window)
    kv_start = tl.where(window > 0, tl.maximum(context_len + q_start - window + 1, 0), 0)

    kv_end = context_len + tl.minimum(q_start + BLOCK_Q, query_len)
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(kv_end, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_k_h + dims[None, :] * stride_k_d
    v_head = v_cache_ptr + kv_head * stride_v_h + dims[None, :] * stride_v_d
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        keys = tile * BLOCK_N + offs_n
        key_ok = (keys < kv_end) & (keys >= kv_start)  # blocks outside are never read
        block = tl.load(block_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        k_rows = block * stride_k_b + slot * stride_k_s
        k = tl.load(k_head + k_rows[:, None], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = (keys[None, :] <= last_key[:, None]) & key_ok[None, :]
        visible &= (window <= 0) | (keys[None, :] > last_key[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block * stride_v_b + slot * stride_v_s
        v = tl.load(v_head + v_rows[:, None], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Padding rows, and rows of a split that holds none of their keys, have l = 0.
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h
        o_ptrs += dims[None, :] * stride_o_d
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # An empty split has m = -inf, so lse = -inf: it merges with weight 0.
        lse = m_i + tl.log2(tl.where(empty, 1.0, l_i))
        po_ptrs = part_out_ptr + token[:, None] * stride_po_t + head[:, None] * stride_po_h
        po_ptrs += split * stride_po_s + dims[None, :]
        tl.store(po_ptrs, o, mask=row_ok[:, None])
        tl.store(part_lse_ptr + token * stride_pl_t + head * stride_pl_h + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    num_seqs,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(cu_seqlens_q_ptr + num_seqs):
        return  # a padding row no sequence owns: left untouched, as by the reference
    splits = tl.arange(0, SPLITS_P2)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM)
    lse_ptrs = part_lse_ptr + token * stride_pl_t + head * stride_pl_h + splits
    lse = tl.load(lse_ptrs, mask=split_ok, other=float("-inf"))
    # Some split holds each row's own key, so the max is finite.
    weight = tl.exp2(lse - tl.max(lse, 0))
    po_ptrs = part_out_ptr + token * stride_po_t + head * stride_po_h
    po_ptrs += splits[:, None] * stride_po_s + dims[None, :]
    parts = tl.load(po_ptrs, mask=split_ok[:, None], other=0.0)
    o = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    o_ptrs = out_ptr + token * stride_o_t + head * stride_o_h + dims * stride_o_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class _Tiles:
    block_m: int  # rows of query tokens x query heads per program
    block_n: int  # keys per inner-loop tile
    num_warps: int


# Decodes bring one row per query head, so their tile is the 16 rows tl.dot needs at least;
# prefill chunks get a tile the tensor cores can chew on. fp32 is computed without TF32 (to
# match the reference), i.e. on CUDA cores, and needs small tiles to stay clear of spilling.
# These sizes compile without register spills for head_dim 64 and 128 on sm_90.
_DECODE_TILES = _Tiles(block_m=16, block_n=64, num_warps=4)
_PREFILL_TILES = _Tiles(block_m=64, block_n=64, num_warps=4)
_FP32_TILES = _Tiles(block_m=16, block_n=32, num_warps=4)


def _tiles(dtype: torch.dtype, decode_only: bool) -> _Tiles:
    if dtype == torch.float32:
        return _FP32_TILES
    return _DECODE_TILES if decode_only else _PREFILL_TILES


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """KV splits for a decode-only batch: enough programs to fill the device, none too short.

    Public so that a caller preallocating scratch (CUDA graphs) sizes it as the auto path will.
    """
    by_occupancy = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), num_seqs * num_kv_heads)
    by_length = max_seq_len // _MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def split_scratch_numel(num_tokens: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of split-KV scratch: a partial output and a log-sum-exp per split."""
    return num_tokens * num_heads * num_splits * (head_dim + 1)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    split_scratch: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[num_tokens, num_heads, head_dim]`` over the paged cache,
    within a sliding ``window`` of keys when it is positive (``paged_attention_torch``'s).

    ``max_query_len`` and ``max_seq_len`` are hints that spare a device-to-host read: with
    both given (or ``num_splits`` given) the call never synchronises, as CUDA-graph capture
    requires. They only pick tile sizes and the split count, never the result: a wrong hint
    costs speed, not correctness. ``num_splits=None`` splits the KV range automatically
    for decode-only batches (see ``choose_num_splits``); an explicit value forces it for any
    batch. ``split_scratch`` is an optional fp32 buffer of at least ``split_scratch_numel``
    elements, so that the split path allocates nothing.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q heads/dim {num_heads}/{head_dim} do not fit cache {num_kv_heads}/{cache_head_dim}"
        )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if cu_seqlens_q.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("cu_seqlens_q, seq_lens and block_tables disagree on num_seqs")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    decode_only = max_query_len == 1 if max_query_len is not None else num_tokens == num_seqs
    tiles = _tiles(q.dtype, decode_only)
    block_q = max(1, tiles.block_m // group_p2)
    if num_splits is None:
        num_splits = 1
        if decode_only:
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, q.device)

    if num_splits > 1:
        needed = split_scratch_numel(num_tokens, num_heads, head_dim, num_splits)
        if split_scratch is None:
            split_scratch = torch.empty(needed, dtype=torch.float32, device=q.device)
        elif split_scratch.dtype != torch.float32 or split_scratch.numel() < needed:
            raise ValueError(f"split_scratch must be fp32 with at least {needed} elements")
        part_out = split_scratch[: needed - num_tokens * num_heads * num_splits]
        part_out = part_out.view(num_tokens, num_heads, num_splits, head_dim)
        part_lse = split_scratch[part_out.numel() : needed].view(num_tokens, num_heads, num_splits)
    else:
        part_out, part_lse = out, out  # never touched when there is a single split

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        num_seqs,
        scale * _LOG2E,
        window,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        GROUP=group,
        GROUP_P2=group_p2,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=tiles.block_n,
        NUM_SPLITS=num_splits,
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=tiles.num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            cu_seqlens_q,
            num_seqs,
            *part_out.stride()[:3],
            *part_lse.stride()[:2],
            *out.stride(),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
        )
    return out
