"""A Hugging Face model folder: ``config.json``, ``*.safetensors`` (one file, or shards named
by ``model.safetensors.index.json``), and the tokenizer files beside them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from tokenq.engine.checkpoint import Checkpoint, merge_ids
from tokenq.engine.config import ModelConfig
from tokenq.engine.tokenizer import Tokenizer

# Names some safetensors checkpoints carry that are derived state, not parameters.
_IGNORED_HF_KEY_RE = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def load_hf_folder(folder: Path, dtype: torch.dtype) -> Checkpoint:
    """The folder's config, its weights in ``dtype``, and its tokenizer when it has one."""
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model folder {folder} has no config.json")
    hf_config = json.loads(config_path.read_text())
    config = ModelConfig.from_hf_config(hf_config)
    config.eos_token_ids = merge_ids(
        config.eos_token_ids, _generation_config_eos(folder / "generation_config.json")
    )

    files = _safetensors_files(folder)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if _IGNORED_HF_KEY_RE.fullmatch(name):
                continue
            weights[name] = tensor.to(dtype)
    if config.tie_word_embeddings:
        # Some exporters write the tied head out anyway; it is the embedding, by definition.
        weights.pop("lm_head.weight", None)
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    return Checkpoint(folder, config, weights, tokenizer)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are missing: {absent}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {folder} has no *.safetensors files")
    return files


def _generation_config_eos(path: Path) -> list[int]:
    if not path.is_file():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
