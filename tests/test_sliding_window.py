"""Sliding-window attention in every kernel (torch, C, Triton) against a dense float64
computation, and the blocks the engine frees once every layer has left them behind."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests import test_kernels  # noqa: E402
from tests.test_kernels import DEVICE, Batch, make_batch, mixed, rel_err  # noqa: E402
from tokenq.engine.block_manager import FREED, BlockManager  # noqa: E402
from tokenq.engine.downloads import build_dir  # noqa: E402
from tokenq.engine.scheduler import Scheduler  # noqa: E402
from tokenq.engine.sequence import Sequence  # noqa: E402
from tokenq.kernels import cpu_ops  # noqa: E402
from tokenq.kernels.paged_attention import paged_attention_triton  # noqa: E402
from tokenq.kernels.reference import paged_attention_torch, plan_attention_torch  # noqa: E402
from tokenq.protocol.params import SamplingParams  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernel reads CPU tensors: its inputs are made on the CPU on a GPU host too."""
    monkeypatch.setattr(test_kernels, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(sys.modules[__name__], "DEVICE", torch.device("cpu"))


@pytest.fixture
def gen() -> torch.Generator:
    seed = time.time_ns() % 2**31
    print(f"seed={seed}")  # shown by pytest only when the test fails
    return torch.Generator().manual_seed(seed)


def dense_window_attention(batch: Batch, window: int) -> torch.Tensor:
    """Each sequence's keys gathered by position and attended with an explicit mask, in
    float64: what a query at position p sees is p - window < k <= p."""
    out = torch.zeros(batch.q.shape, dtype=torch.float64, device=DEVICE)
    bs = batch.k_cache.shape[1]
    cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    for i, seq_len in enumerate(lens):
        pos = torch.arange(seq_len, device=DEVICE)
        slots = batch.block_tables[i].long()[pos // bs] * bs + pos % bs
        k = batch.k_cache.reshape(-1, *batch.k_cache.shape[2:])[slots].double()
        v = batch.v_cache.reshape(-1, *batch.v_cache.shape[2:])[slots].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, h, d]
        q = batch.q[cu[i] : cu[i + 1]].double()  # [n, h, d]
        qpos = torch.arange(seq_len - len(q), seq_len, device=DEVICE)
        visible = (pos[None, :] <= qpos[:, None]) & (pos[None, :] > qpos[:, None] - window)
        scores = torch.einsum("nhd,lhd->hnl", q, k) * batch.scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[cu[i] : cu[i + 1]] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out


def windowed_batch(
    gen: torch.Generator, window: int, seqs: list[tuple[int, int]] | None = None, **shape
) -> tuple[Batch, torch.Tensor]:
    """A mixed batch whose blocks that lie wholly before all of a sequence's windows point at
    a block of NaN (a kernel that reads one shows it in its output), and the expected output,
    computed before they were."""
    if seqs is None:
        seqs = [*mixed(shape["block_size"]), (1, 300), (64, 300), (5, window + 5)]
    batch = make_batch(gen, seqs, **shape)
    expected = dense_window_attention(batch, window)
    poison = batch.k_cache.shape[0]
    nan = torch.full_like(batch.k_cache[:1], float("nan"))
    batch.k_cache = torch.cat([batch.k_cache, nan])
    batch.v_cache = torch.cat([batch.v_cache, nan])
    bs = shape["block_size"]
    cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        first_query = seq_len - (cu[i + 1] - cu[i])
        batch.block_tables[i, : max(0, first_query - window + 1) // bs] = poison
    return batch, expected


SHAPES = [(2, 4, 64, 16), (1, 3, 128, 32), (2, 2, 40, 16), (3, 1, 64, 1)]
WINDOWS = [1, 16, 45]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kvh{}-g{}-d{}-bs{}".format(*s))
def test_torch_reference_attends_within_the_window(gen, shape, window) -> None:
    kvh, group, head_dim, block_size = shape
    batch, expected = windowed_batch(
        gen, window, num_kv_heads=kvh, group=group, head_dim=head_dim, block_size=block_size
    )
    plan = plan_attention_torch(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, block_size)
    for _ in range(2):  # the second call takes the plan's cached window views
        out = paged_attention_torch(*batch.args(), plan=plan, window=window)
        assert not out.isnan().any(), "read a block before the window"
        assert rel_err(out, expected) < 1e-5


@pytest.mark.skipif(not cpu_ops.available(build_dir()), reason="no C compiler")
@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kvh{}-g{}-d{}-bs{}".format(*s))
def test_c_kernel_attends_within_the_window(gen, shape, window) -> None:
    kvh, group, head_dim, block_size = shape
    batch, expected = windowed_batch(
        gen, window, num_kv_heads=kvh, group=group, head_dim=head_dim, block_size=block_size
    )
    out = torch.full_like(batch.q, float("nan"))
    cpu_ops.paged_attention_cpu(*batch.args(), out=out, window=window)
    assert not out.isnan().any(), "read a block before the window, or left rows unwritten"
    assert rel_err(out, expected) < 1e-5


def test_triton_kernel_attends_within_the_window(gen) -> None:
    """A small batch (the interpreter is slow on a CPU), with and without a KV split."""
    window = 7
    seqs = [(1, 100), (19, 60), (1, 1), (5, window + 5)]
    batch, expected = windowed_batch(
        gen, window, seqs, num_kv_heads=2, group=4, head_dim=64, block_size=16
    )
    for num_splits in (None, 3):
        out = torch.full_like(batch.q, float("nan"))
        paged_attention_triton(*batch.args(), out, num_splits=num_splits, window=window)
        assert not out.isnan().any(), "read a block before the window, or left rows unwritten"
        assert rel_err(out, expected) < 1e-5


# -- the scheduler: blocks every layer has left behind go back to the pool -----------------


def test_blocks_before_every_window_are_freed_and_the_rest_kept() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, kv_window=6)
    seq = Sequence("a", list(range(30)), SamplingParams(max_tokens=50))
    sched.add(seq)
    held = []
    while seq.num_computed_tokens < seq.num_tokens:
        out = sched.schedule()
        sched.commit(out.scheduled)
        held.append(bm.num_blocks - bm.num_free_blocks)
        next_pos = seq.num_computed_tokens  # the next token sees keys > next_pos - 6
        table = seq.block_table
        for b, block in enumerate(table):
            before_window = (b + 1) * 4 <= next_pos - 6 + 1
            last_full = b == next_pos // 4 - 1
            assert (block == FREED) == (before_window and not last_full), (b, table)
    # 30 tokens in 4 chunks; the window and the chunk in flight bound what is held
    assert max(held) <= 5 and bm.num_blocks - bm.num_free_blocks == len(
        [b for b in seq.block_table if b != FREED]
    )
    sched.remove(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_preempted_request_with_freed_blocks_frees_the_rest_once() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, kv_window=8)
    seqs = [Sequence(str(i), list(range(20)), SamplingParams(max_tokens=9)) for i in range(3)]
    for i, s in enumerate(seqs):
        s.arrival_order = i
        sched.add(s)
    preempted = 0
    for _ in range(200):
        out = sched.schedule()
        preempted += len(out.preempted)
        sched.commit(out.scheduled)
        for s in out.scheduled:
            if s.samples:
                s.seq.append_token(7)
                if s.seq.num_output_tokens == 9:
                    sched.remove(s.seq)
        held = sum(len([b for b in s.block_table if b != FREED]) for s in sched.running)
        assert bm.num_blocks - bm.num_free_blocks == held
        if not sched.running and not sched.waiting:
            break
    assert preempted > 0 and bm.num_free_blocks == bm.num_blocks
