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
        the new tokens' K/V are written into it before attention reads it.

        ``between_layers`` is called after each layer but the last. It may run another
        forward pass (a step ahead: engine/llm_engine.py): this one's state is local, and
        that pass writes only blocks this one does not read. If it returns a ``Join``, the
        joining tokens go through the layers done so far on their own and the pass goes on
        with them appended: requests that arrive while a long prefill has just begun share
        its remaining layers instead of waiting for the next step.
        """
        state = self._begin(positions, meta, kv_cache, F.embedding(input_ids, self.embed))
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            self._layer(i, layer, state, kv_cache)
            if between_layers is not None and i < last:
                join = between_layers()
                if isinstance(join, Join):
                    state = self._join(state, join, i + 1, kv_cache)
                    logits_indices = join.merged.logits_indices
        y = self.ops.add_rms_norm(state.x, state.delta, self.norm, self.cfg.rms_norm_eps, state.y)
        return self.lm_head(y[logits_indices])

    def _begin(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        x: torch.Tensor,
        delta: torch.Tensor | None = None,
    ) -> _Pass:
        """A pass's state before its next layer: the residual stream ``x`` (the tokens'
        embeddings, or what layers already run made of it) and the last sublayer's output
        ``delta``, not yet added to it (the next norm adds it, in the same pass over x)."""
        self.backend.prepare(meta, kv_cache.shape[3])
        n, cfg = x.shape[0], self.cfg
        return _Pass(
            positions=positions,
            meta=meta,
            x=x,
            delta=delta,
            y=torch.empty_like(x),
            act=torch.empty(n, cfg.intermediate_size, dtype=x.dtype, device=x.device),
            attn_out=torch.empty(n, cfg.num_heads, cfg.head_dim, dtype=x.dtype, device=x.device),
        )

    def _layer(self, i: int, layer: LayerWeights, state: _Pass, kv_cache: torch.Tensor) -> None:
        """Layer ``i`` over the pass's tokens. Q and K are rotated in place inside the QKV
        product, and the residual adds ride on the norms, so the fused ops do each in one
        pass over the rows."""
        cfg, ops = self.cfg, self.ops
        n = state.x.shape[0]
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = h * d, kvh * d
        eps = cfg.rms_norm_eps
        y = ops.add_rms_norm(state.x, state.delta, layer.input_norm, eps, state.y)
        qkv = layer.qkv(y)
        ops.rope(qkv, h + kvh, d, state.positions, self.cos, self.sin)
        k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
        self.backend.write_kv(
            qkv[:, q_size : q_size + kv_size].view(n, kvh, d),
            qkv[:, q_size + kv_size :].view(n, kvh, d),
            k_cache,
            v_cache,
            state.meta.slot_mapping,
        )
        q = qkv[:, :q_size].view(n, h, d)
        self.backend.attention(q, k_cache, v_cache, state.meta, self.scale, state.attn_out)
        y = ops.add_rms_norm(
            state.x, layer.o(state.attn_out.view(n, q_size)), layer.post_norm, eps, y
        )
        state.delta = layer.down(ops.silu_mul(layer.gate_up(y), state.act))

    def _join(self, state: _Pass, join: Join, done: int, kv_cache: torch.Tensor) -> _Pass:
        """The joining tokens through the first ``done`` layers, then one state for both,
        in ``join.merged``'s order: the pass's tokens, then the joining ones."""
        new = join.inputs
        other = self._begin(
            new.positions, new.meta, kv_cache, F.embedding(new.input_ids, self.embed)
        )
        for i in range(done):
            self._layer(i, self.layers[i], other, kv_cache)
        merged = join.merged
        x = torch.cat([state.x, other.x])
        delta = torch.cat([state.delta, other.delta])
        return self._begin(merged.positions, merged.meta, kv_cache, x, delta)


@dataclass
class _Pass:
    """A forward pass between two layers."""

    positions: torch.Tensor
    meta: AttentionMetadata
    x: torch.Tensor  # the residual stream
    delta: torch.Tensor | None  # the last sublayer's output, not yet added to x
    y: torch.Tensor  # scratch: the normed stream
    act: torch.Tensor  # scratch: the MLP's activations
    attn_out: torch.Tensor  # scratch


@dataclass
class ModelInputs:
    """A batch as the model takes it (built by the model runner from scheduled requests)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor


@dataclass
class Join:
    """Requests joining a pass between two layers (see ``LlamaModel.forward``): their own
    inputs, and the pass's batch with them appended."""

    inputs: ModelInputs
    merged: ModelInputs
