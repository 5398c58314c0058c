"""The C kernels of ``cpu_ops.c``: built once with the system C compiler, called by ctypes.

The kernels exist for float32 and bfloat16 (``_f32``/``_bf16`` in C; the op functions pick
by the tensors' dtype, which must be one of the two and the same for all). The library is
compiled for the host CPU (``-march=native``) into the build folder the caller
passes to ``load`` (the engine passes its cache's), under a name that hashes the source, the
flags and the CPU, so a folder shared between different machines never serves a build for the
wrong one. No compiler, or a failed build, leaves ``load()`` returning None and the engine on
its torch path; nothing else depends on it. The op functions below call the library that
``load`` last returned.

ctypes drops the GIL for the call, and the kernels' OpenMP loops run on the libgomp that
torch already loaded, so they share torch's threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.c")
# included by _SOURCE: the typed kernels once per dtype, the quantized products once
_HEADERS = [
    Path(__file__).with_name(n) for n in ("cpu_ops_typed.h", "cpu_quant.h", "cpu_quant_isa.h")
]
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-trapping-math",  # lets the compiler vectorize the branch-free clamps
    "-mprefer-vector-width=256",  # gcc tunes some AMD CPUs to 128-bit vectors: measured slower
    # Jump threading splits fast_expf's clamps into paths with a constant exp, which the
    # vectorized loop then computes for every lane: silu_mul divided each gate by 1 + e^88,
    # a subnormal result costing a microcode assist per lane (10-40x slower, on Intel).
    "-fno-thread-jumps",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
]
MAX_GROUP = 16
MAX_HEAD_DIM = 256

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "paged_attention": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr] + [_i64] * 6 + [_f32, _i64],
    "add_rms_norm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "silu_mul": [_ptr, _ptr, _i64, _i64],
    "gelu_tanh_mul": [_ptr, _ptr, _i64, _i64],
    "rope": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
    "rms_norm_heads": [_ptr, _i64, _i64, _i64, _i64, _ptr, _f32],
    "argmax_rows": [_ptr, _i64, _i64, _i64, _ptr],
}
# The quantized products (cpu_quant.h), built only on x86 with AVX2: absent elsewhere.
_QUANT_SIGNATURES = {
    "quant_matmul_f32": (
        [ctypes.c_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, ctypes.c_int, ctypes.c_int],
        ctypes.c_int,
    ),
    "dequant_rows_f32": ([ctypes.c_int, _ptr, _i64, _ptr, _i64, _ptr], None),
    "dequantize_f32": ([ctypes.c_int, _ptr, _i64, _i64, _ptr, ctypes.c_int], None),
}
# The suffix of each dtype's kernels in the library.
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


_library: ctypes.CDLL | None = None  # what the op functions call


@functools.cache
def load(build_dir: Path) -> ctypes.CDLL | None:
    """The compiled library from ``build_dir``, building it there on first use; None where it
    cannot be built."""
    global _library
    if os.environ.get("TOKENQ_DISABLE_CPU_OPS"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU kernels disabled, using torch ops")
        return None
    key = hashlib.sha256(
        b"\0".join(
            [_SOURCE.read_bytes(), *(h.read_bytes() for h in _HEADERS)]
            + [" ".join(_FLAGS).encode(), _cpu_id().encode()]
        )
    ).hexdigest()[:16]
    target = Path(build_dir) / f"cpu_ops-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [compiler, *_FLAGS, str(_SOURCE), "-o", str(out), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("building CPU kernels failed, using torch ops:\n%s", result.stderr)
                return None
            os.replace(out, target)  # atomic: concurrent builders race harmlessly
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        for suffix in SUFFIXES.values():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = None
    for name, (argtypes, restype) in _QUANT_SIGNATURES.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = restype
    _library = lib
    return lib


def available(build_dir: Path) -> bool:
    return load(build_dir) is not None


def _ptr_of(t: torch.Tensor, name: str, dtype: torch.dtype) -> int:
    if t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name} must be a {dtype} CPU tensor, got {t.dtype} on {t.device}")
    return t.data_ptr()


def _contiguous(t: torch.Tensor, name: str, dtype: torch.dtype) -> int:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return _ptr_of(t, name, dtype)


def _kernel(name: str, dtype: torch.dtype) -> Callable[..., None]:
    """The loaded library's ``name`` for ``dtype``."""
    if _library is None:
        raise RuntimeError("the CPU kernels are not loaded: load(build_dir) first")
    if dtype not in SUFFIXES:
        raise ValueError(f"the CPU kernels take float32 or bfloat16 tensors, got {dtype}")
    return getattr(_library, f"{name}_{SUFFIXES[dtype]}")


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> torch.Tensor:
    """``paged_attention_torch``'s result (``window`` included), written into ``out``.

    ``q`` may be a row-strided view (the query heads of a fused QKV row) as long as each
    row's heads are contiguous.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError("q must have contiguous heads within each row")
    if num_heads // num_kv_heads > MAX_GROUP or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"at most {MAX_GROUP} query heads per KV head, head_dim <= {MAX_HEAD_DIM}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32")
    if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
        raise ValueError("block_tables must be contiguous int32")
    dt = q.dtype
    _kernel("paged_attention", dt)(
        _ptr_of(q, "q", dt),
        q.stride(0),
        _contiguous(out, "out", dt),
        _contiguous(k_cache, "k_cache", dt),
        _contiguous(v_cache, "v_cache", dt),
        cu_seqlens_q.data_ptr(),
        seq_lens.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        seq_lens.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        window,
    )
    return out


def add_rms_norm_cpu(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out = rms_norm(x + delta) * weight``, with ``x`` updated in place to ``x + delta``."""
    rows, dim = x.shape
    dt = x.dtype
    _kernel("add_rms_norm", dt)(
        _contiguous(x, "x", dt),
        None if delta is None else _contiguous(delta, "delta", dt),
        _contiguous(weight, "weight", dt),
        _contiguous(out, "out", dt),
        rows,
        dim,
        eps,
    )
    return out


def silu_mul_cpu(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = silu(gate) * up`` for rows ``[gate | up]`` of ``gate_up``."""
    rows, dim = out.shape
    if gate_up.shape != (rows, 2 * dim):
        raise ValueError(f"gate_up must be [{rows}, {2 * dim}], got {list(gate_up.shape)}")
    dt = gate_up.dtype
    _kernel("silu_mul", dt)(
        _contiguous(gate_up, "gate_up", dt), _contiguous(out, "out", dt), rows, dim
    )
    return out


def gelu_tanh_mul_cpu(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = gelu_tanh(gate) * up`` for rows ``[gate | up]`` of ``gate_up``."""
    rows, dim = out.shape
    if gate_up.shape != (rows, 2 * dim):
        raise ValueError(f"gate_up must be [{rows}, {2 * dim}], got {list(gate_up.shape)}")
    dt = gate_up.dtype
    _kernel("gelu_tanh_mul", dt)(
        _contiguous(gate_up, "gate_up", dt), _contiguous(out, "out", dt), rows, dim
    )
    return out


def rms_norm_heads_cpu(
    x: torch.Tensor, num_heads: int, head_dim: int, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMS-normalise the first ``num_heads`` heads of each row of ``x`` in place (rows may be
    strided, e.g. the key heads of a fused QKV row)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < num_heads * head_dim:
        raise ValueError("x must be [rows, >= num_heads * head_dim] with contiguous rows")
    if weight.shape != (head_dim,):
        raise ValueError(f"weight must be [{head_dim}], got {list(weight.shape)}")
    dt = x.dtype
    _kernel("rms_norm_heads", dt)(
        _ptr_of(x, "x", dt),
        x.stride(0),
        x.shape[0],
        num_heads,
        head_dim,
        _contiguous(weight, "weight", dt),
        eps,
    )
    return x


def rope_cpu(
    x: torch.Tensor,
    num_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Rotate the first ``num_heads`` heads of each row of ``x`` in place (rotate-half), on
    each head's first ``cos.shape[1]`` dimensions (the rotary dimension).

    Positions must lie inside the tables: the engine bounds them by ``max_model_len``.
    """
    if x.stride(1) != 1 or x.shape[1] < num_heads * head_dim:
        raise ValueError("x must be [rows, >= num_heads * head_dim] with contiguous rows")
    rotary_dim = cos.shape[1]
    if rotary_dim > head_dim or rotary_dim % 2 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [positions, even <= {head_dim}]")
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError("positions must be contiguous int64")
    dt = x.dtype
    _kernel("rope", dt)(
        _ptr_of(x, "x", dt),
        x.stride(0),
        positions.data_ptr(),
        _contiguous(cos, "cos", dt),
        _contiguous(sin, "sin", dt),
        x.shape[0],
        num_heads,
        head_dim,
        rotary_dim,
    )
    return x


def argmax_rows_cpu(x: torch.Tensor) -> torch.Tensor:
    """``argmax_rows_torch``'s indices (int64, one per row) for rows without NaN; NaN
    entries are skipped. Rows may be strided; each row's entries must be contiguous."""
    if x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
        raise ValueError("x must be [rows, cols >= 1] with contiguous rows")
    dt = x.dtype
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rows, cols = x.shape
    _kernel("argmax_rows", dt)(_ptr_of(x, "x", dt), x.stride(0), rows, cols, out.data_ptr())
    return out
