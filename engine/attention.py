"""Chooses the attention implementation: C kernels or plain torch on the CPU, Triton on CUDA.

All read the same paged cache in place; the torch one (``kernels.reference``) is also what
the Triton and C kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenq.engine.downloads import build_dir
from tokenq.kernels import cpu_ops
from tokenq.kernels.reference import TorchAttentionPlan, paged_attention_torch, plan_attention_torch

BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens], every slot valid
    max_query_len: int
    max_seq_len: int
    plan: TorchAttentionPlan | None = None  # set by AttentionBackend.prepare (torch)


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: Triton on CUDA; on the CPU the C kernels where they can be built (float32
    and bfloat16), else torch."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton"
    return "cpu" if dtype in cpu_ops.SUFFIXES and cpu_ops.available(build_dir()) else "torch"


class AttentionBackend:
    """``prepare`` once per step, then ``write_kv`` and ``attention`` for each layer."""

    def __init__(self, name: str, device: torch.device, dtype: torch.dtype) -> None:
        self.name = resolve_backend(name, device, dtype)
        if self.name == "cpu" and not cpu_ops.available(build_dir()):
            raise RuntimeError("attention backend 'cpu' needs the C kernels, which did not build")
        if self.name == "cpu" and dtype not in cpu_ops.SUFFIXES:
            raise ValueError(f"attention backend 'cpu' runs float32 or bfloat16, not {dtype}")
        self._triton = None
        if self.name == "triton":
            from tokenq.kernels.kv_write import write_kv_triton
            from tokenq.kernels.paged_attention import paged_attention_triton

            self._triton = (write_kv_triton, paged_attention_triton)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Plan the batch's attention once for all layers (the torch backend)."""
        if self.name == "torch":
            meta.plan = plan_attention_torch(
                meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, block_size
            )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self._triton is not None:
            self._triton[0](k, v, k_cache, v_cache, slot_mapping)
            return
        # The engine never sends a negative slot, so skip the reference's filtering.
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        window: int = 0,
    ) -> torch.Tensor:
        """Causal attention, within the last ``window`` keys of each query when positive."""
        args = (q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale)
        if self._triton is not None:
            return self._triton[1](
                *args,
                out=out,
                max_query_len=meta.max_query_len,
                max_seq_len=meta.max_seq_len,
                window=window,
            )
        if self.name == "cpu":
            return cpu_ops.paged_attention_cpu(*args, out=out, window=window)
        return paged_attention_torch(*args, out=out, plan=meta.plan, window=window)
