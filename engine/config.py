"""Model configuration: the numbers a forward pass needs, for every supported family.

Llama, Mistral, Qwen2/3, Gemma 3, Phi-3 and the mixtures of experts (Qwen3-MoE, Mixtral)
differ in details (qkv bias, q/k norms, Gemma's norms and scaled embeddings, partial rotary,
sliding-window layers, routed experts, the way transformers spells each setting), so one
dataclass covers them all and the model code never looks at a raw `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tokenq.engine.downloads import DEFAULT_MODEL
from tokenq.engine.rope import inv_freq, normalize_rope_scaling
from tokenq.kernels.cpu_features import BF16_MIN_SPEEDUP, bf16_speedup, bf16_support


@dataclass(frozen=True)
class Family:
    """What a `model_type` is made of, beyond the Llama layer every family shares."""

    architecture: str  # the transformers class of its checkpoints
    gemma: bool = False  # RMSNorm (1 + w), norms around attention and MLP, scaled embeddings
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj in the checkpoint
    moe: bool = False  # routed experts in place of the MLP
    qk_norm: bool = False  # RMSNorm of each query and key head before rotary
    # every layer slides when the config gives a window (else the config's layer types say)
    all_sliding: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM", all_sliding=True),
    "qwen2": Family("Qwen2ForCausalLM"),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "gemma3_text": Family("Gemma3ForCausalLM", gemma=True, qk_norm=True),
    "phi3": Family("Phi3ForCausalLM", fused=True, all_sliding=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", moe=True, qk_norm=True, all_sliding=True),
    "mixtral": Family("MixtralForCausalLM", moe=True, all_sliding=True),
}
SUPPORTED = ", ".join(FAMILIES)
FULL, SLIDING = "full_attention", "sliding_attention"
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    # None, or a dict with "rope_type" in rope.SUPPORTED_ROPE_TYPES plus that type's
    # parameters (HF spelling), normalised by rope.normalize_rope_scaling.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Bias on q/k/v projections only (Qwen2); o_proj never has one.
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = "llama"  # a FAMILIES key
    hidden_act: str = "silu"  # or gelu_pytorch_tanh (Gemma)
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions that rotates
    # the attention scale is its inverse square root (Gemma 3); None: head_dim's
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None  # keys a sliding layer sees, its own included
    layer_types: list[str] = field(default_factory=list)  # FULL or SLIDING; empty: all FULL
    local_rope_theta: float | None = None  # sliding layers' own rotary base (Gemma 3)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to one
    mlp_only_layers: list[int] = field(default_factory=list)  # dense layers of an MoE model
    decoder_sparse_step: int = 1  # every n-th layer is an MoE layer (Qwen3-MoE)

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
        if self.model_type not in FAMILIES:
            raise ValueError(unsupported_message(self.model_type))
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} ({_ACTIVATIONS})")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} is out of range")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        self.eos_token_ids = list(self.eos_token_ids)
        self.layer_types = list(self.layer_types)
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        unknown = set(self.layer_types) - {FULL, SLIDING}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)} ({FULL}, {SLIDING})")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("sliding layers need a positive sliding_window")
        if self.family.moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"{self.num_experts_per_tok} experts per token of {self.num_experts} experts"
            )

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int:
        """The keys layer ``layer`` attends to, its own included; 0: all of them."""
        sliding = self.layer_types and self.layer_types[layer] == SLIDING
        return self.sliding_window if sliding else 0

    @property
    def kv_window(self) -> int | None:
        """The widest window when every layer slides: blocks before it are never read
        again. None when some layer attends to everything."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if 0 in windows else max(windows)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.family.moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the `config.json` of a causal LM of a supported family.

        Reads both the classic spelling (`rope_theta` + `rope_scaling`) and transformers 5's
        `rope_parameters`, since checkpoints in the wild use either.
        """
        model_type = cfg.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise ValueError(unsupported_message(model_type))
        family = FAMILIES[model_type]
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=true")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                raise ValueError(f"unsupported: {key}={cfg[key]}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("unsupported: use_bidirectional_attention=true (an encoder)")
        if model_type == "qwen2":
            # Qwen2 always has q/k/v bias; its config has no flag for it.
            attention_bias = True
        elif cfg.get("attention_bias"):
            # In HF's Llama family this flag also puts a bias on o_proj, which tokenq does
            # not carry.
            raise ValueError(
                f"unsupported: attention_bias=true on a {model_type} model (o_proj bias)"
            )
        else:
            attention_bias = False

        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        max_pos = cfg.get("max_position_embeddings", 2048)
        rope = _read_rope(cfg, model_type)
        window, layer_types = _read_sliding(cfg, family, model_type, num_layers)
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) if family.moe else 0
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=cfg.get("tie_word_embeddings", family.gemma),
            attention_bias=attention_bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
            model_type=model_type,
            hidden_act=(
                cfg.get("hidden_activation")
                or cfg.get("hidden_act")
                or ("gelu_pytorch_tanh" if family.gemma else "silu")
            ),
            partial_rotary_factor=rope.partial_rotary_factor,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256) if family.gemma else None,
            sliding_window=window,
            layer_types=layer_types,
            local_rope_theta=rope.local_theta,
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if family.moe else 0,
            moe_intermediate_size=(
                cfg.get("moe_intermediate_size", cfg["intermediate_size"]) if family.moe else 0
            ),
            # Mixtral always renormalises; Qwen3-MoE says whether it does.
            norm_topk_prob=(
                model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False))
                if family.moe
                else True
            ),
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A `config.json` dict transformers builds the same model from."""
        family = self.family
        eos: int | list[int] | None = self.eos_token_ids or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        cfg: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "sliding_window": self.sliding_window,
        }
        if self.model_type in ("llama", "mistral"):
            cfg["attention_bias"] = False
            cfg["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3", "gemma3_text"):
            cfg["layer_types"] = self.layer_types or [FULL] * self.num_layers
            cfg["use_sliding_window"] = SLIDING in self.layer_types
        if self.model_type == "qwen3_moe":
            cfg["use_sliding_window"] = self.sliding_window is not None
        if family.gemma:
            cfg["hidden_activation"] = self.hidden_act
            cfg["query_pre_attn_scalar"] = self.query_pre_attn_scalar
            cfg["rope_local_base_freq"] = self.local_rope_theta or self.rope_theta
        if family.fused:
            cfg["partial_rotary_factor"] = self.partial_rotary_factor
            cfg["pad_token_id"] = None
            if self.rope_scaling and self.rope_scaling["rope_type"] == "longrope":
                original = self.rope_scaling["original_max_position_embeddings"]
                cfg["original_max_position_embeddings"] = original
        if family.moe:
            experts_key = "num_local_experts" if self.model_type == "mixtral" else "num_experts"
            cfg[experts_key] = self.num_experts
            cfg["num_experts_per_tok"] = self.num_experts_per_tok
            cfg["norm_topk_prob"] = self.norm_topk_prob
            if self.model_type == "qwen3_moe":
                cfg["moe_intermediate_size"] = self.moe_intermediate_size
                cfg["mlp_only_layers"] = list(self.mlp_only_layers)
                cfg["decoder_sparse_step"] = self.decoder_sparse_step
        return cfg

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse rotary frequencies ``[rotary_dim // 2]`` (float32) of the full-attention
        layers, rope scaling applied (for longrope: its short factors)."""
        return inv_freq(self.rope_theta, self.rotary_dim, self.rope_scaling)


def unsupported_message(model_type: object) -> str:
    return f"unsupported model_type {model_type!r} (tokenq runs {SUPPORTED})"


@dataclass
class _Rope:
    theta: float
    scaling: dict[str, Any] | None
    partial_rotary_factor: float
    local_theta: float | None


def _read_rope(cfg: dict[str, Any], model_type: str) -> _Rope:
    """The rotary settings in either spelling: classic top-level keys, or transformers 5's
    `rope_parameters` (one dict, or one per layer type for Gemma 3)."""
    params = cfg.get("rope_parameters")
    local_theta = cfg.get("rope_local_base_freq") if model_type == "gemma3_text" else None
    if isinstance(params, dict) and FULL in params:
        local = params.get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError("unsupported: rope scaling on sliding-window layers")
        local_theta = local.get("rope_theta", local_theta)
        params = params[FULL]
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
        partial = cfg.get("partial_rotary_factor", 1.0)
    if model_type == "gemma3_text" and "rope_theta" not in cfg and params is None:
        theta = 1_000_000.0  # Gemma 3's global default
    if scaling and model_type == "phi3":
        scaling = dict(scaling)
        if scaling.get("type", scaling.get("rope_type")) in ("su", "yarn"):  # its old names
            scaling["rope_type"] = "longrope"
        scaling.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")),
        )
    if model_type == "gemma3_text" and local_theta is None:
        local_theta = 10_000.0
    return _Rope(float(theta), scaling, float(partial), local_theta)


def _read_sliding(
    cfg: dict[str, Any], family: Family, model_type: str, num_layers: int
) -> tuple[int | None, list[str]]:
    """The sliding window and which layers use it, however the family says so."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None
    if window is None:
        return None, []
    if cfg.get("layer_types"):
        return window, list(cfg["layer_types"])
    if family.gemma:  # configs older than layer_types: every sixth layer is global
        pattern = cfg.get("sliding_window_pattern", 6)
        return window, [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if family.all_sliding:
        return window, [SLIDING] * num_layers
    # Qwen2/Qwen3: the layers from max_window_layers on slide
    first = cfg.get("max_window_layers", num_layers)
    return window, [SLIDING if i >= first else FULL for i in range(num_layers)]


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
    # Structured outputs: compiled grammars kept (LRU), and how long a job's grammar may
    # compile before the job ends with invalid_params.
    grammar_cache_size: int = 256
    grammar_compile_timeout: float = 10.0
    # None and "none": all dequantized to the compute dtype; "gguf": a quantized GGUF's blocks
    # on the CPU's quantized kernels; "int8": those, and float weights to int8 per block of 32
    quantization: str | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "grammar_cache_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}")
        if self.quantization not in (None, "none", "gguf", "int8"):
            raise ValueError(f"quantization must be none, gguf or int8, got {self.quantization!r}")

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
