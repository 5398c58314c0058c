"""``tokenq bench structured``: W1's shape (32 random prompts of 128 tokens, 128 tokens each)
with every request constrained to one of several JSON Schemas, against the same requests
unconstrained, in one run on one engine; then the mask time per step (p50/p99) and the
grammar compile time, cold and cached.

The schemas cannot be completed within 128 tokens (long arrays), so that both sides
generate exactly the same number of tokens and the ratio is throughput alone."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from tokenq.bench.common import add_engine_options, engine_config, warm_up
from tokenq.bench.engine import Workload, w1
from tokenq.engine.llm import LLM
from tokenq.engine.structured import GrammarCompiler
from tokenq.protocol.params import SamplingParams
from tokenq.protocol.structured import check

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["id", "name", "tags"],
    "additionalProperties": False,
}
# Several realistic shapes, each too long for 128 tokens.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "array", "items": ITEM, "minItems": 200},
    {"type": "array", "items": {"type": "integer"}, "minItems": 500},
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "rows": {"type": "array", "items": {"$ref": "#/$defs/row"}, "minItems": 200},
        },
        "required": ["title", "rows"],
        "$defs": {
            "row": {
                "type": "object",
                "properties": {
                    "when": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                    "amount": {"type": "number", "minimum": 0},
                    "kind": {"enum": ["debit", "credit"]},
                },
                "required": ["when", "amount", "kind"],
            }
        },
    },
    {"type": "array", "items": {"enum": ["yes", "no", "maybe"]}, "minItems": 300},
]


def run(llm: LLM, wl: Workload, constrained: bool) -> float:
    params = [
        SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=m,
            structured_outputs={"json": SCHEMAS[i % len(SCHEMAS)]} if constrained else None,
        )
        for i, m in enumerate(wl.max_tokens)
    ]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == wl.useful_tokens, [
        (o.outputs[0].finish_reason, o.error) for o in outs
    ]
    return elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tokenq bench structured", description=__doc__)
    add_engine_options(ap)
    ap.add_argument("--requests", type=int, default=32, help="W1's requests")
    ap.add_argument("--rounds", type=int, default=2, help="each side run this many times")
    args = ap.parse_args(argv)
    llm = LLM(**dataclasses.asdict(engine_config(args)))
    eng = llm.engine
    wl = w1(args.requests)
    print(
        f"# {wl.name}, {len(SCHEMAS)} JSON Schemas; {eng.device} "
        f"{str(eng.dtype).removeprefix('torch.')}, attention={eng.backend.name}",
        flush=True,
    )
    warm_up(eng, wl.prompts)
    run(llm, wl.warm_up(), constrained=True)  # compiles the schemas once
    stats = eng.grammars.stats
    stats.mask.clear()
    plain_s, constrained_s = [], []
    for _ in range(args.rounds):  # alternated, so that a loaded machine burdens both
        plain_s.append(run(llm, wl, constrained=False))
        constrained_s.append(run(llm, wl, constrained=True))
    plain = wl.useful_tokens / min(plain_s)
    ours = wl.useful_tokens / min(constrained_s)
    print(f"{'side':<16}{'tokens':>8}{'tok/s':>10}")
    print(f"{'unconstrained':<16}{wl.useful_tokens:>8}{plain:>10.1f}")
    print(f"{'constrained':<16}{wl.useful_tokens:>8}{ours:>10.1f}")
    print(f"ratio constrained/unconstrained: {ours / plain:.2f}x (best of {args.rounds} each)")
    masks = list(stats.mask)
    print(
        f"mask time per step ({args.requests} constrained rows, {len(masks)} steps): "
        f"p50 {ms(percentile(masks, 0.5))}, p99 {ms(percentile(masks, 0.99))}, "
        f"mean {ms(statistics.fmean(masks))}"
    )
    compiler = GrammarCompiler(eng.tokenizer, eng.model_config.vocab_size)
    start = time.perf_counter()
    _ = compiler.lltokenizer  # built once per engine, not per grammar: timed apart
    print(f"llguidance tokenizer, once per engine: {ms(time.perf_counter() - start)}")
    specs = [check({"json": s}) for s in SCHEMAS]
    for spec in specs + specs:
        compiler.matcher(spec)
    cold, cached = list(compiler.stats.compile_cold), list(compiler.stats.compile_cached)
    print(
        f"compile per schema: cold median {ms(statistics.median(cold))} "
        f"(max {ms(max(cold))}), cached median {ms(statistics.median(cached))}"
    )
    compiler.close()
