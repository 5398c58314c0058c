"""What every benchmark that runs an engine shares: the engine's flags (`tokenq worker`'s,
so one command line picks the same engine in each) and the warm-up before any clock starts."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from tokenq.cli.worker import ENGINE_OPTIONS
from tokenq.engine.config import EngineConfig

if TYPE_CHECKING:
    from tokenq.engine import LLMEngine

GREEDY = {"temperature": 0.0, "ignore_eos": True}
WARM_UP = {**GREEDY, "max_tokens": 2}  # a prefill and a decode step at every shape
_calls = itertools.count()


def add_engine_options(ap: argparse.ArgumentParser, *, skip: Collection[str] = ()) -> None:
    """`tokenq worker`'s engine flags, less `skip` (a benchmark's own, such as a --dtype
    that takes several)."""
    names = tuple(name for name in ENGINE_OPTIONS if name not in skip)
    for name in names:
        parse, help = ENGINE_OPTIONS[name]
        default = getattr(EngineConfig, name)
        ap.add_argument(
            "--" + name.replace("_", "-"), type=parse, help=f"{help} (default {default})"
        )
    ap.set_defaults(engine_options=names)


def add_warm_up_option(ap: argparse.ArgumentParser) -> None:
    """`--no-warm-up`, for smoke runs (the tests'): every step is still taken once, timed,
    so the figures then include each shape's first-step costs."""
    ap.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="skip the warm-up runs (a smoke test: the figures then count first steps)",
    )


def engine_config(args: argparse.Namespace, **options: Any) -> EngineConfig:
    """The engine of the flags given, then `options` (any EngineConfig field). Prefix
    caching is off: a benchmark sends the same prompts more than once (warm-up, repeats),
    and a run reusing an earlier run's cache would measure less work."""
    given = {n: getattr(args, n) for n in args.engine_options if getattr(args, n) is not None}
    return EngineConfig(**{**given, "enable_prefix_caching": False, **options})


def engine_from(args: argparse.Namespace, **options: Any) -> LLMEngine:
    from tokenq.engine import LLMEngine

    return LLMEngine(engine_config(args, **options))


def generate(
    engine: LLMEngine, prompts: Sequence[list[int]], params: dict[str, Any]
) -> list[list[int]]:
    """Every prompt at once straight into the engine, stepped until none is left; each
    one's generated token ids, in order."""
    call = next(_calls)
    ids = [f"bench-{call}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt_token_ids=prompt, params=dict(params))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                done[out.request_id] = out.token_ids or []
    return [done[rid] for rid in ids]


def warm_up(engine: LLMEngine, prompts: Sequence[list[int]]) -> None:
    """Each prompt for two tokens, so that no clock counts a process's first steps at each
    shape (oneDNN picks and builds its kernels per shape, the allocator grows)."""
    generate(engine, prompts, WARM_UP)
