"""A linear layer whose weight is packed once for the CPU's matrix library."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tokenq.kernels.cpu_quant import (
    BLOCK,
    QuantizedWeight,
    path_for,
    quant_matmul,
    quantize_int8,
)


class Linear:
    """``x @ W.T (+ b)``. On a CPU with oneDNN the weight is packed once into oneDNN's
    blocked layout: measured here about twice as fast as ``F.linear`` for decode-sized
    batches (32 rows) and a quarter faster for prefill-sized ones.

    A bfloat16 weight is packed as bf16 where oneDNN can (it needs AVX-512 or AVX-NE-CONVERT,
    and uses AVX512_BF16/AMX dot products where the CPU has them). Where it cannot, torch's
    own bf16 matrix product measured 6 to 9 times slower than packed fp32 here (AVX2), so
    the bf16 values are packed as fp32 instead and the activations widened at the call:
    every bf16 value is exact in fp32 and oneDNN accumulates bf16 products in fp32 anyway,
    so the result is the same bf16 product, at fp32's speed and memory.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.in_features = weight.shape[1]
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.widen = False  # bf16 activations through an fp32-packed copy of the weight
        if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            self.packed = _pack(weight)
            if self.packed is None and weight.dtype == torch.bfloat16:
                self.packed = _pack(weight.float())
                self.widen = self.packed is not None
                if self.widen and bias is not None:
                    self.bias = bias.float()
            if self.packed is not None:
                self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.widen:
            out = torch.ops.mkldnn._linear_pointwise(
                x.float(), self.packed, self.bias, "none", [], ""
            )
            return out.to(x.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@functools.cache
def _bf16_fast() -> bool:
    """Whether oneDNN multiplies bf16 here (it packs a bf16 weight): elsewhere torch's bf16
    product measured 6 to 9 times slower than fp32 (Linear)."""
    return (
        torch.backends.mkldnn.is_available()
        and _pack(torch.zeros(32, 32, dtype=torch.bfloat16)) is not None
    )


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout, or None where this torch or CPU cannot."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (AttributeError, RuntimeError):  # a torch build without the op, a CPU without bf16
        return None


class QuantLinear:
    """``x @ W.T (+ b)`` with ``W`` kept quantized and the product on the quantized kernels
    (kernels/cpu_quant.h); ``x`` comes in and goes out in the engine's dtype. ``W`` is one
    weight, or the parts of a layer stacked by rows in formats that differ (a file's Q/K/V
    in Q5_0, Q5_0 and Q8_0), each part writing its columns of the output."""

    def __init__(
        self, weight: QuantizedWeight | list[QuantizedWeight], bias: torch.Tensor | None = None
    ) -> None:
        self.parts = weight if isinstance(weight, list) else [weight]
        self.weight = self.parts[0] if len(self.parts) == 1 else None  # the one, when one
        self.bias = None if bias is None else bias.float()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].cols

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if not (dtype == torch.bfloat16 and path_for(x.shape[0]) == "dequantize" and _bf16_fast()):
            x = x.float()  # bf16 stays bf16 only under torch's product, where oneDNN has bf16
        if self.weight is not None:
            out = quant_matmul(x, self.weight)
        else:
            out = torch.empty(x.shape[0], sum(p.shape[0] for p in self.parts), dtype=x.dtype)
            start = 0
            for part in self.parts:
                quant_matmul(x, part, out[:, start : start + part.shape[0]])
                start += part.shape[0]
        if self.bias is not None:
            out += self.bias
        return out.to(dtype)


def build_linear(
    parts: list[torch.Tensor | QuantizedWeight],
    bias: torch.Tensor | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    int8: bool = False,
) -> Linear | QuantLinear:
    """One layer from weights stacked by rows (Q/K/V, gate/up). Quantized parts stay as they
    are (those of one type joined into one weight); parts quantized and float together are
    dequantized to ``dtype``; with ``int8`` the float weights become int8 per block of
    32."""
    types = {p.qtype if isinstance(p, QuantizedWeight) else None for p in parts}
    if None not in types:
        quantized: list[QuantizedWeight] = parts  # type: ignore[assignment]
        if len(parts) == 1:  # shared as it is (a tied embedding is the lm_head)
            return QuantLinear(quantized[0], bias)
        if len(types) > 1:
            return QuantLinear(quantized, bias)
        first = quantized[0]
        data = torch.cat([p.data for p in quantized])
        return QuantLinear(QuantizedWeight(data, first.qtype, first.cols), bias)
    full = torch.cat([dense_weight(p, device, dtype) for p in parts])
    if int8 and full.shape[1] % BLOCK == 0:  # other widths stay float: no int8 kernel
        return QuantLinear(quantize_int8(full), bias)
    return Linear(full, bias)


def dense_weight(
    weight: torch.Tensor | QuantizedWeight, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """A weight in ``dtype`` on ``device``, dequantized where it is quantized."""
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize()
    return weight.to(device=device, dtype=dtype).contiguous()
