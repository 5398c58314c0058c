"""What the host CPU can do: read from ``/proc/cpuinfo``, and where that is not enough,
measured. Enough to choose a dtype.

bfloat16 can pay on the CPU only where the processor multiplies bf16 itself (AVX-512 BF16's
dot products, or AMX tiles); elsewhere oneDNN and the C kernels convert bf16 to fp32 in
software, which costs more than the halved memory traffic saves. Having the instructions is
not enough either: their rate differs by design. Zen 4 runs AVX-512 BF16 dot products at
twice its fp32 FMA rate, AMX far faster still, but an Intel Xeon measured here without AMX
runs ``vdpbf16ps`` at one per two cycles against two FMAs per cycle, so its bf16 products
are half as fast as fp32's. Where the flags allow bf16, oneDNN's two products are timed
against each other once per process, and ``dtype=auto`` picks bf16 only where it wins.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Flags meaning "this CPU computes bf16 products in hardware", in order of preference.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# How much faster bf16 products must run for ``auto`` to pick bf16. The CPUs measured sit at
# about 0.5x, 2x or far more, so a margin keeps timer noise from flipping the choice (and
# with it the tokens a model generates) between runs.
BF16_MIN_SPEEDUP = 1.25


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


_probe_lock = threading.Lock()


def bf16_speedup() -> float:
    """oneDNN's packed bf16 matrix product's rate over its packed fp32 one on one core of
    this CPU, best of eleven each (about 50 ms, once per process); 0.0 where oneDNN cannot
    pack bf16 here. One thread: with two, a core busy elsewhere stalls every product at
    the threads' barrier and the ratio measured here swung from 0.4 to 2.5 between runs;
    on one, a 128x512x1024 product read 0.54-0.56 in six runs on a loaded machine. Under a
    lock: the probe sets torch's thread count for its duration, and two engines starting
    in two threads must not each restore the other's setting."""
    with _probe_lock:
        return _bf16_speedup()


@functools.cache
def _bf16_speedup() -> float:
    m, k, n = 128, 512, 1024
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    best = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
            xd = x.to(dtype)
            times = []
            for _ in range(12):  # the first builds oneDNN's kernel and is dropped
                start = time.perf_counter()
                torch.ops.mkldnn._linear_pointwise(xd, packed, None, "none", [], "")
                times.append(time.perf_counter() - start)
            best[dtype] = min(times[1:])
    except (AttributeError, RuntimeError):  # no oneDNN in this torch, or no bf16 packing
        return 0.0
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / best[torch.bfloat16]
