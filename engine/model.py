"""The Llama-family forward pass over the paged KV cache.

Weights are held as plain tensors, with Q/K/V fused into one projection and gate/up into
another, so a layer is five matrix products whatever the batch holds. A step's tokens
(prefill chunks and decodes of many requests) are one flat batch; only attention needs
to know where each request's tokens start, and the metadata below tells it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenq.engine.attention import AttentionBackend, AttentionMetadata
from tokenq.engine.config import ModelConfig
from tokenq.kernels import cpu_ops, reference


class Linear:
    """``x @ W.T (+ b)``. On a CPU with oneDNN the weight is packed once into oneDNN's
    blocked layout: measured here about twice as fast as ``F.linear`` for decode-sized
    batches (32 rows) and a quarter faster for prefill-sized ones.

    A bfloat16 weight is packed as bf16 where oneDNN can (it needs AVX-512 or AVX-NE-CONVERT,
    and uses AVX512_BF16/AMX dot products where the CPU has them). Where it cannot, torch's
    own bf16 matrix product measured 6 to 9 times slower than packed fp32 here (AVX2), so
    the bf16 values are packed as fp32 instead and the activations widened at the call:
    every bf16 value is exact in fp32 and oneDNN accumulates bf16 products in fp32 anyway,
    so the result is the same bf16 product, at fp32's speed and memory.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.widen = False  # bf16 activations through an fp32-packed copy of the weight
        if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            self.packed = _pack(weight)
            if self.packed is None and weight.dtype == torch.bfloat16:
                self.packed = _pack(weight.float())
                self.widen = self.packed is not None
                if self.widen and bias is not None:
                    self.bias = bias.float()
            if self.packed is not None:
                self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.widen:
            out = torch.ops.mkldnn._linear_pointwise(
                x.float(), self.packed, self.bias, "none", [], ""
            )
            return out.to(x.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout, or None where this torch or CPU cannot."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (AttributeError, RuntimeError):  # a torch build without the op, a CPU without bf16
        return None


@dataclass
class LayerWeights:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    input_norm: torch.Tensor
    post_norm: torch.Tensor


@dataclass(frozen=True)
class FusedOps:
    """The elementwise work between a layer's matrix products, each op one pass over its
    rows: a residual add fused into the next RMSNorm, the rotary embedding in place, SiLU
    fused with its product. Same arguments whatever implements them."""

    add_rms_norm: Callable[..., torch.Tensor]
    rope: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]


# The C kernels (float32 or bfloat16 on the CPU), and torch ops doing the same on any
# device and dtype.
C_OPS = FusedOps(cpu_ops.add_rms_norm_cpu, cpu_ops.rope_cpu, cpu_ops.silu_mul_cpu)
TORCH_OPS = FusedOps(reference.add_rms_norm_torch, reference.rope_torch, reference.silu_mul_torch)


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        backend: AttentionBackend,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        # The cpu backend is the C kernels' one: attention and the fused ops alike.
        self.ops = C_OPS if backend.name == "cpu" else TORCH_OPS

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = Linear(w("lm_head.weight") if "lm_head.weight" in weights else self.embed)
        self.norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([w(a + f"{x}_proj.bias") for x in "qkv"])
            self.layers.append(
                LayerWeights(
                    qkv=Linear(torch.cat([w(a + f"{x}_proj.weight") for x in "qkv"]), bias),
                    o=Linear(w(a + "o_proj.weight")),
                    gate_up=Linear(torch.cat([w(m + "gate_proj.weight"), w(m + "up_proj.weight")])),
                    down=Linear(w(m + "down_proj.weight")),
                    input_norm=w(p + "input_layernorm.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                )
            )
        # float32 products, as transformers computes them, so rotations match it exactly.
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, cfg.rope_inv_freq())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        logits_indices: torch.Tensor,
        between_layers: Callable[[], object] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` for the chosen token positions.

        ``kv_cache`` is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
        the new tokens' K/V are written into it before attention reads it. Each sublayer's
        output is added to the residual stream by the next norm (``delta``), and Q and K are
        rotated in place inside the QKV product, so that the fused ops do each in one pass.

        ``between_layers`` is called after each layer but the last. It may run another
        forward pass (a step ahead: engine/llm_engine.py): this one's state is local, and
        that pass writes only blocks this one does not read.
        """
        self.backend.prepare(meta, kv_cache.shape[3])
        cfg, ops = self.cfg, self.ops
        n = input_ids.shape[0]
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = h * d, kvh * d
        eps = cfg.rms_norm_eps
        x = F.embedding(input_ids, self.embed)
        y = torch.empty_like(x)
        act = torch.empty(n, cfg.intermediate_size, dtype=x.dtype, device=x.device)
        attn_out = torch.empty(n, h, d, dtype=x.dtype, device=x.device)
        delta = None  # the last sublayer's output, not yet added to x
        for i, layer in enumerate(self.layers):
            y = ops.add_rms_norm(x, delta, layer.input_norm, eps, y)
            qkv = layer.qkv(y)
            ops.rope(qkv, h + kvh, d, positions, self.cos, self.sin)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            self.backend.write_kv(
                qkv[:, q_size : q_size + kv_size].view(n, kvh, d),
                qkv[:, q_size + kv_size :].view(n, kvh, d),
                k_cache,
                v_cache,
                meta.slot_mapping,
            )
            q = qkv[:, :q_size].view(n, h, d)
            self.backend.attention(q, k_cache, v_cache, meta, self.scale, attn_out)
            y = ops.add_rms_norm(x, layer.o(attn_out.view(n, q_size)), layer.post_norm, eps, y)
            delta = layer.down(ops.silu_mul(layer.gate_up(y), act))
            if between_layers is not None and i + 1 < len(self.layers):
                between_layers()
        y = ops.add_rms_norm(x, delta, self.norm, eps, y)
        return self.lm_head(y[logits_indices])
