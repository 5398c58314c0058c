"""Which weights run quantized, and why (``--quantization``, vLLM's flag name).

``none`` dequantizes everything to the compute dtype (the path the greedy parity tests
hold to fp32). Left unset, a quantized GGUF on the CPU runs its matrices of a type the
kernels know (kernels/cpu_quant.py: QTYPES) as the file's blocks: with activations in int16
per block of 32 its next-token distributions match the same file dequantized to float32
(top-1 1.000 on the default model, docs/performance.md). ``int8`` does the same and also
quantizes float matrices (a safetensors folder, an F16/F32 GGUF, a type without a kernel)
to int8 per output channel at load.
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
    keep_quantized: bool  # a GGUF's matrices of a kernel's type stay as the file's blocks
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
    if requested == "int8":
        if why_not := _kernels_missing(device):
            raise ValueError(f"--quantization int8 cannot run: {why_not}")
        isa = cpu_quant.isa()
        return QuantizationChoice(True, True, f"--quantization int8, {isa} kernels")
    return _default(device, path)


def _default(device: torch.device, path: Path) -> QuantizationChoice:
    """A quantized GGUF runs quantized where the kernels can run it; all else is float."""
    if not (path.is_file() and path.suffix == GGUF_SUFFIX):
        return QuantizationChoice(False, False, "not a quantized GGUF")
    types = quantized_types(path)
    runnable = sorted(t for t in types if t in {f.name for f in cpu_quant.QTYPES.values()})
    if not runnable:
        return QuantizationChoice(False, False, "no matrices of a type the quantized kernels run")
    if why_not := _kernels_missing(device):
        return QuantizationChoice(False, False, f"the file is {'/'.join(runnable)} but {why_not}")
    return QuantizationChoice(
        True,
        False,
        f"the file's {'/'.join(runnable)} matrices on the {cpu_quant.isa()} kernels, "
        "as a quantized GGUF runs by default; --quantization none dequantizes",
    )


def _kernels_missing(device: torch.device) -> str:
    """Why the quantized kernels cannot run here; empty where they can."""
    if device.type != "cpu":
        return f"the quantized kernels run on the CPU, not {device}"
    cpu_ops.load(build_dir())
    if not cpu_quant.available():
        return "the CPU kernels are not built with AVX2 here"
    return ""
