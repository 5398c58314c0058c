"""The worker's heap, made static once it has started.

A process that imported torch, transformers, a tokenizer and redis-py holds hundreds of
thousands of objects that live as long as it does, and the interpreter's oldest-generation
collection walks all of them: measured on the project's CPU machine, about 120 ms in the
engine's process and 25 ms in the queue process, run whenever enough objects have
survived since the last one. In the queue process one came with the first jobs taken
after the start, every time, and held their first tokens back by as long; in the engine's
process it would stop a step. Frozen, those objects are never walked again: a collection
only looks at what was made since, and takes well under a millisecond.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once, then leave everything alive now out of later collections, until the
    block ends (a test process runs many workers: their leftovers are collected again)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
