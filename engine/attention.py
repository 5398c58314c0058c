"""Chooses the attention implementation: plain torch on the CPU, Triton on CUDA.

Both read the same paged cache in place; the torch one (``kernels.reference``) is also
what the Triton kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import paged_attention_torch, write_kv_torch

BACKENDS = ("auto", "torch", "triton")


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    max_query_len: int
    max_seq_len: int


class AttentionBackend:
    """``write_kv`` then ``attention`` for one layer, by the backend's name."""

    def __init__(self, name: str, device: torch.device) -> None:
        if name not in BACKENDS:
            raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
        if name == "auto":
            name = "triton" if device.type == "cuda" else "torch"
        self.name = name
        if name == "triton":
            from kernels.kv_write import write_kv_triton
            from kernels.paged_attention import paged_attention_triton

            self._write = write_kv_triton
            self._attend = paged_attention_triton
        else:
            self._write = write_kv_torch
            self._attend = None

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._write(k, v, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        args = (q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale)
        if self._attend is None:
            return paged_attention_torch(*args, out=out)
        return self._attend(
            *args, out=out, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len
        )
