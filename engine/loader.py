"""Checkpoint loading: a GGUF file or a Hugging Face safetensors folder, to one state dict.

Both sources end up with Hugging Face Llama parameter names and HF's rotate-half Q/K layout, so
the model code has a single weight format to deal with. GGUF tensors are dequantized on load:
the engine computes in `dtype`, it does not run quantized kernels.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenq.engine import downloads
from tokenq.engine.config import ModelConfig

GGUF_SUFFIX = ".gguf"

# GGUF architectures we load, and whether llama.cpp's converter permuted their Q/K rows for its
# interleaved ("normal") rope. Qwen2 uses NeoX-style rope in llama.cpp, which is HF's layout.
_GGUF_ARCHS: dict[str, bool] = {"llama": True, "qwen2": False}

_GGUF_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Names some safetensors checkpoints carry that are derived state, not parameters.
_IGNORED_HF_KEY_RE = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a `.gguf` file or a folder with `config.json` and `*.safetensors`.

    Returns the config and the weights under HF Llama names (see docs/design.md); `lm_head.weight`
    is absent when the embeddings are tied. Every expected tensor is checked for presence and
    shape, so a mismatched checkpoint fails here and not in the middle of a forward pass.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        config, weights = _load_gguf(path, dtype)
    elif path.is_dir():
        config, weights = _load_safetensors_dir(path, dtype)
    else:
        raise ValueError(f"not a .gguf file or a model folder: {path}")
    _check_weights(config, weights, source=path)
    return config, weights


def resolve_model(name_or_path: str | Path) -> Path:
    """Map a known alias (`smollm2-135m`) to its cached file, fetching it if needed; pass
    `.gguf` files and model folders through."""
    text = str(name_or_path)
    if text in downloads.KNOWN_MODELS:
        return downloads.ensure_model(text)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    known = ", ".join(sorted(downloads.KNOWN_MODELS))
    if path.exists():
        raise ValueError(f"{path} is neither a .gguf file nor a model folder")
    raise FileNotFoundError(
        f"model {text!r} not found: expected a known alias ({known}), a .gguf file, "
        "or a folder with config.json and *.safetensors"
    )


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `config` must have, with its shape."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
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


# --- safetensors folders -------------------------------------------------------------------


def _load_safetensors_dir(
    folder: Path, dtype: torch.dtype
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model folder {folder} has no config.json")
    hf_config = json.loads(config_path.read_text())
    config = ModelConfig.from_hf_config(hf_config)
    config.eos_token_ids = _merge_ids(
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
    return config, weights


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


def _merge_ids(*groups: list[int]) -> list[int]:
    """Union that keeps first-seen order, so the primary EOS stays first."""
    seen: dict[int, None] = {}
    for group in groups:
        for token_id in group:
            seen.setdefault(int(token_id), None)
    return list(seen)


# --- GGUF ------------------------------------------------------------------------------------


# GGUF value types (gguf.GGUFValueType) -> struct format of a scalar.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_GGUF_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


# llama.cpp's token type for control tokens, and the control-token texts that end a turn.
_GGUF_TOKEN_CONTROL = 3
_END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_text|>",
    }
)


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost dimension first, like the HF tensor
    qtype: int  # gguf.GGMLQuantizationType
    data: np.ndarray  # raw bytes, uint8 [*shape[:-1], bytes_per_row], a view of the file


@dataclass
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf(path: str | Path, *, with_tensors: bool = True) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor directory; tensor data stays memory-mapped.

    gguf.GGUFReader does the same but builds a numpy view per string, which takes seconds for
    a 49k-token vocabulary; a struct-based pass over the header is ~100x faster and keeps
    worker startup short. The format constants and dequantization still come from `gguf`.
    """
    import gguf

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(mm)
    magic, version = cur.unpack("<II")
    if magic != gguf.GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (2 and 3 are)")
    n_tensors, n_kv = cur.unpack("<QQ")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.unpack("<I")
        metadata[key] = cur.value(vtype)
    tensors = []
    if with_tensors:
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.unpack("<I")
            dims = cur.unpack(f"<{n_dims}Q")
            qtype, offset = cur.unpack("<IQ")
            infos.append((name, dims, qtype, offset))
        alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        data_start = -(-cur.pos // alignment) * alignment
        for name, dims, qtype, offset in infos:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            row_bytes = dims[0] // block * block_bytes
            shape = tuple(reversed(dims))
            rows = math.prod(shape[:-1])
            data = np.frombuffer(mm, np.uint8, rows * row_bytes, data_start + offset)
            tensors.append(GGUFTensor(name, shape, qtype, data.reshape(*shape[:-1], row_bytes)))
    return GGUFFile(metadata, tensors)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's key/value metadata as plain Python values (arrays as lists)."""
    return read_gguf(path, with_tensors=False).metadata


class _Cursor:
    """Sequential little-endian reads over the memory-mapped header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return self.buf[start : self.pos].decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[item_type]
                values = np.frombuffer(self.buf, np.dtype(fmt), count, self.pos)
                self.pos += values.nbytes
                return values.tolist()
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"corrupt GGUF: unknown value type {vtype}")
        return self.unpack(_GGUF_SCALARS[vtype])[0]


def gguf_eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """End-of-generation ids the way llama.cpp collects them.

    The declared EOS comes first, then EOT/EOM when declared, then control tokens whose text is
    a well-known end marker: chat models often declare only one of `<|im_end|>` and
    `<|endoftext|>` but stop on either.
    """
    declared = [
        meta[f"tokenizer.ggml.{key}_token_id"]
        for key in ("eos", "eot", "eom")
        if f"tokenizer.ggml.{key}_token_id" in meta
    ]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    markers = [
        i
        for i, (text, kind) in enumerate(zip(tokens, types, strict=True))
        if kind == _GGUF_TOKEN_CONTROL and text in _END_OF_GENERATION_TEXTS
    ]
    return _merge_ids(declared, markers)


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    file = read_gguf(path)
    config = _gguf_config(file.metadata, {t.name for t in file.tensors})
    permuted = _GGUF_ARCHS[file.metadata["general.architecture"]]

    weights: dict[str, torch.Tensor] = {}
    for tensor in file.tensors:
        name = _hf_name(tensor.name)
        array = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.qtype))
        if permuted and ".self_attn.q_proj." in name:
            array = _unpermute_rope_rows(array, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            array = _unpermute_rope_rows(array, config.num_kv_heads)
        if not array.flags.writeable:
            # Unquantized tensors come back as views of the read-only file mapping.
            array = array.copy()
        weights[name] = torch.from_numpy(array).to(dtype)
    return config, weights


def _gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (supported: {sorted(_GGUF_ARCHS)})"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "this GGUF carries per-dimension rope frequency factors (rope_freqs, Llama 3.1-style "
            "scaling), which tokenq only reads from a safetensors folder's config.json"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = get("embedding_length")
    num_heads = get("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else get("vocab_size")
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_dim=get("attention.key_length", hidden // num_heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(get),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_eos_token_ids(meta),
    )


def _gguf_rope_scaling(get: Any) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r} (only linear)")
    return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GGUF_TOP_LEVEL and suffix == "weight":
        return f"{_GGUF_TOP_LEVEL[base]}.weight"
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _GGUF_PER_LAYER:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_GGUF_PER_LAYER[part]}.{kind}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a Llama-family model")


def _unpermute_rope_rows(array: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's rope rotates adjacent pairs (x0, x1), (x2, x3)...; HF's rotates halves
    (x_i, x_{i + d/2}). The converter reorders each head's rows from [first half; second half]
    to interleaved; reading the rows of a head as (pair, 2) and transposing puts them back.
    Works for weights `[rows, in]` and biases `[rows]` alike.
    """
    rows = array.shape[0]
    half = rows // num_heads // 2
    return array.reshape(num_heads, half, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
