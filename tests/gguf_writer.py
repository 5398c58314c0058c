"""A tiny Hugging Face checkpoint written as llama.cpp's converter would write it: its
architecture's tensor names and metadata keys, Llama's Q/K rows permuted for llama.cpp's
interleaved rope, Gemma's norm weights plus one, Phi-3's longrope factors as tensors, each
layer's experts stacked. Float32 tensors, so the file holds exactly the folder's model; the
tokenizer is the default model's, copied from its GGUF."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file

from tests.helpers import default_model_path
from tokenq.engine.gguf_loader import read_gguf_metadata

# model_type -> llama.cpp architecture
ARCHS = {
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up rows in one tensor
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm"}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}
_EXPERT_PART |= {"down_proj": "down", "w2": "down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's halves interleaved as pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(folder: Path, out: Path, *, tokenizer: bool = True) -> Path:
    """``folder``'s model as ``out``; without its ``tokenizer`` (transformers' GGUF reader
    takes seconds over a vocabulary's metadata), for readers of the weights alone."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = ARCHS[model_type]
    state = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)

    def u32(key: str, value: int) -> None:
        writer.add_uint32(f"{arch}.{key}", int(value))

    u32("context_length", cfg["max_position_embeddings"])
    u32("embedding_length", cfg["hidden_size"])
    u32("block_count", cfg["num_hidden_layers"])
    u32("feed_forward_length", cfg["intermediate_size"])
    u32("attention.head_count", heads)
    u32("attention.head_count_kv", kv_heads)
    u32("attention.key_length", head_dim)
    u32("attention.value_length", head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", cfg.get("rope_theta")))
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    u32("rope.dimension_count", rotary)
    if cfg.get("sliding_window"):
        u32("attention.sliding_window", cfg["sliding_window"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        u32("expert_count", experts)
        u32("expert_used_count", cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            u32("expert_feed_forward_length", cfg["moe_intermediate_size"])
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        factor = rope.get("attention_factor")
        if factor is None:  # what llama.cpp's converter writes when the config has none
            scale = cfg["max_position_embeddings"] / original
            factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", factor)
        u32("rope.scaling.original_context_length", original)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if tokenizer:
        _copy_tokenizer(writer)

    stacked: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, w in state.items():
        if match := _EXPERT.fullmatch(name):
            layer, expert, part = match.groups()
            stacked.setdefault((layer, _EXPERT_PART[part]), {})[int(expert)] = w
            continue
        if name in _TOP:
            gguf_name = _TOP[name]
        else:
            layer, part, kind = re.fullmatch(
                r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name
            ).groups()
            names = _LAYER | (_GEMMA_LAYER if arch == "gemma3" else {})
            gguf_name = f"blk.{layer}.{names[part]}.{kind}"
        if arch == "llama" and ".attn_q." in gguf_name:
            w = _permute(w, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            w = _permute(w, kv_heads)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            w = w + 1
        writer.add_tensor(gguf_name, np.ascontiguousarray(w, dtype=np.float32))
    for (layer, part), by_expert in sorted(stacked.items()):
        w = np.stack([by_expert[e] for e in range(len(by_expert))])
        writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _copy_tokenizer(writer: Any) -> None:
    meta = read_gguf_metadata(default_model_path())
    writer.add_string("tokenizer.ggml.model", meta["tokenizer.ggml.model"])
    writer.add_string("tokenizer.ggml.pre", meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    for key in ("bos", "eos", "padding", "unknown"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            writer.add_uint32(
                f"tokenizer.ggml.{key}_token_id", meta[f"tokenizer.ggml.{key}_token_id"]
            )
    if "tokenizer.chat_template" in meta:
        writer.add_chat_template(meta["tokenizer.chat_template"])
