"""Structured outputs inside the engine: grammars compiled off the engine's thread and
cached, one llguidance matcher per constrained output (n for a request of n), and the token
masks of a step filled on a thread while its forward pass runs (llguidance releases the
GIL)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy as llnp
import numpy as np
import torch

from tokenq.engine.tokenizer import Tokenizer
from tokenq.protocol.errors import InvalidRequest, clip
from tokenq.protocol.structured import digest, grammar_text

_SHIFTS = torch.arange(32, dtype=torch.int32)


# Engine counters this module keeps (whole microseconds for times: counters are ints).
COUNTERS = (
    "structured_compile_cold", "structured_compile_cold_us",
    "structured_compile_cached", "structured_compile_cached_us",
    "structured_mask_steps", "structured_mask_us",
)  # fmt: skip
_SAMPLES = 100_000  # recent timings kept for percentiles (`tokenq bench structured`)


@dataclass
class StructuredStats:
    """What structured outputs cost: totals in the engine's counters (the worker's metrics
    read them), recent samples in seconds for percentiles. Written by the compile and mask
    threads, each its own keys, all present from the start (a dict copied by another
    thread must not grow meanwhile)."""

    counters: Counter[str] = field(default_factory=Counter)
    compile_cold: deque[float] = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    compile_cached: deque[float] = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    mask: deque[float] = field(default_factory=lambda: deque(maxlen=_SAMPLES))

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.counters.setdefault(name, 0)

    def compiled(self, seconds: float, cached: bool) -> None:
        kind = "cached" if cached else "cold"
        (self.compile_cached if cached else self.compile_cold).append(seconds)
        self.counters[f"structured_compile_{kind}"] += 1
        self.counters[f"structured_compile_{kind}_us"] += round(seconds * 1e6)

    def masked(self, seconds: float) -> None:
        self.mask.append(seconds)
        self.counters["structured_mask_steps"] += 1
        self.counters["structured_mask_us"] += round(seconds * 1e6)


class GrammarCompiler:
    """Builds a request's matcher on its own thread. A compiled grammar is kept as a template
    matcher, in an LRU cache of ``cache_size`` entries keyed by (spec digest, tokenizer), and
    each request gets a copy of it. The llguidance tokenizer (about 0.4 s to build for a 49k
    vocabulary) is built once, on that thread, on first use."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        cache_size: int = 256,
        stats: StructuredStats | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._ll_key = ""
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenq-grammar")
        self.stats = stats or StructuredStats()

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            text = self._tokenizer.backend.to_str()
            self._ll_key = hashlib.sha256(text.encode()).hexdigest()[:16]
            self._ll = llguidance.LLTokenizer(
                text, n_vocab=self._vocab_size, eos_token=self._tokenizer.eos_token_ids
            )
        return self._ll

    def submit(self, spec: dict) -> Future[llguidance.LLMatcher]:
        return self._pool.submit(self.matcher, spec)

    def matcher(self, spec: dict) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``; raises ``InvalidRequest`` if it does not compile."""
        start = time.perf_counter()
        tok = self.lltokenizer
        key = (digest(spec), self._ll_key)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is not None:
            matcher = template.deep_copy()
            self.stats.compiled(time.perf_counter() - start, cached=True)
            return matcher
        template = llguidance.LLMatcher(tok, grammar_text(spec), log_level=0)
        if template.is_error():
            (kind,) = spec
            why = clip(template.get_error(), 300)
            raise InvalidRequest(
                "invalid_params",
                f"structured_outputs.{kind} does not compile: {why}",
                "structured_outputs",
            )
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self.stats.compiled(time.perf_counter() - start, cached=False)
        return template.deep_copy()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class MaskFiller:
    """The masks of a step's constrained rows, filled by llguidance on a thread of its own
    while the forward pass runs, then turned into boolean rows over the logits."""

    def __init__(self, vocab_size: int, stats: StructuredStats) -> None:
        self.vocab_size = vocab_size
        self.stats = stats
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenq-masks")

    def start(self, matchers: list[llguidance.LLMatcher | None]) -> Future[np.ndarray] | None:
        """Begin filling the masks of ``matchers`` (one row each; None rows stay open)."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        return self._pool.submit(self._fill, rows, len(matchers))

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]], n: int) -> np.ndarray:
        start = time.perf_counter()
        bitmask = llnp.allocate_token_bitmask(n, self.vocab_size)
        for matcher, i in rows:
            llnp.fill_next_token_bitmask(matcher, bitmask, i)
        self.stats.masked(time.perf_counter() - start)
        return bitmask

    def allowed(
        self, pending: Future[np.ndarray] | None, matchers: list[llguidance.LLMatcher | None]
    ) -> list[torch.Tensor | None]:
        """Each row's allowed tokens as a bool row (None: unconstrained). Rows that joined
        the pass after ``start`` (``matchers`` grew) are filled now."""
        if not any(m is not None for m in matchers):
            return [None] * len(matchers)
        bitmask = pending.result() if pending is not None else None
        done = 0 if bitmask is None else bitmask.shape[0]
        late = [m if i >= done else None for i, m in enumerate(matchers)]
        if any(m is not None for m in late):
            extra = self._fill([(m, i) for i, m in enumerate(late) if m is not None], len(late))
            bitmask = extra if bitmask is None else np.concatenate([bitmask, extra[done:]])
        bits = torch.from_numpy(bitmask).unsqueeze(-1).bitwise_right_shift(_SHIFTS) & 1
        rows = bits.reshape(bits.shape[0], -1)[:, : self.vocab_size].bool()
        return [rows[i] if m is not None else None for i, m in enumerate(matchers)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
