"""Triton KV-cache write: scatter a step's new K/V rows into their paged slots.

Same semantics as ``kernels.reference.write_kv_torch``. One program per token moves all of
that token's KV heads at once, so a decode step is a single small launch and a long prefill
chunk is still only ``num_tokens`` programs. Negative slots are skipped on the device, so the
caller never filters (and never synchronises) on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_value_t,
    stride_value_h,
    stride_value_d,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_vc_d,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k_src = key_ptr + token * stride_key_t + heads[:, None] * stride_key_h
    k = tl.load(k_src + dims[None, :] * stride_key_d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + heads[:, None] * stride_kc_h
    tl.store(k_dst + dims[None, :] * stride_kc_d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v_src = value_ptr + token * stride_value_t + heads[:, None] * stride_value_h
    v = tl.load(v_src + dims[None, :] * stride_value_d, mask=mask)
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + heads[:, None] * stride_vc_h
    tl.store(v_dst + dims[None, :] * stride_vc_d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches.

    ``slot_mapping[t] = block_id * block_size + offset``; a negative slot skips the token.
    Inputs may be strided views (e.g. slices of a fused QKV projection): nothing is copied.
    """
    num_tokens = key.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [num_tokens, {num_kv_heads}, {head_dim}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
