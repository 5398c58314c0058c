"""Each C kernel against the torch ops it replaces, per dtype, at the default model's shapes:
a C kernel exists only because it beats torch (a gcc once made silu_mul ten times slower)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenq.kernels import cpu_ops, reference


def _time_us(fn: Callable[[], object], budget_s: float = 0.2) -> float:
    """Median microseconds per call over about ``budget_s`` of calls, after a warm-up."""
    fn()
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 1000):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _cases(
    rows: int, context: int, dtype: torch.dtype, hidden: int, inter: int, heads: int,
    kv_heads: int, head_dim: int, block: int = 16,
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:  # fmt: skip
    """Each op's (C, torch) calls on fresh random inputs: ``rows`` tokens, each attending
    to ``context`` keys (decode: rows sequences of one token; prefill: one sequence)."""
    r = torch.randn
    x, delta, w = r(rows, hidden, dtype=dtype), r(rows, hidden, dtype=dtype), r(hidden).to(dtype)
    normed = torch.empty_like(x)
    gate_up, act = r(rows, 2 * inter, dtype=dtype), torch.empty(rows, inter, dtype=dtype)
    qkv = r(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.randint(0, 4096, (rows,))
    angles = torch.randn(4096, head_dim // 2).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    decode = context > rows  # every row its own sequence
    seqs = rows if decode else 1
    blocks_per_seq = -(-context // block)
    kv_shape = (seqs * blocks_per_seq + 1, block, kv_heads, head_dim)
    k_cache, v_cache = r(kv_shape, dtype=dtype), r(kv_shape, dtype=dtype)
    # Shuffled blocks, as after a while of serving (block 0 stays the engine's spare).
    block_tables = (torch.randperm(seqs * blocks_per_seq) + 1).to(torch.int32)
    block_tables = block_tables.view(seqs, blocks_per_seq)
    q = r(rows, heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    if decode:
        cu = torch.arange(rows + 1, dtype=torch.int32)
    else:
        cu = torch.tensor([0, rows], dtype=torch.int32)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    plan = reference.plan_attention_torch(cu, seq_lens, block_tables, block)
    attn = (q, k_cache, v_cache, cu, seq_lens, block_tables, head_dim**-0.5)
    return {
        "add_rms_norm": (
            lambda: cpu_ops.add_rms_norm_cpu(x, delta, w, 1e-5, normed),
            lambda: reference.add_rms_norm_torch(x, delta, w, 1e-5, normed),
        ),
        "silu_mul": (
            lambda: cpu_ops.silu_mul_cpu(gate_up, act),
            lambda: reference.silu_mul_torch(gate_up, act),
        ),
        "rope": (
            lambda: cpu_ops.rope_cpu(qkv, heads + kv_heads, head_dim, positions, cos, sin),
            lambda: reference.rope_torch(qkv, heads + kv_heads, head_dim, positions, cos, sin),
        ),
        "paged_attention": (
            lambda: cpu_ops.paged_attention_cpu(*attn, out),
            lambda: reference.paged_attention_torch(*attn, out, plan),
        ),
    }


def main(argv: list[str], build_dir: Path) -> int:
    """``build_dir``: where the engine keeps its build of the C kernels (built if absent)."""
    ap = argparse.ArgumentParser(prog="tokenq bench kernels --device cpu", description=__doc__)
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--decode-rows", type=int, default=32, help="sequences in a decode step")
    ap.add_argument("--context", type=int, default=256, help="keys each decode row reads")
    ap.add_argument("--prefill-rows", type=int, default=512, help="tokens in a prefill chunk")
    args = ap.parse_args(argv)
    names = [name.strip() for name in args.dtype.split(",")]
    for name in names:
        if name not in ("float32", "bfloat16"):
            ap.error(f"--dtype: the C kernels run float32 and bfloat16, not {name!r}")
    if cpu_ops.load(build_dir) is None:
        print("tokenq bench kernels: the C kernels could not be built (see the log)")
        return 1
    dims = {"hidden": 576, "inter": 1536, "heads": 9, "kv_heads": 3, "head_dim": 64}
    print(f"# CPU, {torch.get_num_threads()} threads; torch {torch.__version__}; {dims}")
    print(f"{'dtype':<10}{'op':<17}{'shape':<22}{'C us':>10}{'torch us':>10}{'speedup':>9}")
    for name in names:
        dtype = getattr(torch, name)
        shapes = {
            f"decode {args.decode_rows}x{args.context}": (args.decode_rows, args.context),
            f"prefill {args.prefill_rows}": (args.prefill_rows, args.prefill_rows),
        }
        for label, (rows, context) in shapes.items():
            for op, (ours, ref) in _cases(rows, context, dtype, **dims).items():
                c_us, torch_us = _time_us(ours), _time_us(ref)
                print(
                    f"{name:<10}{op:<17}{label:<22}{c_us:>10.1f}{torch_us:>10.1f}"
                    f"{torch_us / c_us:>8.2f}x",
                    flush=True,
                )
    return 0
