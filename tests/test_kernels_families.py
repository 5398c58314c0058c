"""The C kernels the newer families need, against their torch reference: per-head q/k norms
on the strided heads of a fused QKV row (Qwen3, Gemma 3), GELU-tanh times up (Gemma 3), and
rotary embedding on part of each head (Phi-3)."""

from __future__ import annotations

import time

import pytest
import torch

from tokenq.engine.downloads import build_dir
from tokenq.kernels import cpu_ops, reference

pytestmark = pytest.mark.skipif(not cpu_ops.available(build_dir()), reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16]
# bf16 results may differ by the rounding of the result (one step, 2^-8 relative)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}


@pytest.fixture
def gen() -> torch.Generator:
    seed = time.time_ns() % 2**31
    print(f"seed={seed}")  # shown by pytest only when the test fails
    return torch.Generator().manual_seed(seed)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_heads_normalises_the_heads_it_is_given_in_place(gen, dtype) -> None:
    """The key heads of a fused QKV row (a strided view, after the query heads) normed with
    one weight; the query and value heads around them untouched."""
    rows, q_heads, kv_heads, head_dim = 19, 4, 2, 64
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    expected = qkv.clone()
    reference.rms_norm_heads_torch(
        expected[:, q_heads * head_dim :], kv_heads, head_dim, weight, 1e-6
    )
    got = qkv.clone()
    cpu_ops.rms_norm_heads_cpu(got[:, q_heads * head_dim :], kv_heads, head_dim, weight, 1e-6)
    keys = slice(q_heads * head_dim, (q_heads + kv_heads) * head_dim)
    assert rel_err(got[:, keys], expected[:, keys]) < TOLERANCE[dtype]
    assert not torch.equal(got[:, keys], qkv[:, keys])
    others = torch.ones(qkv.shape[1], dtype=torch.bool)
    others[keys] = False
    assert torch.equal(got[:, others], qkv[:, others])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_equals_torch_across_the_range(gen, dtype) -> None:
    """Gates from -60 to 60 (both tails of the tanh) and random ones."""
    rows, dim = 9, 200
    gate = torch.cat(
        [torch.linspace(-60, 60, dim)[None], 4 * torch.randn(rows - 1, dim, generator=gen)]
    )
    gate_up = torch.cat([gate, torch.randn(rows, dim, generator=gen)], dim=1).to(dtype)
    out = torch.empty(rows, dim, dtype=dtype)
    cpu_ops.gelu_tanh_mul_cpu(gate_up, out)
    expected = reference.gelu_tanh_mul_torch(gate_up.float(), out.float())
    assert (out.float() - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_turns_only_the_first_dimensions_of_each_head(gen, dtype) -> None:
    rows, heads, head_dim, rotary_dim, max_pos = 13, 6, 64, 24, 100
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.outer(torch.arange(max_pos).float(), inv_freq)
    cos = torch.cat([angles, angles], -1).cos().to(dtype)
    sin = torch.cat([angles, angles], -1).sin().to(dtype)
    qkv = torch.randn(rows, (heads + 2) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(max_pos, (rows,), generator=gen)
    expected = reference.rope_torch(qkv.clone(), heads, head_dim, positions, cos, sin)
    got = cpu_ops.rope_cpu(qkv.clone(), heads, head_dim, positions, cos, sin)
    assert rel_err(got, expected) < TOLERANCE[dtype]
    per_head = got[:, : heads * head_dim].view(rows, heads, head_dim)
    before = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    assert torch.equal(per_head[..., rotary_dim:], before[..., rotary_dim:])
    assert torch.equal(got[:, heads * head_dim :], qkv[:, heads * head_dim :])
