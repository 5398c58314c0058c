"""Which weights run quantized, and why (``--quantization``, vLLM's flag name).

``none`` dequantizes everything to the compute dtype (the path the greedy parity tests
hold to fp32). ``gguf`` runs a quantized GGUF's matrices of a type the kernels know
(kernels/cpu_quant.py: QTYPES) as the file's blocks, on the CPU: its next-token
distributions match the same file dequantized to float32 (top-1 0.9998 on the default model,
docs/performance.md). ``int8`` does the same and also quantizes float matrices (a
safetensors folder, an F16/F32 GGUF, a type without a kernel) to int8 per block of 32 at load
(Q8_0). Left unset, everything is dequantized: the quantized products hold a quarter to a
sixth of float32's memory but through the engine run no faster than float32, and behind
bfloat16 where the CPU has fast bf16 (docs/performance.md, Quantized weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokenq.engine.downloads import build_dir
from tokenq.engine.gguf_loader import GGUF_SUFFIX, quantized_types
from tokenq.kernels import cpu_ops, cpu_quant

CHOICES = ("none", "gguf", "int8")


@dataclass(frozen=True)
class QuantizationChoice:
    keep_quantized: bool  # a GGUF's matrices of a kernel's type stay as the file's blocks
    int8: bool  # float matrices become int8 per block of 32
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
    if requested in ("gguf", "int8"):
        if why_not := _kernels_missing(device):
            raise ValueError(f"--quantization {requested} cannot run: {why_not}")
        isa = cpu_quant.isa()
        if requested == "int8":
            return QuantizationChoice(True, True, f"--quantization int8, {isa} kernels")
        if not (runnable := _runnable(path)):
            raise ValueError(
                "--quantization gguf runs a quantized GGUF file's blocks: "
                f"{path.name} holds no matrices of a type the quantized kernels run"
            )
        return QuantizationChoice(
            True, False, f"--quantization gguf, the file's {'/'.join(runnable)} on {isa} kernels"
        )
    if not (path.is_file() and path.suffix == GGUF_SUFFIX):
        return QuantizationChoice(False, False, "not a quantized GGUF")
    if not (runnable := _runnable(path)):
        return QuantizationChoice(False, False, "no matrices of a type the quantized kernels run")
    return QuantizationChoice(
        False,
        False,
        f"the file's {'/'.join(runnable)} matrices are dequantized: the quantized products "
        "measured no faster than float32; --quantization gguf runs them on the CPU",
    )


def _runnable(path: Path) -> list[str]:
    """The quantized types of a GGUF at ``path`` that the kernels run (none: not a GGUF)."""
    if not (path.is_file() and path.suffix == GGUF_SUFFIX):
        return []
    kernels = {f.name for f in cpu_quant.QTYPES.values()}
    return sorted(t for t in quantized_types(path) if t in kernels)


def _kernels_missing(device: torch.device) -> str:
    """Why the quantized kernels cannot run here; empty where they can."""
    if device.type != "cpu":
        return f"the quantized kernels run on the CPU, not {device}"
    cpu_ops.load(build_dir())
    if not cpu_quant.available():
        return "the CPU kernels are not built with AVX2 here"
    return ""
