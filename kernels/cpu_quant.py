"""Quantized weights and the C kernels that multiply by them (``cpu_quant.h``).

A ``QuantizedWeight`` holds GGUF blocks as the file stores them: per row, blocks of 32
values (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: a float16 scale, a float16 minimum for the ``_1``
types, 8-, 5- or 4-bit values) or super-blocks of 256 (Q4_K, Q5_K, Q6_K: sub-block scales
and minima under float16 ones). ``quant_matmul`` picks its product by the activation rows
(``path_for``): for a few, the activations quantized to int16 per block of 32 against the
weights' integers, with AVX-512 VNNI's ``vpdpwssd`` where the CPU has it, AVX2's
``vpmaddwd`` otherwise (or where ``TOKENQ_QUANT_ISA=avx2`` forces it, as the tests do); for
more, the weights decoded to float32 tile by tile, or whole for torch's product. The kernels
live in the library that ``cpu_ops.load`` builds; call that first.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from tokenq.kernels import cpu_features, cpu_ops

BLOCK = 32


@dataclass(frozen=True)
class QType:
    """A GGUF block format the kernels run: ``values`` per block of ``bytes``."""

    name: str
    values: int
    bytes: int


# gguf.GGMLQuantizationType value -> its format
QTYPES = {
    2: QType("Q4_0", 32, 18),
    3: QType("Q4_1", 32, 20),
    6: QType("Q5_0", 32, 22),
    7: QType("Q5_1", 32, 24),
    8: QType("Q8_0", 32, 34),
    12: QType("Q4_K", 256, 144),
    13: QType("Q5_K", 256, 176),
    14: QType("Q6_K", 256, 210),
}
Q8_0 = 8
ISA_ENV = "TOKENQ_QUANT_ISA"  # "avx2" forces the AVX2 path on a VNNI CPU
VNNI_FLAGS = ("avx512_vnni", "avx512vl", "avx512bw")


@dataclass
class QuantizedWeight:
    """A ``[rows, cols]`` weight as GGUF blocks: ``data`` is uint8 ``[rows, row_bytes]``."""

    data: torch.Tensor
    qtype: int
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"no quantized kernel for GGML type {self.qtype}")
        fmt = QTYPES[self.qtype]
        if self.cols % fmt.values or self.data.shape[1] != self.cols // fmt.values * fmt.bytes:
            raise ValueError(f"{self.name} rows of {self.cols} values do not match the data")

    @property
    def name(self) -> str:
        return QTYPES[self.qtype].name

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` dequantized to float32: the embedding lookup."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.cols)
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.data.shape[0]):
            raise IndexError(f"row ids out of range [0, {self.data.shape[0]})")
        _fn("dequant_rows_f32")(
            self.qtype, self.data.data_ptr(), self.cols, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        return out.view(*ids.shape, self.cols)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.data.shape[0]))


def available() -> bool:
    """Whether the loaded C library has the quantized kernels (x86 with AVX2)."""
    return cpu_ops._library is not None and hasattr(cpu_ops._library, "quant_matmul_f32")


def isa(flags: frozenset[str] | None = None) -> str:
    """The instruction set ``quant_matmul`` uses: ``avx512_vnni`` or ``avx2``."""
    flags = cpu_features.cpu_flags() if flags is None else flags
    if os.environ.get(ISA_ENV, "").lower() == "avx2":
        return "avx2"
    return "avx512_vnni" if all(f in flags for f in VNNI_FLAGS) else "avx2"


def _fn(name: str):
    if not available():
        raise RuntimeError("the quantized CPU kernels are not loaded: cpu_ops.load(build_dir)")
    return getattr(cpu_ops._library, name)


# Which product runs for how many activation rows (docs/performance.md, Quantized weights):
# the int16 kernels where the weight's bytes cost more than the arithmetic (a few rows),
# float tiles decoded per chunk where a few rows share each decoded value, and a whole
# decoded matrix under torch's product where enough rows amortize the decoding.
PATHS = ("int16", "float", "dequantize")
FLOAT_ROWS = 6
DEQUANTIZE_ROWS = 128
PIECE_VALUES = 1 << 22  # a whole-matrix decode goes by pieces of at most this many values
_scratch = threading.local()


def path_for(rows: int) -> str:
    """The product ``quant_matmul`` runs for ``rows`` activation rows."""
    return "int16" if rows < FLOAT_ROWS else "float" if rows < DEQUANTIZE_ROWS else "dequantize"


def quant_matmul(
    x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor | None = None, path: str | None = None
) -> torch.Tensor:
    """``x @ dequantize(w).T`` for float32 ``x [m, cols]``. ``path`` (default: by m, as
    ``path_for``) is ``int16`` (x in int16 per block of 32, integer dot products), ``float``
    (the weight decoded to float32 per chunk of rows) or ``dequantize`` (decoded by pieces,
    then torch's product; there x may be bfloat16, the weight then rounded to bfloat16 as a
    bfloat16 model's is). ``out``, in x's dtype, may be a column slice of a wider output
    (rows contiguous, any row stride), so the parts of a layer stacked by rows write one."""
    path = path or path_for(x.shape[0])
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    dtypes = (torch.float32, torch.bfloat16) if path == "dequantize" else (torch.float32,)
    if x.dtype not in dtypes or x.dim() != 2 or x.shape[1] != w.cols:
        raise ValueError(
            f"x must be {' or '.join(map(str, dtypes))} [m, {w.cols}] on the {path} path, "
            f"got {x.dtype} {list(x.shape)}"
        )
    x = x.contiguous()
    n = w.data.shape[0]
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
    elif (
        out.shape != (x.shape[0], n)
        or out.dtype != x.dtype
        or out.stride(1) != 1
        or out.stride(0) < n
    ):
        raise ValueError(f"out must be {x.dtype} [{x.shape[0]}, {n}] with contiguous rows")
    if not x.shape[0]:
        return out
    vnni = int(isa() == "avx512_vnni")
    if path == "dequantize":
        rows = max(1, PIECE_VALUES // w.cols)
        for start in range(0, n, rows):
            piece = w.data[start : start + rows]
            decoded = _decode_buffer(piece.shape[0] * w.cols).view(piece.shape[0], w.cols)
            _fn("dequantize_f32")(
                w.qtype, piece.data_ptr(), piece.shape[0], w.cols, decoded.data_ptr(), vnni
            )
            torch.mm(x, decoded.to(x.dtype).T, out=out[:, start : start + piece.shape[0]])
        return out
    status = _fn("quant_matmul_f32")(
        w.qtype,
        w.data.data_ptr(),
        n,
        w.cols,
        x.data_ptr(),
        x.shape[0],
        out.data_ptr(),
        out.stride(0),
        vnni,
        int(path == "float"),
    )
    if status:
        raise MemoryError("no memory for the quantized product's buffers")
    return out


def _decode_buffer(values: int) -> torch.Tensor:
    """This thread's float32 buffer of at least ``values``: decoded pieces reuse it rather
    than allocate per call (threads: the engines of one process run on their own)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < values:
        buf = _scratch.buf = torch.empty(values)
    return buf[:values]


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """``weight [rows, cols]`` to int8 with one scale per block of 32 values of a row: Q8_0
    blocks, as llama.cpp writes them, that the Q8_0 kernels run. One scale per output channel
    measured top-1 0.941 on the default model's weights; a row's spread needs the finer
    scales. Each scale is rounded to float16 first and the values quantized against it."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"int8 needs rows of a multiple of {BLOCK} values, got {cols}")
    blocks = cols // BLOCK
    w = weight.detach().float().reshape(rows, blocks, BLOCK)
    scale = (w.abs().amax(dim=2) / 127).to(torch.float16)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = torch.round(w / safe[:, :, None]).clamp(-127, 127).to(torch.int8)
    data = torch.empty(rows, blocks, 34, dtype=torch.uint8)
    data[:, :, :2] = scale.view(torch.uint8).view(rows, blocks, 2)
    data[:, :, 2:] = q.view(torch.uint8)
    return QuantizedWeight(data.view(rows, blocks * 34), Q8_0, cols)
