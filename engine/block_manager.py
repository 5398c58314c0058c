"""The paged KV pool's bookkeeping: which physical block holds which tokens of whom.

Blocks are fixed-size pages of the preallocated cache. A request owns a block table (a
list of block ids in position order, any ids at all), so its pages need not be adjacent.
Every operation is O(1) per block touched: free blocks sit in an insertion-ordered dict
(allocate from the front, free to the back), never a scan over the pool.

Prefix caching: a full block is named by a SHA-256 digest of the previous block's digest and
its own token ids, so a name stands for every token from the start of the sequence to the
end of the block. A freed block keeps its name until it is handed out again, so a later
request with the same prefix picks the block back up and skips that part of its prefill.
The digest is cryptographic because requests of different users share the cache: with a
hash anyone can collide on purpose (Python's ``hash`` of a tuple of ints), a crafted prompt
would be served the KV cache of another user's prefix: wrong output, and a leak.

Sliding-window models: once every layer's window has moved past a block, the block goes back
to the pool and its table entry becomes ``FREED`` (tables stay indexed by position). The
freed entries are always a prefix of the table.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from tokenq.engine.sequence import Sequence

# A block table entry whose block was given back: every layer has left it behind.
FREED = -1


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # the prefix digest, once the block is full and computed


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # prefix digest -> block id
        self.num_cache_hit_tokens = 0
        # (source, destination) block pairs whose K/V the next pass must copy first
        self.copies: list[tuple[int, int]] = []
        self.peak_used_blocks = 0  # the most blocks held at once (``reset_peak`` restarts)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def reset_peak(self) -> None:
        self.peak_used_blocks = self.num_blocks - len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def chain_hash(parent: bytes | None, tokens: list[int]) -> bytes:
        """The digest of a block: its parent's digest (none for the first block) followed by
        its token ids as 64-bit integers. A fixed-size parent digest and fixed-size ids make
        the encoding unambiguous, so equal digests mean equal prefixes."""
        h = hashlib.sha256(parent or b"")
        h.update(struct.pack(f"<{len(tokens)}q", *tokens))
        return h.digest()

    # -- allocation -------------------------------------------------------------------

    def _take_free(self) -> int:
        block_id = next(iter(self.free))
        del self.free[block_id]
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.ref_count = None, 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - len(self.free))
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
            self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - len(self.free))
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed more often than taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq`` (never its last token: its logits are
        needed, so at least one token is always left to compute)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        digest: bytes | None = None
        bs = self.block_size
        for start in range(0, seq.num_tokens - 1 - bs + 1, bs):
            digest = self.chain_hash(digest, seq.token_ids[start : start + bs])
            block_id = self.cached.get(digest)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(
        self,
        num_new_blocks: int,
        reusable: list[int] = (),
        released: Mapping[int, int] | None = None,
    ) -> bool:
        """Whether ``num_new_blocks`` fresh blocks can be had after taking ``reusable``
        cached blocks (some of which may sit in the free list and would leave it), once
        the references in ``released`` (block id -> how many) are dropped. A block is free
        only when its last reference goes: one shared with a request that stays is not."""
        released = released or {}

        def free_after(block_id: int) -> bool:
            return self.blocks[block_id].ref_count == released.get(block_id, 0)

        freed = sum(1 for b in released if free_after(b))
        taken_from_free = sum(1 for b in reusable if free_after(b))
        return num_new_blocks <= len(self.free) + freed - taken_from_free

    def allocate_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Start ``seq`` on its cached prefix blocks: their tokens count as computed."""
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.num_cache_hit_tokens += seq.num_computed_tokens

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens; False (and no change)
        when the pool has too few free blocks. A partial block shared with a forked output
        is copied first (copy on write): the next pass writes into it."""
        shared = self._shared_partial(seq)
        need = max(0, self.blocks_needed(num_tokens) - len(seq.block_table)) + (shared is not None)
        if need == 0:
            return True
        if need > len(self.free):
            return False
        if shared is not None:
            copy = self._take_free()
            self.copies.append((seq.block_table[shared], copy))
            self._unref(seq.block_table[shared])
            seq.block_table[shared] = copy
        seq.block_table.extend(self._take_free() for _ in range(need - (shared is not None)))
        return True

    def _shared_partial(self, seq: Sequence) -> int | None:
        """The table index of the block the next token goes into, if it is partly filled
        and another output of the same prompt holds it too."""
        computed = seq.num_computed_tokens
        i = computed // self.block_size
        if computed % self.block_size == 0 or i >= len(seq.block_table):
            return None
        return i if self.blocks[seq.block_table[i]].ref_count > 1 else None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (the prompt's), by reference."""
        for block_id in parent.block_table:
            if block_id != FREED:
                self._ref(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def free_seq(self, seq: Sequence) -> None:
        """Release a request's blocks; the last-freed are reused last, keeping the deepest
        prefix blocks cached the longest."""
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._unref(block_id)
        seq.block_table = []

    def free_left_behind(self, seq: Sequence, oldest_needed: int) -> None:
        """Release the blocks of ``seq`` that lie wholly before token ``oldest_needed`` (the
        oldest key any layer will read again), but for its last full block, whose digest
        the next full block's names as its parent. Walks back from the newest such block to
        the first one already freed, so each step touches only what it frees."""
        bs = self.block_size
        table = seq.block_table
        i = min(oldest_needed // bs, seq.num_computed_tokens // bs - 1) - 1
        while i >= 0 and table[i] != FREED:
            self._unref(table[i])
            table[i] = FREED
            i -= 1

    def commit_full_blocks(self, seq: Sequence, prev_computed: int) -> None:
        """Name the blocks that became full of computed tokens in the last step."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first = prev_computed // bs
        last = seq.num_computed_tokens // bs  # blocks [first, last) are now full
        parent = self.blocks[seq.block_table[first - 1]].hash if first > 0 else None
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = self.chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
                self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash
