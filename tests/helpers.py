"""Shared test fixtures-as-functions: the default model, and tiny random Llamas on disk."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokenq.engine.checkpoint import expected_weight_shapes
from tokenq.engine.config import ModelConfig
from tokenq.engine.downloads import DEFAULT_MODEL, ensure_model
from tokenq.engine.loader import load_tokenizer
from tokenq.engine.tokenizer import Tokenizer

# A Llama small enough to run in milliseconds, with the default model's real vocabulary so
# prompts can be text. GQA (4 query heads over 2 KV heads) on purpose.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}

# ModelConfig field names accepted as overrides too, mapped to their config.json spelling.
_ALIASES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "eos_token_ids": "eos_token_id",
}


def default_model_path() -> Path:
    """The default model's GGUF (downloaded on first use, like `make model`)."""
    return ensure_model(DEFAULT_MODEL)


GEMMA3_270M = "gemma3-270m"


def gemma3_270m_path() -> Path:
    """The real Gemma 3 270M's GGUF (downloaded on first use, like `make model
    MODEL=gemma3-270m`)."""
    return ensure_model(GEMMA3_270M)


@lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def make_tiny_llama_dir(path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a random Llama as a Hugging Face folder (config.json, model.safetensors, and the
    default model's tokenizer) into `path`, and return `path`.

    Overrides use config.json names (`num_hidden_layers=3`) or ModelConfig names
    (`num_layers=3`); `attention_bias=True` makes it a Qwen2-style model with q/k/v biases.
    Weights are scaled so activations stay O(1) and logits are peaked (std ~3): greedy
    decoding then does not hinge on near-ties that float reordering could flip.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = default_tokenizer()
    hf = {
        **TINY_LLAMA_CONFIG,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_ids,
    }
    for key, value in overrides.items():
        hf[_ALIASES.get(key, key)] = value
    if hf.pop("attention_bias", False):
        hf["model_type"] = "qwen2"
    config = ModelConfig.from_hf_config(hf)

    (path / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2) + "\n")
    save_file(random_weights(config, seed), str(path / "model.safetensors"))
    tokenizer.save_pretrained(path)
    return path


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            # Not all ones, so a missing or misapplied norm weight changes the output.
            w = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            w = torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            w = 0.1 * torch.randn(shape, generator=g)
        else:
            gain = 3.0 if name == "lm_head.weight" else 1.0
            w = gain * torch.randn(shape, generator=g) / shape[-1] ** 0.5
        weights[name] = w.contiguous()
    return weights


# Tiny checkpoints of every family, as transformers itself writes them (its own config class,
# model class and save_pretrained), each exercising what sets its family apart. The default
# model's vocabulary again, so prompts can be text.
_TINY_BASE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    # head_dim independent of the hidden size (4 x 32 = 128 query dims from 64)
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
    # a window (8) far shorter than the prompts; sliding, sliding, global layers, the local
    # layers on their own rotary base; an attention scale that is not head_dim's
    "gemma3_text": {
        "model_type": "gemma3_text",
        "head_dim": 32,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 100.0,
        "tie_word_embeddings": True,
    },
    # half the head rotates; longrope with its short factors (prompts stay within the
    # pretrained context) and the attention factor its extension implies
    "phi3": {
        "model_type": "phi3",
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 2048,
        "original_max_position_embeddings": 512,
        "pad_token_id": None,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.3, 1.9, 2.4],
            "long_factor": [2.0, 3.5, 5.0, 8.0],
        },
    },
    # top-2 of 8 experts, weights not renormalised, layer 1 a dense MLP
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
    },
    # top-2 of 8 experts, renormalised; every layer slides over 8 keys, so blocks are freed
    "mixtral": {
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
    },
}


def make_tiny_hf_dir(path: Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """A random model of ``family`` (a ``TINY_FAMILIES`` key) built and saved by transformers,
    with the default model's tokenizer beside it. Weights are drawn as in ``random_weights``
    (activations O(1), peaked logits, routers with clear preferences), by parameter name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    tokenizer = default_tokenizer()
    spec = {**_TINY_BASE, **TINY_FAMILIES[family], **overrides}
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_ids,
        **spec,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    gemma = model_type == "gemma3_text"
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            # not all ones (Gemma: not all zeros, it scales by 1 + w)
            w = (0.0 if gemma else 1.0) + 0.1 * torch.randn(p.shape, generator=g)
        elif name == "model.embed_tokens.weight":
            w = torch.randn(p.shape, generator=g) / (64**0.5 if gemma else 1.0)
        elif name.endswith("mlp.gate.weight"):  # a router: clear favourites per token
            w = 2.0 * torch.randn(p.shape, generator=g)
        else:
            gain = 3.0 if name == "lm_head.weight" or (gemma and "embed" in name) else 1.0
            w = gain * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        state[name] = w
    model.load_state_dict(state)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
