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
# One expert's matrix, as Qwen3-MoE (mlp, gate/up/down_proj) and Mixtral (block_sparse_moe,
# w1/w3/w2) checkpoints write them; and Mixtral's router.
_EXPERT_RE = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
_MIXTRAL_ROUTER_RE = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight")
_EXPERT_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


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
    if config.family.moe:
        weights = stack_experts(weights)
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    return Checkpoint(folder, config, weights, tokenizer)


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert matrices stacked into each layer's ``mlp.experts.gate_up_proj``
    ``[experts, 2 * inter, hidden]`` and ``mlp.experts.down_proj``, the router named
    ``mlp.gate.weight``: the checkpoint's layout (``checkpoint.expected_weight_shapes``).
    Checkpoints already stacked pass through."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        if match := _EXPERT_RE.fullmatch(name):
            layer, expert, part = match.groups()
            parts.setdefault((int(layer), _EXPERT_PART.get(part, part)), {})[int(expert)] = tensor
        elif match := _MIXTRAL_ROUTER_RE.fullmatch(name):
            out[f"model.layers.{match.group(1)}.mlp.gate.weight"] = tensor
        else:
            out[name] = tensor

    def stacked(layer: int, part: str) -> torch.Tensor:
        experts = parts.pop((layer, part), {})
        if not experts or sorted(experts) != list(range(len(experts))):
            raise ValueError(f"layer {layer} {part}: experts {sorted(experts)} are not 0..n-1")
        return torch.stack([experts[e] for e in range(len(experts))])

    for layer in sorted({layer for layer, _ in parts}):
        p = f"model.layers.{layer}.mlp.experts."
        gate, up = stacked(layer, "gate_proj"), stacked(layer, "up_proj")
        out[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[p + "down_proj"] = stacked(layer, "down_proj")
    return out


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
