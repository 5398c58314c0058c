"""Triton and C kernels against the torch reference, on fresh random inputs every run.

Without CUDA the kernels run in Triton's interpreter, which must be switched on before the
kernel modules are imported (``triton.jit`` reads it at decoration time). The interpreter
has no bfloat16 matmul, so bf16 attention runs only on a GPU. Every test draws its seed from
the clock and prints it on failure; outputs are poisoned with NaN so unwritten rows show.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenq.engine.downloads import build_dir  # noqa: E402
from tokenq.kernels import cpu_ops  # noqa: E402
from tokenq.kernels.kv_write import write_kv_triton  # noqa: E402
from tokenq.kernels.paged_attention import (  # noqa: E402
    choose_num_splits,
    paged_attention_triton,
    split_scratch_numel,
)
from tokenq.kernels.reference import (  # noqa: E402
    argmax_rows_torch,
    paged_attention_torch,
    write_kv_torch,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GARBAGE_SCALE = 1e3  # cache slots no sequence owns: a stray read swamps the result
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton interpreter has no bf16 matmul"
)
_no_c_compiler = pytest.mark.skipif(not cpu_ops.available(build_dir()), reason="no C compiler")


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernels read CPU tensors: their inputs are made on the CPU on a GPU host too."""
    monkeypatch.setattr(sys.modules[__name__], "DEVICE", torch.device("cpu"))


def needs_cpu_ops(test):
    return pytest.mark.usefixtures("on_cpu")(_no_c_compiler(test))


@pytest.fixture
def gen() -> torch.Generator:
    seed = time.time_ns() % 2**31
    print(f"seed={seed}")  # shown by pytest only when the test fails
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.cu_seqlens_q,
            self.seq_lens,
            self.block_tables,
            self.scale,
        )


def make_batch(
    gen: torch.Generator,
    seqs: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> Batch:
    """A batch of ``(query_len, seq_len)`` sequences over a realistically messy cache.

    The cache is one layer of an all-layers tensor (so strided), each sequence owns blocks
    in shuffled order, block-table padding points at real blocks, and every slot that no
    sequence owns (spare blocks, the tail of each last block) holds large random garbage.
    ``q`` is a slice of a fused QKV-like buffer, as the engine produces it.
    """
    num_heads = num_kv_heads * group
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    layers = GARBAGE_SCALE * randn(gen, 2, 2, num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = layers[1, 0], layers[1, 1]
    block_tables = perm[torch.randint(num_blocks, (len(seqs), max_blocks), generator=gen)]
    owned = []
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[sum(blocks_per_seq[:i]) : sum(blocks_per_seq[: i + 1])]
        for pos in range(seqs[i][1]):
            owned.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    slots = torch.tensor(owned, device=DEVICE)
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, num_kv_heads, head_dim)
        flat[slots] = randn(gen, len(owned), num_kv_heads, head_dim).to(flat.dtype)

    num_tokens = sum(q_len for q_len, _ in seqs)
    fused = randn(gen, num_tokens, num_heads + 2, head_dim, dtype=dtype)
    cu = [0]
    for q_len, _ in seqs:
        cu.append(cu[-1] + q_len)
    return Batch(
        q=fused[:, 1 : num_heads + 1],
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(device=DEVICE, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def check_attention(batch: Batch, tol: float, **kwargs) -> None:
    expected = paged_attention_torch(
        batch.q.float(),
        batch.k_cache.float(),
        batch.v_cache.float(),
        *batch.args()[3:],
    )
    out = torch.full_like(batch.q, float("nan"))
    result = paged_attention_triton(*batch.args(), out, **kwargs)
    assert result is out
    assert not out.isnan().any(), "rows left unwritten"
    err = rel_err(out, expected)
    assert err < tol, f"relative error {err:.2e}"


def mixed(block_size: int) -> list[tuple[int, int]]:
    """(query_len, seq_len): the shapes a chunked-prefill step mixes, with the edge cases."""
    return [
        (1, 2 * block_size + 5),  # decode, context not a multiple of the block size
        (37, 37),  # first prefill chunk, no cached context
        (1, 1),  # a sequence of a single token
        (19, 19 + 2 * block_size + 3),  # later prefill chunk over cached context
        (1, 3 * block_size),  # decode that fills its last block exactly
        (2, block_size + 9),  # short chunk after context
        (70, 70 + block_size - 1),  # chunk spanning several query blocks of a program
    ]


# (num_kv_heads, group, head_dim, block_size): GQA ratios 1, 3, 4, 8; head sizes 64 and 128.
SHAPES = [
    (2, 1, 64, 16),
    (1, 3, 128, 16),
    (2, 4, 64, 32),
    (1, 8, 128, 16),
    (1, 4, 64, 64),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kvh{}-g{}-d{}-bs{}".format(*s))
def test_mixed_batch_fp32(gen: torch.Generator, shape: tuple[int, int, int, int]) -> None:
    num_kv_heads, group, head_dim, block_size = shape
    batch = make_batch(
        gen,
        mixed(block_size),
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
    )
    check_attention(batch, 1e-5)


@pytest.mark.parametrize("round_", range(3))
def test_random_batches_fp32(gen: torch.Generator, round_: int) -> None:
    """Random batch compositions, so the program-to-sequence mapping meets new layouts."""
    seqs = []
    for _ in range(int(torch.randint(1, 9, (), generator=gen))):
        context = int(torch.randint(0, 100, (), generator=gen))
        query_len = int(torch.randint(1, 3, (), generator=gen))
        if query_len > 1:  # half decodes, half prefill chunks
            query_len = int(torch.randint(2, 90, (), generator=gen))
        seqs.append((query_len, context + query_len))
    num_kv_heads, group = [(1, 1), (2, 3), (1, 4)][round_]
    block_size = [16, 32, 16][round_]
    batch = make_batch(
        gen, seqs, num_kv_heads=num_kv_heads, group=group, head_dim=64, block_size=block_size
    )
    check_attention(batch, 1e-5)


def test_hints_and_forced_split_on_mixed_batch(gen: torch.Generator) -> None:
    """The sync-free call (both hints given) and the split path on prefill chunks."""
    seqs = [(1, 41), (20, 150), (1, 1), (9, 9)]
    batch = make_batch(gen, seqs, num_kv_heads=2, group=4, head_dim=64, block_size=16)
    hints = {"max_query_len": 20, "max_seq_len": 150}
    check_attention(batch, 1e-5, **hints)
    check_attention(batch, 1e-5, **hints, num_splits=3)


@pytest.mark.parametrize("group,head_dim", [(4, 128), (3, 64)])
def test_split_kv_decode(gen: torch.Generator, group: int, head_dim: int) -> None:
    """Flash-decoding on long decodes, with preallocated NaN-poisoned scratch."""
    seqs = [(1, 300), (1, 17), (1, 256), (1, 1)]
    batch = make_batch(gen, seqs, num_kv_heads=2, group=group, head_dim=head_dim, block_size=16)
    num_heads = 2 * group
    scratch = torch.full(
        (split_scratch_numel(len(seqs), num_heads, head_dim, 5) + 7,), float("nan"), device=DEVICE
    )
    hints = {"max_query_len": 1, "max_seq_len": 300}
    check_attention(batch, 1e-5, **hints, num_splits=5, split_scratch=scratch)
    check_attention(batch, 1e-5, num_splits=1)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_padding_rows_untouched(gen: torch.Generator, num_splits: int) -> None:
    """Rows past ``cu_seqlens_q[-1]`` (CUDA-graph padding) are left as they are."""
    batch = make_batch(gen, [(1, 40), (1, 7)], num_kv_heads=1, group=4, head_dim=64, block_size=16)
    q = torch.cat([batch.q, randn(gen, 3, *batch.q.shape[1:])])
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, *batch.args()[1:], out, num_splits=num_splits)
    assert not out[:2].isnan().any() and out[2:].isnan().all()


def test_auto_split(gen: torch.Generator) -> None:
    """A lone long decode is split automatically, with or without the sync-free hints."""
    assert choose_num_splits(1, 1, 600, DEVICE) == 2  # by length, on any device
    assert choose_num_splits(1, 1, 200, DEVICE) == 1
    assert choose_num_splits(4096, 8, 4096, DEVICE) == 1  # enough programs already
    batch = make_batch(gen, [(1, 600)], num_kv_heads=1, group=4, head_dim=64, block_size=16)
    check_attention(batch, 1e-5)
    check_attention(batch, 1e-5, max_query_len=1, max_seq_len=600)


@pytest.mark.parametrize("shape", [(1, 4, 64, 16), (2, 1, 128, 32)], ids=["g4-d64", "g1-d128"])
def test_fp16(gen: torch.Generator, shape: tuple[int, int, int, int]) -> None:
    """Half precision takes the tensor-core tile sizes (fp32 uses smaller CUDA-core tiles)."""
    num_kv_heads, group, head_dim, block_size = shape
    batch = make_batch(
        gen,
        mixed(block_size),
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float16,
    )
    check_attention(batch, 1e-2)
    check_attention(batch, 1e-2, num_splits=2)
    decodes = make_batch(
        gen,
        [(1, 70), (1, 3)],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float16,
    )
    check_attention(decodes, 1e-2)


@needs_cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kvh{}-g{}-d{}-bs{}".format(*s))
def test_bf16(gen: torch.Generator, shape: tuple[int, int, int, int]) -> None:
    num_kv_heads, group, head_dim, block_size = shape
    batch = make_batch(
        gen,
        mixed(block_size),
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
    )
    check_attention(batch, 1e-2)
    check_attention(batch, 1e-2, num_splits=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(3, 64, 16), (8, 128, 32)])
def test_write_kv(
    gen: torch.Generator, dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    num_blocks, num_tokens = 6, 23
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    slots[5] = -1  # skipped token
    fused = randn(gen, num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    layers = randn(gen, 2, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    expected = layers[1].clone()
    write_kv_torch(key, value, expected[0], expected[1], slots)
    write_kv_triton(key, value, layers[1, 0], layers[1, 1], slots)
    assert torch.equal(layers[1], expected)


# -- the C kernels (CPU, float32) ---------------------------------------------------------


def expected_attention(batch: Batch) -> torch.Tensor:
    return paged_attention_torch(*batch.args())


@needs_cpu_ops
@pytest.mark.parametrize(
    "shape",
    [*SHAPES, (2, 2, 40, 16), (1, 2, 36, 16), (3, 3, 64, 1)],
    ids=lambda s: "kvh{}-g{}-d{}-bs{}".format(*s),
)
def test_cpu_attention_mixed_batch(gen: torch.Generator, shape: tuple[int, int, int, int]) -> None:
    """Every sequence of a mixed batch. Head sizes 64 and 128 take the AVX2 path where the
    CPU has it, 40 its generic form, 36 (not a multiple of 8) the portable C; block size 1
    puts every key in its own block."""
    num_kv_heads, group, head_dim, block_size = shape
    batch = make_batch(
        gen,
        mixed(block_size) + [(1, 200)],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
    )
    out = torch.full_like(batch.q, float("nan"))
    cpu_ops.paged_attention_cpu(*batch.args(), out=out)
    assert not out.isnan().any(), "rows left unwritten"
    err = rel_err(out, expected_attention(batch))
    assert err < 1e-5, f"relative error {err:.2e}"


@needs_cpu_ops
@pytest.mark.parametrize("with_delta", [False, True])
def test_cpu_add_rms_norm(gen: torch.Generator, with_delta: bool) -> None:
    rows, dim, eps = 37, 576, 1e-5
    x, delta, weight = randn(gen, rows, dim), randn(gen, rows, dim), randn(gen, dim)
    summed = x + delta if with_delta else x.clone()
    expected = torch.nn.functional.rms_norm(summed, (dim,), weight, eps)
    out = torch.full_like(x, float("nan"))
    cpu_ops.add_rms_norm_cpu(x, delta if with_delta else None, weight, eps, out)
    assert torch.equal(x, summed)
    assert rel_err(out, expected) < 1e-5


@needs_cpu_ops
def test_cpu_silu_mul(gen: torch.Generator) -> None:
    gate_up = 4 * randn(gen, 33, 2 * 200)  # a wide range, to exercise the exponential
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = torch.full((33, 200), float("nan"))
    cpu_ops.silu_mul_cpu(gate_up, out)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_silu_mul_past_the_exponentials_clamps(dtype: torch.dtype) -> None:
    """Gates beyond +-87, where fast_expf clamps: silu is the gate itself above, 0 below."""
    edge = [-1e4, -1000.0, -100.0, -88.5, -87.0, -20.0, 0.0, 20.0, 87.0, 88.5, 100.0, 1e4]
    gate = torch.tensor(edge * 3).view(3, len(edge))
    up = torch.linspace(-2, 2, gate.numel()).view_as(gate)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    out = torch.empty_like(gate, dtype=dtype)
    cpu_ops.silu_mul_cpu(gate_up, out)
    expected = torch.nn.functional.silu(gate_up[:, : len(edge)].float()) * up.to(dtype).float()
    assert torch.allclose(out.float(), expected, rtol=1e-2, atol=1e-6)


@needs_cpu_ops
def test_cpu_rope_in_place(gen: torch.Generator) -> None:
    """Query and key heads of a fused QKV row rotate; the value heads stay as they were."""
    rows, heads, head_dim, max_pos = 21, 5, 64, 300
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    qkv = randn(gen, rows, (heads + 2) * head_dim)
    positions = torch.randint(max_pos, (rows,), generator=gen)
    x = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = head_dim // 2
    expected = x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s
    values = qkv[:, heads * head_dim :].clone()
    cpu_ops.rope_cpu(qkv, heads, head_dim, positions, cos, sin)
    assert rel_err(qkv[:, : heads * head_dim].view(rows, heads, head_dim), expected) < 1e-6
    assert torch.equal(qkv[:, heads * head_dim :], values)


# -- the C kernels in bfloat16 ------------------------------------------------------------
# bf16 storage, float32 arithmetic: each kernel is compared with its torch reference
# computed in float32 on the same (bf16-rounded) inputs, so the only difference allowed is
# the rounding of the result to bf16 (a relative step of 2^-8 = 3.9e-3, half that at
# nearest) plus the few intermediate roundings the kernels copy from transformers.
BF16_STEP = 2.0**-8


@needs_cpu_ops
@pytest.mark.parametrize(
    "shape",
    [*SHAPES, (2, 2, 40, 16), (1, 2, 36, 16), (3, 3, 64, 1)],
    ids=lambda s: "kvh{}-g{}-d{}-bs{}".format(*s),
)
def test_cpu_attention_bf16(gen: torch.Generator, shape: tuple[int, int, int, int]) -> None:
    """Attention reading a bf16 cache: against float32 attention over the same bf16 values,
    within one bf16 step of the largest output (the result's own rounding is half that)."""
    num_kv_heads, group, head_dim, block_size = shape
    batch = make_batch(
        gen,
        mixed(block_size) + [(1, 200)],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
    )
    out = torch.full_like(batch.q, float("nan"))
    cpu_ops.paged_attention_cpu(*batch.args(), out=out)
    assert out.dtype == torch.bfloat16 and not out.isnan().any(), "rows left unwritten"
    expected = paged_attention_torch(
        batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), *batch.args()[3:]
    )
    err = rel_err(out, expected)
    assert err < BF16_STEP, f"relative error {err:.2e}"


@needs_cpu_ops
@pytest.mark.parametrize("with_delta", [False, True])
def test_cpu_add_rms_norm_bf16(gen: torch.Generator, with_delta: bool) -> None:
    """The residual sum is stored exactly as torch's bf16 add rounds it; the output equals
    transformers' LlamaRMSNorm in bf16 (normalise in float32, round, multiply, round) to
    one bf16 step, the float32 sum of squares being added in another order."""
    rows, dim, eps = 37, 576, 1e-5
    bf = torch.bfloat16
    x, delta = randn(gen, rows, dim, dtype=bf), randn(gen, rows, dim, dtype=bf)
    weight = (1 + 0.1 * randn(gen, dim)).to(bf)
    summed = x + delta if with_delta else x.clone()
    xf = summed.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(bf)
    expected = weight * normed
    out = torch.full_like(x, float("nan"))
    cpu_ops.add_rms_norm_cpu(x, delta if with_delta else None, weight, eps, out)
    assert torch.equal(x, summed)
    assert rel_err(out, expected) < BF16_STEP
    # one bf16 step at most, and nearly everywhere none
    assert (out != expected).float().mean() < 0.02


@needs_cpu_ops
def test_cpu_silu_mul_bf16(gen: torch.Generator) -> None:
    """Against torch's bf16 ``silu(gate) * up`` (each op rounding to bf16): within one bf16
    step of each element's own size."""
    gate_up = (4 * randn(gen, 33, 2 * 200)).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).float()
    out = torch.full((33, 200), float("nan"), dtype=torch.bfloat16)
    cpu_ops.silu_mul_cpu(gate_up, out)
    assert torch.allclose(out.float(), expected, rtol=BF16_STEP, atol=1e-6)


@needs_cpu_ops
def test_cpu_rope_bf16(gen: torch.Generator) -> None:
    """Against transformers' bf16 rotary (bf16 tables, ``q * cos + rotate_half(q) * sin``
    with every op rounding to bf16), within one bf16 step of the largest element; value
    heads untouched."""
    rows, heads, head_dim, max_pos = 21, 5, 64, 300
    bf = torch.bfloat16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(bf), emb.sin().to(bf)
    qkv = randn(gen, rows, (heads + 2) * head_dim, dtype=bf)
    positions = torch.randint(max_pos, (rows,), generator=gen)
    x = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = head_dim // 2
    expected = x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s
    values = qkv[:, heads * head_dim :].clone()
    cpu_ops.rope_cpu(qkv, heads, head_dim, positions, cos, sin)
    assert rel_err(qkv[:, : heads * head_dim].view(rows, heads, head_dim), expected) < BF16_STEP
    assert torch.equal(qkv[:, heads * head_dim :], values)


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_argmax_rows_finds_each_rows_first_maximum(
    gen: torch.Generator, dtype: torch.dtype
) -> None:
    """Against torch's max(dim) on fresh logits: a vocabulary that is not a multiple of the
    kernel's blocks, maxima tied at random places (the first wins), rows of -inf, rows
    that are a strided view, rows of one column."""
    rows = int(torch.randint(1, 70, (), generator=gen))
    vocab = int(torch.randint(1000, 50_000, (), generator=gen))
    x = randn(gen, rows, vocab, dtype=dtype)
    for r in range(0, rows, 3):  # ties: the row's maximum again, further on or before
        cols = torch.randint(vocab, (2,), generator=gen)
        x[r, cols] = x[r].max() + 1
    x[rows // 2] = float("-inf")
    assert torch.equal(cpu_ops.argmax_rows_cpu(x), argmax_rows_torch(x))
    wide = randn(gen, rows, vocab + 37, dtype=dtype)
    view = wide[:, 5 : 5 + vocab]  # rows 37 elements further apart than they are long
    assert torch.equal(cpu_ops.argmax_rows_cpu(view), argmax_rows_torch(view))
    column = randn(gen, rows, 1, dtype=dtype)
    assert torch.equal(cpu_ops.argmax_rows_cpu(column), torch.zeros(rows, dtype=torch.long))


@needs_cpu_ops
def test_cpu_argmax_rows_skips_nan_and_refuses_bad_shapes(gen: torch.Generator) -> None:
    x = randn(gen, 3, 500)
    x[0, 7] = float("nan")
    x[1] = float("nan")
    x[2, 400] = 1e30
    assert cpu_ops.argmax_rows_cpu(x).tolist() == [int(x[0].nan_to_num(-1e30).argmax()), 0, 400]
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_ops.argmax_rows_cpu(x.t())
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_ops.argmax_rows_cpu(x[0])


@needs_cpu_ops
def test_cpu_ops_refuse_mixed_or_other_dtypes(gen: torch.Generator) -> None:
    """A clear ValueError, never a kernel reading memory as the wrong type."""
    x = randn(gen, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight must be a torch.bfloat16"):
        cpu_ops.add_rms_norm_cpu(x, None, torch.ones(64), 1e-5, torch.empty_like(x))
    half = randn(gen, 4, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_ops.silu_mul_cpu(half, torch.empty(4, 64, dtype=torch.float16))


def test_cpu_ops_build_failure_leaves_the_torch_path(monkeypatch, tmp_path, caplog) -> None:
    """A compiler that fails gives None (and a warning), never an exception; ``auto`` then
    picks plain torch on the CPU."""
    from tokenq.engine.attention import resolve_backend

    monkeypatch.setenv("TOKENQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    cpu_ops.load.cache_clear()
    try:
        assert cpu_ops.load(build_dir()) is None
        assert "building CPU kernels failed" in caplog.text
        cpu = torch.device("cpu")
        assert resolve_backend("auto", cpu, torch.float32) == "torch"
    finally:
        cpu_ops.load.cache_clear()
    monkeypatch.undo()
    if cpu_ops.available(build_dir()):
        assert resolve_backend("auto", cpu, torch.float32) == "cpu"
        assert resolve_backend("auto", cpu, torch.bfloat16) == "cpu"
        assert resolve_backend("auto", cpu, torch.float16) == "torch"
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "triton"


@needs_cpu_ops
def test_cpu_kernel_bench_times_each_kernel_against_torch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``tokenq bench kernels --device cpu``: a row per dtype, op and shape, with both
    sides' times and their ratio."""
    from tokenq.bench.kernels import main as bench_kernels

    argv = ["--device", "cpu", "--decode-rows", "4", "--context", "40", "--prefill-rows", "24"]
    assert bench_kernels(argv, build_dir()) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    ops = ("add_rms_norm", "silu_mul", "rope", "paged_attention")
    expected = [
        (dtype, op, shape)
        for dtype in ("float32", "bfloat16")
        for shape in ("decode", "prefill")
        for op in ops
    ]
    assert [(r[0], r[1], r[2]) for r in rows] == expected
    for r in rows:
        c_us, torch_us, speedup = float(r[-3]), float(r[-2]), float(r[-1].rstrip("x"))
        # the ratio is printed to two decimals; its times to one
        ratio = torch_us / c_us
        assert c_us > 0 and torch_us > 0 and speedup == pytest.approx(ratio, rel=0.02, abs=0.006)
