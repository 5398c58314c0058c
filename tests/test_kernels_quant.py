"""The quantized kernels on quantized weights against dequantize-then-matmul, on fresh
random inputs every run (seed printed on failure), on each instruction path this CPU has.

Weights of the 32-value formats are quantized by the ``gguf`` package (llama.cpp's
reference quantizers), so the blocks are the ones a real file holds; the K-quants, which the
package cannot quantize, are random bytes under random float16 scales, so every bit pattern
of their packed scales and values comes up. Both are dequantized by the package for the
reference. The activations are quantized to int16 per block of 32 by the kernel; the exact
reference quantizes them the same way in torch, so the two differ by float summation order
only. The float products (``path="float"``, ``"dequantize"``) take x as it is, so their
reference is x times the dequantized weight.
"""

from __future__ import annotations

import time

import pytest
import torch

from tokenq.engine.downloads import build_dir
from tokenq.kernels import cpu_features, cpu_ops, cpu_quant

gguf = pytest.importorskip("gguf")

cpu_ops.load(build_dir())
pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no AVX2 C kernels here")

HAS_VNNI = all(f in cpu_features.cpu_flags() for f in cpu_quant.VNNI_FLAGS)
ISAS = [
    "avx2",
    pytest.param(
        "avx512_vnni",
        marks=pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX-512 VNNI"),
    ),
]
# (activation rows, weight rows, columns) of the int16 product: single decode rows, odd row
# counts on both sides, a tail of the 4-row activation tile and of the 16-row weight chunk;
# up to 4 rows decode each weight block in the tile, more decode a chunk once for all tiles.
SHAPES = [(1, 17, 32), (3, 33, 96), (5, 16, 64), (13, 47, 576), (64, 40, 160)]
K_SHAPES = [(1, 17, 256), (3, 33, 512), (13, 47, 768), (64, 20, 256)]  # super-blocks of 256
K_QUANTS = sorted(t for t, f in cpu_quant.QTYPES.items() if f.values == 256)
BLOCK_QUANTS = sorted(t for t, f in cpu_quant.QTYPES.items() if f.values == 32)
CASES = [(t, s) for t in BLOCK_QUANTS for s in SHAPES] + [
    (t, s) for t in K_QUANTS for s in K_SHAPES
]


@pytest.fixture
def gen() -> torch.Generator:
    seed = time.time_ns() % 2**31
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "avx2":
        monkeypatch.setenv(cpu_quant.ISA_ENV, "avx2")
    else:
        monkeypatch.delenv(cpu_quant.ISA_ENV, raising=False)
    assert cpu_quant.isa() == request.param
    return request.param


def quantized(gen: torch.Generator, qtype: int, rows: int, cols: int) -> cpu_quant.QuantizedWeight:
    fmt = cpu_quant.QTYPES[qtype]
    if fmt.values == 32:
        w = torch.randn(rows, cols, generator=gen).numpy()
        data = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)))
        return cpu_quant.QuantizedWeight(data.contiguous(), qtype, cols)
    blocks = cols // fmt.values
    data = torch.randint(0, 256, (rows, blocks, fmt.bytes), generator=gen, dtype=torch.uint8)

    def scales(at: int) -> None:  # a float16 scale in (0.001, 0.02] at byte `at`
        d = (torch.rand(rows, blocks, generator=gen) * 0.019 + 0.001).to(torch.float16)
        data[:, :, at : at + 2] = d.view(torch.uint8).view(rows, blocks, 2)

    if fmt.name == "Q6_K":
        scales(208)  # d last; the 16 int8 sub-block scales before it stay random
    else:
        scales(0)  # d, then dmin
        scales(2)
    return cpu_quant.QuantizedWeight(data.view(rows, -1), qtype, cols)


def reference_weight(w: cpu_quant.QuantizedWeight) -> torch.Tensor:
    data = w.data.numpy()
    return torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(w.qtype)))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int16 per block of 32 with scale amax / 32767, as the kernels do."""
    blocks = x.view(x.shape[0], -1, cpu_quant.BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    q = torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d)))
    return (q * d).view_as(x)


@pytest.mark.parametrize(
    ("qtype", "shape"), CASES, ids=[f"{cpu_quant.QTYPES[t].name}-{s}" for t, s in CASES]
)
def test_quant_matmul_is_dequantize_then_matmul(
    gen: torch.Generator, isa: str, qtype: int, shape: tuple[int, int, int]
) -> None:
    m, n, k = shape
    w = quantized(gen, qtype, n, k)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    wide = torch.full((m, n + 5), float("nan"))  # out: a column slice of a wider output
    out = cpu_quant.quant_matmul(x, w, wide[:, 2 : 2 + n], path="int16")
    assert wide[:, :2].isnan().all() and wide[:, 2 + n :].isnan().all()
    ref_w = reference_weight(w).double()
    exact = quantize_activations(x).double() @ ref_w.T
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4 * exact.abs().max())
    # and the activation rounding costs what one int16 step per value costs
    full = x.double() @ ref_w.T
    assert ((out.double() - full).abs().max() / full.abs().max()) < 1e-3


# (activation rows, weight rows, columns) of the float products: one vector of rows and
# two, a group of rows and a part of one, a tail of the weight-row tile (12 rows on AVX-512,
# 6 on AVX2) and of the 128-value block of k.
FLOAT_SHAPES = [(1, 29, 160), (17, 13, 96), (40, 7, 576)]
K_FLOAT_SHAPES = [(1, 29, 256), (40, 13, 768)]


@pytest.mark.parametrize("path", ["float", "dequantize"])
@pytest.mark.parametrize("qtype", sorted(cpu_quant.QTYPES), ids=lambda t: cpu_quant.QTYPES[t].name)
def test_the_float_products_are_dequantize_then_matmul(
    gen: torch.Generator, isa: str, qtype: int, path: str
) -> None:
    shapes = K_FLOAT_SHAPES if qtype in K_QUANTS else FLOAT_SHAPES
    for m, n, k in shapes:
        w = quantized(gen, qtype, n, k)
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        wide = torch.full((m, n + 3), float("nan"))
        out = cpu_quant.quant_matmul(x, w, wide[:, 1 : 1 + n], path=path)
        assert wide[:, :1].isnan().all() and wide[:, 1 + n :].isnan().all()
        exact = x.double() @ reference_weight(w).double().T
        torch.testing.assert_close(
            out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max(), msg=f"{m}x{n}x{k}"
        )


def test_bfloat16_activations_meet_the_weight_rounded_to_bfloat16(gen: torch.Generator) -> None:
    """Under torch's product a bf16 model's activations stay bf16, and the decoded weight is
    rounded to bf16 as a bf16 model's own is: the bf16 product of the same values."""
    w = quantized(gen, 3, 20, 96)  # Q4_1
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    out = cpu_quant.quant_matmul(x, w, path="dequantize")
    assert out.dtype == torch.bfloat16
    expected = x @ reference_weight(w).to(torch.bfloat16).T
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="on the float path"):
        cpu_quant.quant_matmul(x, w, path="float")


def test_the_product_follows_the_rows_it_is_given() -> None:
    assert [cpu_quant.path_for(m) for m in (1, 5, 6, 127, 128)] == [
        "int16",
        "int16",
        "float",
        "float",
        "dequantize",
    ]
    with pytest.raises(ValueError, match="path must be one of"):
        cpu_quant.quant_matmul(torch.randn(1, 32), quantized(torch.Generator(), 8, 2, 32), path="x")


@pytest.mark.parametrize("qtype", sorted(cpu_quant.QTYPES), ids=lambda t: cpu_quant.QTYPES[t].name)
def test_dequantized_rows_are_the_gguf_values(gen: torch.Generator, qtype: int) -> None:
    w = quantized(gen, qtype, 9, 512)
    ids = torch.tensor([8, 0, 3, 3])
    assert torch.equal(w.rows(ids), reference_weight(w)[ids])
    with pytest.raises(IndexError):
        w.rows(torch.tensor([9]))


def test_int8_keeps_each_block_of_32_within_half_its_step(gen: torch.Generator, isa: str) -> None:
    weight = torch.randn(37, 64, generator=gen) * torch.rand(37, 64, generator=gen) ** 4
    w = cpu_quant.quantize_int8(weight)
    back = w.dequantize()
    step = weight.view(37, 2, 32).abs().amax(2, keepdim=True).expand(37, 2, 32) / 127
    step = step.reshape(37, 64)
    assert ((back - weight).abs() <= step * 0.5 + step * 1e-3).all()
    x = torch.randn(3, 64, generator=gen)
    exact = quantize_activations(x).double() @ back.double().T
    torch.testing.assert_close(
        cpu_quant.quant_matmul(x, w).double(), exact, rtol=1e-5, atol=1e-4 * exact.abs().max()
    )


def test_quant_matmul_refuses_mismatched_inputs(gen: torch.Generator) -> None:
    w = quantized(gen, 8, 4, 64)
    with pytest.raises(ValueError, match="float32"):
        cpu_quant.quant_matmul(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="float32"):
        cpu_quant.quant_matmul(torch.randn(2, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="out must be"):
        cpu_quant.quant_matmul(torch.randn(2, 64), w, torch.empty(2, 5))
    with pytest.raises(ValueError, match="out must be"):
        cpu_quant.quant_matmul(torch.randn(2, 64), w, torch.empty(4, 2).T)
    with pytest.raises(ValueError, match="no quantized kernel"):
        cpu_quant.QuantizedWeight(w.data, 10, 64)  # Q2_K: dequantized at load instead
    with pytest.raises(ValueError, match="Q4_K rows of 64 values do not match"):
        cpu_quant.QuantizedWeight(w.data, 12, 64)  # a super-block is 256 values
