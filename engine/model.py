"""The decoder forward pass over the paged KV cache, for every supported family.

Weights are held as plain tensors, with Q/K/V fused into one projection and gate/up into
another, so a dense layer is five matrix products whatever the batch holds. The families
differ in which parts a layer has (``Layer``), never in the loop. A step's tokens (prefill
chunks and decodes of many requests) are one flat batch; only attention needs to know where
each request's tokens start, and the metadata below tells it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenq.engine.attention import AttentionBackend, AttentionMetadata
from tokenq.engine.config import ModelConfig
from tokenq.engine.linear import Linear, QuantLinear, build_linear, dense_weight
from tokenq.engine.moe import MoE
from tokenq.engine.rope import rope_tables
from tokenq.kernels import cpu_ops, reference
from tokenq.kernels.cpu_quant import QuantizedWeight


@dataclass
class DenseMLP:
    gate_up: Linear | QuantLinear  # gate rows first
    down: Linear | QuantLinear
    act_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # act(gate) * up

    def __call__(self, y: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        return self.down(self.act_mul(self.gate_up(y), scratch))


@dataclass
class Layer:
    """One decoder layer's weights and attention settings. Every family is this layer with
    some parts present: q/k norms (Qwen3, Gemma 3), norms on the attention's and the MLP's
    outputs (Gemma 3), routed experts in place of the MLP (Qwen3-MoE, Mixtral)."""

    qkv: Linear | QuantLinear
    o: Linear | QuantLinear
    mlp: DenseMLP | MoE
    input_norm: torch.Tensor
    mlp_norm: torch.Tensor  # before the MLP
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    cos: torch.Tensor  # rotary tables [positions, rotary_dim]: this layer type's
    sin: torch.Tensor
    window: int  # keys attended to, its own included; 0: all


@dataclass(frozen=True)
class FusedOps:
    """The elementwise work between a layer's matrix products, each op one pass over its
    rows: a residual add fused into the next RMSNorm, per-head norms and the rotary
    embedding in place, the activation fused with its product. Same arguments whatever
    implements them."""

    add_rms_norm: Callable[..., torch.Tensor]
    rms_norm_heads: Callable[..., torch.Tensor]
    rope: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    gelu_tanh_mul: Callable[..., torch.Tensor]


# The C kernels (float32 or bfloat16 on the CPU), and torch ops doing the same on any
# device and dtype.
C_OPS = FusedOps(
    cpu_ops.add_rms_norm_cpu,
    cpu_ops.rms_norm_heads_cpu,
    cpu_ops.rope_cpu,
    cpu_ops.silu_mul_cpu,
    cpu_ops.gelu_tanh_mul_cpu,
)
TORCH_OPS = FusedOps(
    reference.add_rms_norm_torch,
    reference.rms_norm_heads_torch,
    reference.rope_torch,
    reference.silu_mul_torch,
    reference.gelu_tanh_mul_torch,
)


class CausalLM:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor | QuantizedWeight],
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        backend: AttentionBackend,
        int8: bool = False,
    ) -> None:
        """``weights`` may hold quantized matrices (kept so, run on the quantized kernels); with
        ``int8`` the float matrices of the linear layers are quantized to int8 too."""
        self.cfg = cfg
        self.backend = backend
        # The cpu backend is the C kernels' one: attention and the fused ops alike.
        self.ops = C_OPS if backend.name == "cpu" else TORCH_OPS
        family = cfg.family

        def w(name: str) -> torch.Tensor:
            return dense_weight(weights[name], device, dtype)

        def linear(names: list[str], bias: torch.Tensor | None = None) -> Linear | QuantLinear:
            parts = [weights[name] for name in names]
            return build_linear(parts, bias, device=device, dtype=dtype, int8=int8)

        def norm(name: str) -> torch.Tensor:
            # Gemma's RMSNorm scales by (1 + w): added once here, in float32, the norm is
            # Llama's (equal in float32; bf16 rounds 1 + w once, where transformers keeps
            # it in float32).
            if family.gemma:
                return (weights[name].float() + 1.0).to(device=device, dtype=dtype)
            return w(name)

        act_mul = (
            self.ops.gelu_tanh_mul if cfg.hidden_act == "gelu_pytorch_tanh" else self.ops.silu_mul
        )
        # A quantized embedding stays so: the lookup dequantizes the rows it reads.
        embed = weights["model.embed_tokens.weight"]
        self.embed = embed if isinstance(embed, QuantizedWeight) else w("model.embed_tokens.weight")
        # Gemma scales the embeddings by sqrt(hidden), rounded to the model's dtype.
        self.embed_scale = (
            torch.tensor(cfg.hidden_size**0.5).to(dtype=dtype, device=device)
            if family.gemma
            else None
        )
        head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        self.lm_head = linear([head])
        self.norm = norm("model.norm.weight")
        full_rope = rope_tables(
            cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling, max_positions, device, dtype
        )
        # Gemma 3's sliding layers rotate with their own base, unscaled; others as the rest.
        local_rope = full_rope
        if cfg.local_rope_theta is not None:
            local_rope = rope_tables(
                cfg.local_rope_theta, cfg.rotary_dim, None, max_positions, device, dtype
            )
        self.layers: list[Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            window = cfg.layer_window(i)
            cos, sin = local_rope if window else full_rope
            if family.fused:
                qkv = linear([a + "qkv_proj.weight"])
            else:
                bias = None
                if cfg.attention_bias:
                    bias = torch.cat([w(a + f"{x}_proj.bias") for x in "qkv"])
                qkv = linear([a + f"{x}_proj.weight" for x in "qkv"], bias)
            mlp: DenseMLP | MoE
            if cfg.is_moe_layer(i):
                mlp = MoE(
                    w(m + "gate.weight"),
                    w(m + "experts.gate_up_proj"),
                    w(m + "experts.down_proj"),
                    top_k=cfg.num_experts_per_tok,
                    normalize=cfg.norm_topk_prob,
                    round_weights=cfg.model_type != "mixtral",
                    act_mul=act_mul,
                )
            else:
                gate_up = linear(
                    [m + "gate_up_proj.weight"]
                    if family.fused
                    else [m + "gate_proj.weight", m + "up_proj.weight"]
                )
                mlp = DenseMLP(gate_up, linear([m + "down_proj.weight"]), act_mul)
            self.layers.append(
                Layer(
                    qkv=qkv,
                    o=linear([a + "o_proj.weight"]),
                    mlp=mlp,
                    input_norm=norm(p + "input_layernorm.weight"),
                    mlp_norm=norm(
                        p
                        + ("pre_feedforward" if family.gemma else "post_attention")
                        + "_layernorm.weight"
                    ),
                    q_norm=norm(a + "q_norm.weight") if family.qk_norm else None,
                    k_norm=norm(a + "k_norm.weight") if family.qk_norm else None,
                    attn_out_norm=(
                        norm(p + "post_attention_layernorm.weight") if family.gemma else None
                    ),
                    mlp_out_norm=(
                        norm(p + "post_feedforward_layernorm.weight") if family.gemma else None
                    ),
                    cos=cos,
                    sin=sin,
                    window=window,
                )
            )
        self.scale = cfg.attention_scale
        # Longrope: a sequence past this many tokens rotates by the long factors' table,
        # which starts max_positions rows down.
        scaling = cfg.rope_scaling or {}
        self.long_rope_after = (
            scaling["original_max_position_embeddings"]
            if scaling.get("rope_type") == "longrope"
            else None
        )
        self.max_positions = max_positions
        dense = any(isinstance(layer.mlp, DenseMLP) for layer in self.layers)
        self.dense_inter = cfg.intermediate_size if dense else 0

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
        state = self._begin(positions, meta, kv_cache, self._embed(input_ids))
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

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            x = self.embed.rows(input_ids).to(self.norm.dtype)
        else:
            x = F.embedding(input_ids, self.embed)
        return x if self.embed_scale is None else x * self.embed_scale

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
        rope_rows = positions
        if self.long_rope_after is not None:
            # transformers' longrope: a sequence longer than the pretrained context rotates
            # its new tokens by the long factors
            long = meta.seq_lens > self.long_rope_after
            per_token = torch.repeat_interleave(long, meta.cu_seqlens_q.diff())
            rope_rows = positions + per_token * self.max_positions
        return _Pass(
            rope_rows=rope_rows,
            meta=meta,
            x=x,
            delta=delta,
            y=torch.empty_like(x),
            act=torch.empty(n, self.dense_inter, dtype=x.dtype, device=x.device),
            attn_out=torch.empty(n, cfg.num_heads, cfg.head_dim, dtype=x.dtype, device=x.device),
        )

    def _layer(self, i: int, layer: Layer, state: _Pass, kv_cache: torch.Tensor) -> None:
        """Layer ``i`` over the pass's tokens. Q and K are normed and rotated in place inside
        the QKV product, and the residual adds ride on the norms, so the fused ops do each
        in one pass over the rows."""
        cfg, ops = self.cfg, self.ops
        n = state.x.shape[0]
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = h * d, kvh * d
        eps = cfg.rms_norm_eps
        y = ops.add_rms_norm(state.x, state.delta, layer.input_norm, eps, state.y)
        qkv = layer.qkv(y)
        if layer.q_norm is not None:
            ops.rms_norm_heads(qkv, h, d, layer.q_norm, eps)
            ops.rms_norm_heads(qkv[:, q_size:], kvh, d, layer.k_norm, eps)
        ops.rope(qkv, h + kvh, d, state.rope_rows, layer.cos, layer.sin)
        k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
        self.backend.write_kv(
            qkv[:, q_size : q_size + kv_size].view(n, kvh, d),
            qkv[:, q_size + kv_size :].view(n, kvh, d),
            k_cache,
            v_cache,
            state.meta.slot_mapping,
        )
        q = qkv[:, :q_size].view(n, h, d)
        self.backend.attention(
            q, k_cache, v_cache, state.meta, self.scale, state.attn_out, layer.window
        )
        attn = layer.o(state.attn_out.view(n, q_size))
        if layer.attn_out_norm is not None:
            attn = ops.add_rms_norm(attn, None, layer.attn_out_norm, eps, torch.empty_like(attn))
        y = ops.add_rms_norm(state.x, attn, layer.mlp_norm, eps, y)
        out = layer.mlp(y) if isinstance(layer.mlp, MoE) else layer.mlp(y, state.act)
        if layer.mlp_out_norm is not None:
            out = ops.add_rms_norm(out, None, layer.mlp_out_norm, eps, torch.empty_like(out))
        state.delta = out

    def _join(self, state: _Pass, join: Join, done: int, kv_cache: torch.Tensor) -> _Pass:
        """The joining tokens through the first ``done`` layers, then one state for both,
        in ``join.merged``'s order: the pass's tokens, then the joining ones."""
        new = join.inputs
        other = self._begin(new.positions, new.meta, kv_cache, self._embed(new.input_ids))
        for i in range(done):
            self._layer(i, self.layers[i], other, kv_cache)
        merged = join.merged
        x = torch.cat([state.x, other.x])
        delta = torch.cat([state.delta, other.delta])
        return self._begin(merged.positions, merged.meta, kv_cache, x, delta)


@dataclass
class _Pass:
    """A forward pass between two layers."""

    rope_rows: torch.Tensor  # each token's row of the rotary tables: its position (longrope:
    # in the long factors' table for a sequence past the pretrained context)
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
    """Requests joining a pass between two layers (see ``CausalLM.forward``): their own
    inputs, and the pass's batch with them appended."""

    inputs: ModelInputs
    merged: ModelInputs
