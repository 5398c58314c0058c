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
