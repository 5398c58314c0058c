"""Rotary position embeddings: the inverse frequencies of each supported scaling, and the
cos/sin tables the model reads by position.

Computed exactly as transformers computes them (same operations, same float32 order), so
rotations match the reference bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# rope_scaling types: a fixed rescaling of the inverse frequencies (linear, llama3), or
# Phi-3's longrope (one set of factors for sequences up to the pretrained length, another
# beyond it, and both tables scaled). Others (yarn, dynamic NTK) are refused rather than run
# as a different model.
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "longrope")

_REQUIRED = {
    "linear": ["factor"],
    "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
    "longrope": ["short_factor", "long_factor", "original_max_position_embeddings"],
}


def normalize_rope_scaling(
    scaling: dict[str, Any] | None, max_position_embeddings: int
) -> dict[str, Any] | None:
    """Accept HF's old (`type`) and new (`rope_type`) spellings, map "default" to None, and
    settle longrope's attention factor (transformers derives it from the context it was
    extended to when the config does not give it)."""
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    rope_type = out.pop("type", None)
    rope_type = out.get("rope_type", rope_type)
    if rope_type in (None, "default"):
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} (supported: {SUPPORTED_ROPE_TYPES})"
        )
    out["rope_type"] = rope_type
    missing = [k for k in _REQUIRED[rope_type] if k not in out]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} is missing {missing}")
    if rope_type == "longrope" and out.get("attention_factor") is None:
        original = out["original_max_position_embeddings"]
        factor = out.get("factor") or max_position_embeddings / original
        out["attention_factor"] = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return out


def inv_freq(
    theta: float, dim: int, scaling: dict[str, Any] | None, long: bool = False
) -> torch.Tensor:
    """Inverse frequencies ``[dim // 2]`` (float32) of a rotary dimension ``dim``; for
    longrope, the set for sequences beyond the pretrained length when ``long``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    base = 1.0 / (theta**exponents)
    if scaling is None:
        return base
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return base / factor
    return _llama3_inv_freq(base, scaling, factor)


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


def rope_tables(
    theta: float,
    dim: int,
    scaling: dict[str, Any] | None,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[rows, dim]`` by position, each half repeated (rotate-half). Longrope
    has ``2 * max_positions`` rows: the short factors' table, then the long factors' one
    (the model adds ``max_positions`` to the positions of a sequence past the pretrained
    length)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    sets = [inv_freq(theta, dim, scaling)]
    scale = 1.0
    if scaling is not None and scaling["rope_type"] == "longrope":
        sets.append(inv_freq(theta, dim, scaling, long=True))
        scale = float(scaling["attention_factor"])
    cos, sin = [], []
    for freqs in sets:
        # float32 products, as transformers computes them, so rotations match it exactly.
        angles = torch.outer(positions, freqs)
        emb = torch.cat([angles, angles], dim=-1)
        cos.append(emb.cos() * scale)
        sin.append(emb.sin() * scale)
    return (
        torch.cat(cos).to(device=device, dtype=dtype),
        torch.cat(sin).to(device=device, dtype=dtype),
    )
