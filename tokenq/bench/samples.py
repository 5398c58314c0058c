"""``tokenq bench samples``: one job of n outputs against n separate jobs of the same prompt
(prefix caching on, seeds seed + i: the same tokens), on fresh engines in one run: generated
tokens per second and the most KV blocks held at once, each side."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from tokenq.bench.common import add_engine_options, engine_from, warm_up
from tokenq.bench.invariance import cpu_name
from tokenq.engine import LLMEngine


@dataclass
class Side:
    name: str
    seconds: float
    tokens: int
    peak_blocks: int
    prompt_tokens: int  # prompt tokens the engine computed
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run(
    engine: LLMEngine, prompt: list[int], other: list[int], n: int, params: dict, together: bool
) -> Side:
    """The n outputs as one job (``together``) or as n jobs, all added at once; the engine
    warmed up on ``other``, a prompt of the same length that shares no block with it."""
    warm_up(engine, [other])
    engine.block_manager.reset_peak()
    computed = engine.counters["prompt_tokens"]
    start = time.perf_counter()
    if together:
        engine.add_request("together", prompt_token_ids=prompt, params={**params, "n": n})
    else:
        for i in range(n):
            own = {**params, "seed": params["seed"] + i}
            engine.add_request(f"alone-{i}", prompt_token_ids=prompt, params=own)
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if together and out.finished:
                outputs = {o.index: o.token_ids or [] for o in out.outputs or [out]}
            elif out.finished:
                outputs[int(out.request_id.removeprefix("alone-"))] = out.token_ids or []
    seconds = time.perf_counter() - start
    ids = [outputs[i] for i in range(n)]
    return Side(
        f"n={n} in one job" if together else f"{n} separate jobs",
        seconds,
        sum(map(len, ids)),
        engine.block_manager.peak_used_blocks,
        engine.counters["prompt_tokens"] - computed,
        ids,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tokenq bench samples", description=__doc__)
    add_engine_options(ap)
    ap.add_argument("--n", type=int, default=8, help="outputs of the prompt (default 8)")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens each (default 128)")
    args = ap.parse_args(argv)

    rng = random.Random(0)
    prompt, other = ([rng.randint(200, 40000) for _ in range(args.prompt_len)] for _ in "ab")
    params = {"temperature": 0.9, "seed": 0, "max_tokens": args.max_tokens, "ignore_eos": True}
    threads = args.num_threads or torch.get_num_threads()
    print(f"# {cpu_name()}; torch {torch.__version__}, {threads} threads")
    print(
        f"# a {args.prompt_len}-token prompt, {args.n} outputs of {args.max_tokens} tokens "
        "(temperature 0.9, seeds 0..n-1), prefix caching on; fresh engine each side"
    )
    print(f"{'side':<22}{'seconds':>9}{'tok/s':>9}{'prompt tok':>12}{'peak KV blocks':>16}")
    sides = []
    for together in (False, True):
        engine = engine_from(args, enable_prefix_caching=True)
        side = run(engine, prompt, other, args.n, params, together)
        del engine
        print(
            f"{side.name:<22}{side.seconds:>9.2f}{side.tokens_per_s:>9.1f}"
            f"{side.prompt_tokens:>12}{side.peak_blocks:>16}",
            flush=True,
        )
        sides.append(side)
    apart, one = sides
    same = "yes" if apart.outputs == one.outputs else "NO"
    ratio = one.tokens_per_s / apart.tokens_per_s
    print(f"# generated tokens/s, one job / separate jobs: {ratio:.2f}x; same tokens: {same}")
