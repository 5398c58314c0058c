"""A GGUF file (llama.cpp's format): config, weights, tokenizer and end-of-generation ids, all
from one parse of the file.

Tensors are dequantized on load (K-quants included) to the engine's ``dtype``, except, with
``keep_quantized``, the matrices of the linear layers and the embedding in a format the
quantized kernels run (kernels/cpu_quant.py: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K), which stay as the file's blocks.
Names and layouts become Hugging Face's: llama.cpp's converter permutes Llama's Q/K rows for
its interleaved rope and stores Gemma's norm weights plus one; loading undoes both, and
stacks each layer's experts as a folder's are stacked.
"""

from __future__ import annotations

import logging
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
from tokenq.engine.config import FULL, SLIDING, ModelConfig
from tokenq.engine.tokenizer import Tokenizer
from tokenq.kernels.cpu_quant import QTYPES, QuantizedWeight

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# The tensors that may stay quantized: the matrices of linear layers, and the embedding.
_KEEPABLE_RE = re.compile(r".*_proj\.weight|lm_head\.weight|model\.embed_tokens\.weight")


@dataclass(frozen=True)
class _Arch:
    model_type: str  # the family (config.FAMILIES)
    # llama.cpp's converter permuted Q/K rows for its interleaved ("normal") rope; the others
    # use NeoX-style rope in llama.cpp, which is HF's layout
    permuted: bool = False


# GGUF architectures we load. Mixtral is llama.cpp's "llama" with experts.
_GGUF_ARCHS: dict[str, _Arch] = {
    "llama": _Arch("llama", permuted=True),
    "qwen2": _Arch("qwen2"),
    "qwen3": _Arch("qwen3"),
    "qwen3moe": _Arch("qwen3_moe"),
    "gemma3": _Arch("gemma3_text"),
    "phi3": _Arch("phi3"),
}

_GGUF_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Where an architecture names a tensor otherwise: Gemma 3's ffn_norm is its norm before the
# MLP (its post_attention_norm normalises the attention's output); Phi-3's ffn_up holds gate
# and up rows, as its gate_up_proj does.
_GGUF_PER_LAYER_BY_ARCH = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# The experts of a layer, stacked (ffn_gate_exps) or one by one (older Mixtral files).
_GGUF_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_GGUF_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Phi-3's longrope factors travel as tensors; they belong in the config.
_GGUF_ROPE_FACTORS = {
    "rope_factors_short.weight": "short_factor",
    "rope_factors_long.weight": "long_factor",
}


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


def quantized_types(path: Path) -> dict[str, int]:
    """The GGML types (by name) of a file's matrices and how many of each are quantized: what
    decides whether it runs quantized."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in read_gguf(path).tensors:
        qtype = gguf.GGMLQuantizationType(tensor.qtype)
        if len(tensor.shape) >= 2 and qtype.name not in ("F32", "F16", "BF16", "F64"):
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
    return counts


def load_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool = False) -> Checkpoint:
    """The file's config, weights and tokenizer: weights dequantized to ``dtype``, but with
    ``keep_quantized`` the linear layers' and the embedding's blocks of a kernel's type kept."""
    import gguf

    file = read_gguf(path)
    meta = file.metadata
    arch_name = meta.get("general.architecture")
    if arch_name not in _GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch_name!r} (supported: {sorted(_GGUF_ARCHS)})"
        )
    arch = _GGUF_ARCHS[arch_name]

    def array_of(tensor: GGUFTensor) -> np.ndarray:
        return gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.qtype))

    rope_factors = {
        _GGUF_ROPE_FACTORS[t.name]: array_of(t).astype(np.float64).tolist()
        for t in file.tensors
        if t.name in _GGUF_ROPE_FACTORS
    }
    eos_token_ids = gguf_eos_token_ids(meta)
    config = _gguf_config(meta, {t.name for t in file.tensors}, eos_token_ids, rope_factors)

    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    dequantized: dict[str, int] = {}  # quantized matrices of a type no kernel runs, by type
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for tensor in file.tensors:
        if tensor.name in _GGUF_ROPE_FACTORS:
            continue
        qname = gguf.GGMLQuantizationType(tensor.qtype).name
        if keep_quantized and len(tensor.shape) == 2 and not qname.startswith(("F", "BF")):
            name = _hf_name(tensor.name, arch_name)
            if tensor.qtype in QTYPES and _KEEPABLE_RE.fullmatch(name):
                weights[name] = _kept(tensor, name, arch, config.num_heads, config.num_kv_heads)
                continue
            dequantized[qname] = dequantized.get(qname, 0) + 1
        array = array_of(tensor)
        if match := _GGUF_EXPERTS_RE.fullmatch(tensor.name):
            layer, part = match.groups()
            experts[(int(layer), part)] = dict(enumerate(array))
            continue
        if match := _GGUF_EXPERT_RE.fullmatch(tensor.name):
            layer, part, expert = match.groups()
            experts.setdefault((int(layer), part), {})[int(expert)] = array
            continue
        name = _hf_name(tensor.name, arch_name)
        if arch.permuted and ".self_attn.q_proj." in name:
            array = _unpermute_rope_rows(array, config.num_heads)
        elif arch.permuted and ".self_attn.k_proj." in name:
            array = _unpermute_rope_rows(array, config.num_kv_heads)
        if arch_name == "gemma3" and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norm weights plus one (its RMSNorm is
            # Llama's); HF's weights are what the model adds one to
            array = array - 1
        if not array.flags.writeable:
            # Unquantized tensors come back as views of the read-only file mapping.
            array = array.copy()
        weights[name] = torch.from_numpy(array).to(dtype)
    weights |= _stacked_experts(experts, dtype)
    if dequantized:
        log.info(
            "%s: matrices dequantized to %s, no quantized kernel for their type: %s",
            path.name,
            str(dtype).removeprefix("torch."),
            ", ".join(f"{n} {t}" for t, n in sorted(dequantized.items())),
        )
    tokenizer = Tokenizer.from_gguf_metadata(meta, eos_token_ids)
    return Checkpoint(path, config, weights, tokenizer)


def _kept(
    tensor: GGUFTensor, name: str, arch: _Arch, num_heads: int, num_kv_heads: int
) -> QuantizedWeight:
    """A matrix as the file's blocks, copied out of the mapping; Llama's Q/K rows put back in
    HF's order (rows are independent blocks, so the permutation moves bytes only)."""
    data = tensor.data
    if arch.permuted and ".self_attn.q_proj." in name:
        data = _unpermute_rope_rows(data, num_heads)
    elif arch.permuted and ".self_attn.k_proj." in name:
        data = _unpermute_rope_rows(data, num_kv_heads)
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(data).copy()), tensor.qtype, tensor.shape[1]
    )


def _stacked_experts(
    experts: dict[tuple[int, str], dict[int, np.ndarray]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Each layer's experts as ``mlp.experts.gate_up_proj`` (gate rows, then up rows) and
    ``mlp.experts.down_proj`` (``checkpoint.expected_weight_shapes``)."""

    def stacked(layer: int, part: str) -> torch.Tensor:
        by_expert = experts.get((layer, part), {})
        if not by_expert or sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"GGUF layer {layer}: ffn_{part} experts {sorted(by_expert)}")
        return torch.from_numpy(np.stack([by_expert[e] for e in range(len(by_expert))])).to(dtype)

    out = {}
    for layer in sorted({layer for layer, _ in experts}):
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.cat([stacked(layer, "gate"), stacked(layer, "up")], dim=1)
        out[p + "down_proj"] = stacked(layer, "down")
    return out


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer alone, from the file's metadata (its tensors are not read)."""
    meta = read_gguf_metadata(path)
    return Tokenizer.from_gguf_metadata(meta, gguf_eos_token_ids(meta))


def _gguf_config(
    meta: dict[str, Any],
    tensor_names: set[str],
    eos_token_ids: list[int],
    rope_factors: dict[str, list[float]],
) -> ModelConfig:
    """The file's metadata in config.json's spelling, read as a folder's config is (so
    each family's defaults are applied once), with the choices llama.cpp makes where the
    metadata is silent."""
    arch = meta["general.architecture"]
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "this GGUF carries per-dimension rope frequency factors (rope_freqs, Llama 3.1-style "
            "scaling), which tokenq only reads from a safetensors folder's config.json"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = get("embedding_length")
    num_heads = get("attention.head_count")
    head_dim = get("attention.key_length", hidden // num_heads)
    num_layers = get("block_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    model_type = _GGUF_ARCHS[arch].model_type
    if arch == "llama" and get("expert_count"):
        model_type = "mixtral"
    elif arch == "llama" and "blk.0.attn_q.bias" in tensor_names:
        model_type = "qwen2"  # a Llama with q/k/v biases is what tokenq runs as Qwen2
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": len(tokens) if tokens else get("vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _gguf_rope_scaling(get, rope_factors),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_token_ids,
        "partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim,
    }
    window = get("attention.sliding_window")
    if window:
        cfg["sliding_window"] = window
        cfg["use_sliding_window"] = True
    if get("expert_count"):
        cfg["num_experts"] = get("expert_count")
        cfg["num_experts_per_tok"] = get("expert_used_count")
        cfg["moe_intermediate_size"] = get("expert_feed_forward_length", cfg["intermediate_size"])
        cfg["norm_topk_prob"] = True  # llama.cpp renormalises Qwen3-MoE's top-k
        if cfg["intermediate_size"] is None:
            cfg["intermediate_size"] = cfg["moe_intermediate_size"]
    if arch == "gemma3":
        # llama.cpp's choices: every sixth layer global, the local ones on base 10000, queries
        # scaled by head_dim (by hidden / heads for the 62-layer 27B)
        pattern = get("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # one flag per layer, true where it slides
            cfg["layer_types"] = [SLIDING if p else FULL for p in pattern]
        else:
            cfg["sliding_window_pattern"] = pattern
        cfg["rope_local_base_freq"] = 10000.0
        cfg["query_pre_attn_scalar"] = hidden // num_heads if num_layers == 62 else head_dim
    return ModelConfig.from_hf_config(cfg)


def _gguf_rope_scaling(get: Any, rope_factors: dict[str, list[float]]) -> dict[str, Any] | None:
    if rope_factors:  # Phi-3's longrope
        return {
            "rope_type": "longrope",
            **rope_factors,
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "attention_factor": get("rope.scaling.attn_factor"),
        }
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r} (only linear)")
    return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}


def _hf_name(gguf_name: str, arch: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GGUF_TOP_LEVEL and suffix == "weight":
        return f"{_GGUF_TOP_LEVEL[base]}.weight"
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    names = _GGUF_PER_LAYER | _GGUF_PER_LAYER_BY_ARCH.get(arch, {})
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a {arch} model")


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
