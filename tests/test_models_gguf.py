"""Every family from a GGUF file: tiny checkpoints written with llama.cpp's names and metadata
(tests/gguf_writer.py) load to the model their folder holds, and run as transformers runs it."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import pytest
import torch

from tests.gguf_writer import ARCHS, write_gguf
from tests.helpers import make_tiny_hf_dir
from tests.test_models import TIGHT, engine_greedy, prompts, transformers_greedy
from tokenq.engine.loader import load_checkpoint

# What a GGUF cannot say, set as llama.cpp assumes it: every Qwen3-MoE layer routed, its
# top-k renormalised; Gemma 3 global every sixth layer, queries scaled by head_dim, local
# layers on base 10000.
GGUF_EXPRESSIBLE = {
    "qwen3_moe": {"mlp_only_layers": [], "norm_topk_prob": True},
    "gemma3_text": {
        "num_hidden_layers": 6,
        "layer_types": None,
        "query_pre_attn_scalar": 32,
        "rope_local_base_freq": 10000.0,
    },
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (its folder, its GGUF)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for family in ARCHS:
        folder = make_tiny_hf_dir(root / family, family, **GGUF_EXPRESSIBLE.get(family, {}))
        out[family] = folder, write_gguf(folder, root / f"{family}.gguf")
    return out


def same(a: object, b: object) -> bool:
    """Equal, floats to float32's precision (GGUF stores its floats in 32 bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("family", list(ARCHS))
def test_a_gguf_loads_to_the_model_its_folder_holds(
    files: dict[str, tuple[Path, Path]], family: str
) -> None:
    folder, gguf_path = files[family]
    ours, theirs = load_checkpoint(gguf_path), load_checkpoint(folder)

    mine, folders = dataclasses.asdict(ours.config), dataclasses.asdict(theirs.config)
    # end-of-generation ids come from each source's tokenizer metadata
    del mine["eos_token_ids"], folders["eos_token_ids"]
    assert same(mine, folders), (mine, folders)
    assert sorted(ours.weights) == sorted(theirs.weights)
    for name, tensor in theirs.weights.items():
        # Gemma's norms went through + 1 - 1 in float32
        assert torch.allclose(ours.weights[name], tensor, rtol=0, atol=1e-6), name


def test_a_gguf_runs_as_transformers_runs_its_folder(
    files: dict[str, tuple[Path, Path]],
) -> None:
    """Gemma 3 (whose norms the file stores plus one), through chunked prefill and recompute
    preemption, token for token. The other families' files hold their folders' models
    exactly (above), which run as transformers runs them (tests/test_models.py)."""
    folder, gguf_path = files["gemma3_text"]
    reqs = prompts()
    got, engine = engine_greedy(gguf_path, reqs, **TIGHT)
    assert engine.counters["preemptions"] > 0
    assert got == transformers_greedy(folder, reqs)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "qwen3_moe", "phi3"])
def test_transformers_reads_the_written_tensors_as_the_folders(
    files: dict[str, tuple[Path, Path]],
    family: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The writer is checked by an independent reader: transformers' GGUF loader (which
    knows these four architectures) undoes its names, layouts and Gemma's + 1 back to the
    folder's tensors."""
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # a pure function transformers calls once per submodule: cached only to save time
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    folder, _ = files[family]
    gguf_path = write_gguf(folder, tmp_path / "weights.gguf", tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model.config)
    read = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert sorted(read["tensors"]) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.allclose(read["tensors"][name], tensor, rtol=0, atol=1e-6), name
