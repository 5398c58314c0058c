"""Which weights run quantized, and why (``--quantization``, vLLM's flag name).

``none`` dequantizes everything to the compute dtype (the path the greedy parity tests
hold to fp32). ``int8`` runs a GGUF's Q8_0/Q4_0/Q4_1 matrices as they are on the CPU's int8
kernels and quantizes float matrices (a safetensors folder, an F16/F32 GGUF) to int8 per
output channel at load. Left unset, a GGUF is dequantized too: the int8 path's top-1
agreement with float32 (0.957 on the default model) is under the 0.98 it must reach to be
the default (docs/performance.md, Quantized weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokenq.engine.downloads import build_dir
from tokenq.engine.gguf_loader import GGUF_SUFFIX, quantized_types
from tokenq.kernels import cpu_ops, cpu_quant

CHOICES = ("none", "int8")


@dataclass(frozen=True)
class QuantizationChoice:
    keep_quantized: bool  # a GGUF's Q8_0/Q4_0/Q4_1 matrices stay as the file's blocks
    int8: bool  # float matrices become int8 per output channel
    reason: str  # for the worker's log line

    @property
    def name(self) -> str:
        return "int8" if self.int8 else "gguf blocks" if self.keep_quantized else "none"


def choose(requested: str | None, device: torch.device, path: Path) -> QuantizationChoice:
    """The path ``requested`` (None: the default) takes for the model at ``path``."""
    if requested not in (None, *CHOICES):
        raise ValueError(f"quantization must be one of {CHOICES}, got {requested!r}")
    if requested == "none":
        return QuantizationChoice(False, False, "--quantization none")
    why_not = _kernels_missing(device)
    if requested == "int8":
        if why_not:
            raise ValueError(f"--quantization int8 cannot run: {why_not}")
        isa = cpu_quant.isa()
        return QuantizationChoice(True, True, f"--quantization int8, {isa} kernels")
    if not (path.is_file() and path.suffix == GGUF_SUFFIX):
        return QuantizationChoice(False, False, "not a quantized GGUF")
    types = quantized_types(path)
    runnable = sorted(t for t in types if t in {n for n, _ in cpu_quant.QTYPES.values()})
    if not runnable:
        return QuantizationChoice(False, False, "no matrices of a type the int8 kernels run")
    if why_not:
        return QuantizationChoice(False, False, f"the file is {'/'.join(runnable)} but {why_not}")
    return QuantizationChoice(
        False,
        False,
        f"the file's {'/'.join(runnable)} matrices are dequantized unless --quantization int8",
    )


def _kernels_missing(device: torch.device) -> str:
    """Why the int8 kernels cannot run here; empty where they can."""
    if device.type != "cpu":
        return f"the int8 kernels run on the CPU, not {device}"
    cpu_ops.load(build_dir())
    if not cpu_quant.available():
        return "the CPU kernels are not built with AVX2 here"
    return ""
