"""The worker's heap, made static once it has started.

The hundreds of thousands of objects that torch, a tokenizer and redis-py leave alive are
walked by every oldest-generation collection: about 120 ms in the engine's process and
25 ms in the queue process (the project's CPU machine), a step stopped or first tokens
held back. Frozen, they are never walked again, and a collection takes under 1 ms.
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
