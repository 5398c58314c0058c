"""Model configuration: the handful of numbers a Llama-family forward pass needs.

Llama, Mistral and Qwen2 checkpoints differ only in details (qkv bias, head_dim, rope scaling,
the way transformers spells the rope settings), so one dataclass covers them and the model code
never looks at a raw `config.json`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenq.engine.downloads import DEFAULT_MODEL
from tokenq.kernels.cpu_features import BF16_MIN_SPEEDUP, bf16_speedup, bf16_support

# model_type values whose weights follow LlamaForCausalLM's layout.
_LLAMA_LIKE = ("llama", "mistral")
_QWEN2 = "qwen2"

# rope_scaling types whose effect is a fixed rescaling of the inverse frequencies. Others (yarn,
# dynamic NTK, longrope) change attention magnitudes or depend on the sequence length; refusing
# them is better than silently producing a different model.
SUPPORTED_ROPE_TYPES = ("linear", "llama3")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or a dict with "rope_type" in SUPPORTED_ROPE_TYPES plus that type's parameters
    # (HF spelling: factor; llama3 also low_freq_factor, high_freq_factor,
    # original_max_position_embeddings).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Bias on q/k/v projections only (Qwen2); o_proj never has one.
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling)
        self.eos_token_ids = list(self.eos_token_ids)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the `config.json` of a Llama/Mistral/Qwen2 causal LM.

        Reads both the classic spelling (`rope_theta` + `rope_scaling`) and transformers 5's
        `rope_parameters`, since checkpoints in the wild use either.
        """
        model_type = cfg.get("model_type", "llama")
        if model_type not in (*_LLAMA_LIKE, _QWEN2):
            raise ValueError(
                f"unsupported model_type {model_type!r} (tokenq runs Llama, Mistral, Qwen2)"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=true")
        if model_type == _QWEN2:
            # Qwen2 always has q/k/v bias; its config has no flag for it.
            attention_bias = True
            if cfg.get("use_sliding_window"):
                raise ValueError("unsupported: Qwen2 with use_sliding_window=true")
        else:
            if cfg.get("attention_bias"):
                # In HF's Llama this flag also puts a bias on o_proj, which tokenq does not carry.
                raise ValueError(
                    "unsupported: attention_bias=true on a Llama/Mistral model (o_proj bias)"
                )
            attention_bias = False

        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(cfg)
        max_pos = cfg.get("max_position_embeddings", 2048)
        window = cfg.get("sliding_window") if model_type == "mistral" else None
        if window is not None and window < max_pos:
            # With full attention and sequences no longer than the window, sliding-window
            # attention computes exactly the same thing, so cap the context instead of
            # implementing the window.
            max_pos = window
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=attention_bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A `config.json` dict transformers can build the same model from (Qwen2 when biased)."""
        model_type, arch = (
            ("qwen2", "Qwen2ForCausalLM") if self.attention_bias else ("llama", "LlamaForCausalLM")
        )
        eos: int | list[int] | None = self.eos_token_ids or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        cfg: dict[str, Any] = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
        if model_type == "llama":
            cfg["attention_bias"] = False
            cfg["mlp_bias"] = False
        else:
            cfg["use_sliding_window"] = False
        return cfg

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse rotary frequencies `[head_dim // 2]` (float32), rope scaling applied.

        Computed exactly as transformers does, so rotary embeddings match the reference
        bit for bit.
        """
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        scaling = self.rope_scaling
        if scaling is None:
            return inv_freq
        factor = float(scaling["factor"])
        if scaling["rope_type"] == "linear":
            return inv_freq / factor
        return _llama3_inv_freq(inv_freq, scaling, factor)


def _llama3_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], factor: float
) -> torch.Tensor:
    """Llama 3.1's schedule: long wavelengths slowed by `factor`, short ones kept, the rest
    interpolated smoothly between the two."""
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _read_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return float(theta), scaling
    return float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")


def _normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Accept HF's old (`type`) and new (`rope_type`) spellings; map "default" to None."""
    if not scaling:
        return None
    out = dict(scaling)
    rope_type = out.pop("type", None)
    rope_type = out.get("rope_type", rope_type)
    if rope_type in (None, "default"):
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} (supported: {SUPPORTED_ROPE_TYPES})"
        )
    out["rope_type"] = rope_type
    required = ["factor"]
    if rope_type == "llama3":
        required += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    missing = [k for k in required if k not in out]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} is missing {missing}")
    return out


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


# EngineConfig lives below


@dataclass
class EngineConfig:
    """How a worker's engine is built and how much it batches.

    ``max_num_batched_tokens`` is the per-step token budget shared by decodes and prefill
    chunks; ``max_num_seqs`` caps the requests in flight. The KV pool is sized by
    ``num_kv_blocks`` when given, else from ``kv_cache_memory`` bytes, else (CUDA) from a
    fraction of free device memory or (CPU) 2 GiB.
    """

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    num_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        return self.dtype_choice(device)[0]

    def dtype_choice(self, device: torch.device) -> tuple[torch.dtype, str]:
        """The dtype the engine computes in, and why (for the log). ``auto``: bfloat16 on
        CUDA, and on a CPU whose bf16 instructions (AVX-512 BF16 or AMX) multiply faster
        than its fp32 ones; float32 on other CPUs, where bf16 is emulated, or slower."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype], "dtype given"
        if device.type == "cuda":
            return torch.bfloat16, "auto on CUDA"
        support = bf16_support()
        if not support.native:
            return torch.float32, f"auto: {support.reason}"
        speedup = bf16_speedup()
        rate = f"its bf16 matrix products ran at {speedup:.2f}x fp32's here"
        if speedup >= BF16_MIN_SPEEDUP:
            return torch.bfloat16, f"auto: {support.reason} and {rate}"
        return torch.float32, f"auto: {support.reason}, but {rate}"

    def kv_cache_bytes(self, device: torch.device) -> int:
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            return int(free * self.gpu_memory_utilization)
        return 2 << 30


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
