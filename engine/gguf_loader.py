"""A GGUF file (llama.cpp's format): config, weights, tokenizer and end-of-generation ids, all
from one parse of the file.

Tensors are dequantized on load: the engine computes in ``dtype``, it does not run quantized
kernels. llama.cpp's converter permutes Llama's Q/K rows for its interleaved rope; loading
undoes that, giving HF's layout.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenq.engine.checkpoint import Checkpoint, merge_ids
from tokenq.engine.config import ModelConfig
from tokenq.engine.tokenizer import Tokenizer

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
    return merge_ids(declared, markers)


def load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
    """The file's config, weights (dequantized to ``dtype``) and tokenizer."""
    import gguf

    file = read_gguf(path)
    eos_token_ids = gguf_eos_token_ids(file.metadata)
    config = _gguf_config(file.metadata, {t.name for t in file.tensors}, eos_token_ids)
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
    tokenizer = Tokenizer.from_gguf_metadata(file.metadata, eos_token_ids)
    return Checkpoint(path, config, weights, tokenizer)


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer alone, from the file's metadata (its tensors are not read)."""
    meta = read_gguf_metadata(path)
    return Tokenizer.from_gguf_metadata(meta, gguf_eos_token_ids(meta))


def _gguf_config(
    meta: dict[str, Any], tensor_names: set[str], eos_token_ids: list[int]
) -> ModelConfig:
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
        eos_token_ids=eos_token_ids,
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
