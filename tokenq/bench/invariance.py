"""`tokenq bench invariance`: greedy tokens of prompts run as one batch against each prompt
alone, per dtype. A job resumed after a crash or preemption continues in another batch, so it
equals an uninterrupted run only where batched and lone outputs agree."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenq.bench.common import GREEDY, add_engine_options, engine_config, engine_from, generate
from tokenq.kernels.cpu_features import BF16_FLAGS, cpu_flags

DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class Comparison:
    dtype: str  # as asked
    computed: str  # what the engine computed in (auto's choice)
    first_differences: dict[int, int]  # prompt index -> first token index that differs
    prompts: int


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two differ (a length counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def make_prompts(n: int, shortest: int, longest: int, seed: int = 0) -> list[list[int]]:
    """Random token ids of mixed lengths, so the batch's prefill chunks mix prompts."""
    rng = random.Random(seed)
    lengths = [rng.randint(shortest, longest) for _ in range(n)]
    return [[rng.randint(200, 40000) for _ in range(length)] for length in lengths]


def compare(args: argparse.Namespace, dtype: str, prompts: list[list[int]]) -> Comparison:
    engine = engine_from(args, dtype=dtype)
    params = {**GREEDY, "max_tokens": args.max_tokens}
    batched = generate(engine, prompts, params)
    alone = [generate(engine, [prompt], params)[0] for prompt in prompts]
    firsts = {}
    for i, (b, a) in enumerate(zip(batched, alone, strict=True)):
        index = first_difference(b, a)
        if index is not None:
            firsts[i] = index
    computed = str(engine.dtype).removeprefix("torch.")
    return Comparison(dtype, computed, firsts, len(prompts))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tokenq bench invariance", description=__doc__)
    add_engine_options(ap, skip=("dtype",))
    ap.add_argument(
        "--dtype",
        nargs="+",
        choices=DTYPES,
        default=["float32", "bfloat16"],
        help="each compared in turn (default float32 bfloat16); auto: the engine's choice here",
    )
    ap.add_argument("--prompts", type=int, default=32, help="prompts in the batch")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens each (EOS ignored)")
    ap.add_argument(
        "--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"),
        help="prompt lengths drawn from this range",
    )  # fmt: skip
    args = ap.parse_args(argv)

    flags = cpu_flags()
    has = ", ".join(f"{flag}: {'yes' if flag in flags else 'no'}" for flag in BF16_FLAGS)
    config = engine_config(args)
    device = config.resolved_device()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    threads = config.num_threads or torch.get_num_threads()
    threads_used = f"{threads} thread{'s' if threads > 1 else ''}"
    print(f"# {cpu_name()} ({has}); on {where}, torch {torch.__version__}, {threads_used}")
    print(
        f"# {config.model}: {args.prompts} prompts of {args.prompt_len[0]}-{args.prompt_len[1]} "
        f"random tokens, {args.max_tokens} tokens each, greedy, EOS ignored; all at once "
        f"(max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
        f"{config.max_num_batched_tokens}) against each alone"
    )
    print(f"{'dtype':<22}{'differing':>10}  first differing token (prompt: index)", flush=True)
    prompts = make_prompts(args.prompts, *args.prompt_len)
    for dtype in args.dtype:
        row = compare(args, dtype, prompts)
        name = row.dtype if row.dtype == row.computed else f"{row.dtype} ({row.computed})"
        firsts = ", ".join(f"{p}: {i}" for p, i in row.first_differences.items()) or "-"
        count = f"{len(row.first_differences)}/{row.prompts}"
        print(f"{name:<22}{count:>10}  {firsts}", flush=True)
