"""What a model's files hold, whatever their format: one ``Checkpoint``.

Every format ends up with Hugging Face parameter names (experts stacked per layer) and HF's
rotate-half Q/K layout, so the model code has a single weight format per family to deal with
(names in docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokenq.engine.config import ModelConfig
from tokenq.engine.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    """A model as read from its files, each parsed once.

    ``weights`` are checked against ``config`` on construction (every expected tensor
    present, with its shape), so a mismatched checkpoint fails here and not in the middle of
    a forward pass. ``lm_head.weight`` is absent when the embeddings are tied.
    """

    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    # None for a folder without tokenizer.json: enough for the transformers reference, not
    # for the engine, which needs text in and out.
    tokenizer: Tokenizer | None

    def __post_init__(self) -> None:
        _check_weights(self.config, self.weights, self.path)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the model config's, then the tokenizer's."""
        extra = self.tokenizer.eos_token_ids if self.tokenizer is not None else []
        return merge_ids(self.config.eos_token_ids, extra)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `config` must have, with its shape: Hugging Face's
    names, with a mixture of experts' weights stacked per layer as transformers 5 holds
    them (`mlp.experts.gate_up_proj` ``[experts, 2 * inter, hidden]``, gate rows first)."""
    h, q, kv, d = config.hidden_size, config.q_size, config.kv_size, config.head_dim
    family = config.family
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        if family.fused:
            shapes[a + "qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            shapes[a + "q_proj.weight"] = (q, h)
            shapes[a + "k_proj.weight"] = (kv, h)
            shapes[a + "v_proj.weight"] = (kv, h)
        shapes[a + "o_proj.weight"] = (h, q)
        if config.attention_bias:
            shapes[a + "q_proj.bias"] = (q,)
            shapes[a + "k_proj.bias"] = (kv,)
            shapes[a + "v_proj.bias"] = (kv,)
        if family.qk_norm:
            shapes[a + "q_norm.weight"] = (d,)
            shapes[a + "k_norm.weight"] = (d,)
        if config.is_moe_layer(i):
            e, inter = config.num_experts, config.moe_intermediate_size
            shapes[m + "gate.weight"] = (e, h)
            shapes[m + "experts.gate_up_proj"] = (e, 2 * inter, h)
            shapes[m + "experts.down_proj"] = (e, h, inter)
        elif family.fused:
            shapes[m + "gate_up_proj.weight"] = (2 * config.intermediate_size, h)
            shapes[m + "down_proj.weight"] = (h, config.intermediate_size)
        else:
            shapes[m + "gate_proj.weight"] = (config.intermediate_size, h)
            shapes[m + "up_proj.weight"] = (config.intermediate_size, h)
            shapes[m + "down_proj.weight"] = (h, config.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if family.gemma:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    return shapes


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: Path) -> None:
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [
        f"{name}: {tuple(weights[name].shape)} != {shape}"
        for name, shape in expected.items()
        if name in weights and tuple(weights[name].shape) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {_abbrev(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_abbrev(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes {_abbrev(wrong)}")
    if problems:
        raise ValueError(f"checkpoint {source} does not match its config: " + "; ".join(problems))


def _abbrev(items: list[str], limit: int = 5) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def merge_ids(*groups: list[int]) -> list[int]:
    """Union that keeps first-seen order, so the primary EOS stays first."""
    seen: dict[int, None] = {}
    for group in groups:
        for token_id in group:
            seen.setdefault(int(token_id), None)
    return list(seen)
