"""What the host CPU can do, read from ``/proc/cpuinfo``: enough to choose a dtype.

bfloat16 pays on the CPU only where the processor multiplies bf16 itself (AVX-512 BF16's
dot products, or AMX tiles): oneDNN then runs bf16 matrix products at twice the fp32 rate
and the weights stream from memory at half the bytes. Elsewhere oneDNN and the C kernels
convert bf16 to fp32 in software, which costs more than the halved memory traffic saves,
so float32 stays the default there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# Flags meaning "this CPU computes bf16 products in hardware", in order of preference.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class Bf16Support:
    native: bool
    reason: str  # why, for the log line that announces the dtype chosen


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The ``flags`` of the first processor listed (x86; other architectures have none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        return parse_flags(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: no flags, so no bf16 claimed
        return frozenset()


def bf16_support(flags: frozenset[str] | None = None) -> Bf16Support:
    """Whether ``flags`` (default: this CPU's) include bf16 instructions, and why not."""
    flags = cpu_flags() if flags is None else flags
    for flag in BF16_FLAGS:
        if flag in flags:
            return Bf16Support(True, f"the CPU has {flag}")
    if not flags:
        return Bf16Support(False, "no CPU flags readable from /proc/cpuinfo")
    best = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "no AVX2"
    return Bf16Support(False, f"no bf16 instructions (neither {' nor '.join(BF16_FLAGS)}; {best})")
