"""Hugging Face transformers on the same weights: the yardstick for parity and benchmarks,
imported only when called (transformers comes with the ``bench`` extra, not the worker)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from tokenq.engine.config import ModelConfig

MISSING_TRANSFORMERS = (
    "transformers is not installed: the reference model needs the 'bench' extra "
    "(pip install 'tokenq[bench]')"
)


def require_transformers() -> ModuleType:
    """The transformers module, or ``ModuleNotFoundError`` naming the extra that brings it."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ModuleNotFoundError(MISSING_TRANSFORMERS, name="transformers") from None


def build_hf_model(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A transformers causal LM holding exactly the tensors the engine was given."""
    transformers = require_transformers()
    config = transformers.AutoConfig.for_model(**cfg.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) for k, v in weights.items()}, strict=False
    )
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    # generate() fills unset fields from here: with no EOS it runs to max_new_tokens, which
    # is what the engine's ignore_eos does (EOS may be produced, it just does not stop).
    model.generation_config.eos_token_id = None
    return model.eval()


def greedy_config(max_new_tokens: int):  # noqa: ANN201 (transformers is imported lazily)
    """Greedy decoding of exactly ``max_new_tokens`` (``min_new_tokens`` would instead forbid
    EOS, and so change the tokens)."""
    return require_transformers().GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
