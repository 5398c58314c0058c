"""``tokenq bench kernels``: on a GPU, decode attention's K/V bytes read per second against
a plain ``copy_`` (it is bandwidth-bound); on the CPU, each C kernel against torch's ops."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from tokenq.kernels.paged_attention import choose_num_splits, paged_attention_triton
from tokenq.kernels.reference import paged_attention_torch

_COPY_BYTES = 1 << 30
_NO_CUDA = "tokenq.bench.kernels needs a CUDA device: the Triton kernels are GPU-only"


def _time_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a large device-to-device ``copy_`` moves (read plus write)."""
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * _COPY_BYTES / (_time_ms(lambda: dst.copy_(src)) * 1e-3)


def run_kernel_bench(
    batch: int = 64,
    context: int = 4096,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict[str, float | str]]:
    """One decode step's attention timed per backend, printed and returned; blocks shuffled,
    as after a while of serving, so reads scatter as in production."""
    if not torch.cuda.is_available():
        raise RuntimeError(_NO_CUDA)

    device = torch.device("cuda")
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, head_dim**-0.5, out)
    hints = {"max_query_len": 1, "max_seq_len": context}

    auto = choose_num_splits(batch, num_kv_heads, context, device)
    cases = {f"triton auto ({auto} splits)": {}}
    cases.update({f"triton {n} splits": {"num_splits": n} for n in (1, 2, 4, 8)})
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * k_cache.element_size()
    copy_bw = copy_bandwidth(device)
    rows: list[dict[str, float | str]] = []
    for name, extra in cases.items():
        ms = _time_ms(lambda extra=extra: paged_attention_triton(*args, **hints, **extra))
        rows.append({"backend": name, "ms": ms})
    reference_ms = _time_ms(lambda: paged_attention_torch(*args))
    rows.append({"backend": "torch reference", "ms": reference_ms})
    for row in rows:
        row["kv_gb_s"] = kv_bytes / (row["ms"] * 1e-3) / 1e9
        row["of_copy_bw"] = row["kv_gb_s"] * 1e9 / copy_bw

    print(
        f"decode attention on {torch.cuda.get_device_name(device)}: batch {batch}, "
        f"context {context}, {num_heads}/{num_kv_heads} heads, head_dim {head_dim}, "
        f"block {block_size}, {dtype}; K/V {kv_bytes / 1e9:.2f} GB per call; "
        f"copy_ bandwidth (read + write) {copy_bw / 1e9:.0f} GB/s"
    )
    print(f"{'backend':<26}{'ms':>9}{'K/V GB/s':>11}{'of copy':>9}")
    for row in rows:
        print(
            f"{row['backend']:<26}{row['ms']:>9.3f}{row['kv_gb_s']:>11.0f}{row['of_copy_bw']:>9.0%}"
        )
    return rows


def main(argv: list[str], build_dir: Path | None = None) -> int:
    """``build_dir``: where the C kernels are built (default: the engine's)."""
    ap = argparse.ArgumentParser(prog="tokenq bench kernels", description=__doc__, add_help=False)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    args, rest = ap.parse_known_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the CPU table's parser takes the rest, --help included
        from tokenq.bench.kernels_cpu import main as bench_cpu
        from tokenq.engine.downloads import build_dir as engine_build_dir

        return bench_cpu(rest, build_dir or engine_build_dir())
    ap.add_argument("-h", "--help", action="help", help="show this help message and exit")
    ap.parse_args(argv)  # the GPU table takes no other options
    if not torch.cuda.is_available():
        print(f"error: {_NO_CUDA}", file=sys.stderr)
        return 1
    run_kernel_bench()
    return 0
