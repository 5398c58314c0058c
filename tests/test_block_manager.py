"""Properties of the paged KV pool's bookkeeping, driven by random operation sequences."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenq.engine.block_manager import BlockManager
from tokenq.engine.sequence import Sequence
from tokenq.protocol.params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 12


def make_seq(tokens: list[int], n: int = 0) -> Sequence:
    return Sequence(request_id=f"r{n}", prompt_token_ids=tokens, params=SamplingParams())


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.live: list[Sequence] = []
        self.counter = 0

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def admit(self, tokens: list[int]) -> None:
        seq = make_seq(tokens, self.counter)
        self.counter += 1
        hits = self.bm.match_prefix(seq)
        computed = len(hits) * BLOCK
        need = self.bm.blocks_needed(seq.num_tokens) - len(hits)
        if not self.bm.can_allocate(need, hits):
            return
        free_before = self.bm.num_free_blocks
        self.bm.allocate_prefix(seq, hits)
        assert self.bm.grow(seq, seq.num_tokens)
        taken = free_before - self.bm.num_free_blocks
        assert taken <= len(seq.block_table)
        prev = computed
        seq.num_computed_tokens = seq.num_tokens
        self.bm.commit_full_blocks(seq, prev)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(1, 6))
    def extend(self, data: st.DataObject, extra: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        before = list(seq.block_table)
        if self.bm.grow(seq, seq.num_tokens + extra):
            for t in range(extra):
                seq.token_ids.append(t % 4)
            prev = seq.num_computed_tokens
            seq.num_computed_tokens = seq.num_tokens
            self.bm.commit_full_blocks(seq, prev)
        else:
            assert seq.block_table == before  # a failed grow changes nothing

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free_seq(seq)
        assert seq.block_table == []

    @precondition(lambda self: self.live)
    @rule(
        data=st.data(),
        tokens=st.lists(st.integers(0, 3), min_size=1, max_size=20),
        need=st.integers(0, NUM_BLOCKS),
    )
    def release_as_foretold(self, data: st.DataObject, tokens: list[int], need: int) -> None:
        """``can_allocate`` given the references some requests hold says what it says once
        they are freed (the scheduler asks it before preempting them)."""
        victims = data.draw(st.lists(st.sampled_from(self.live), min_size=1, unique=True))
        hits = self.bm.match_prefix(make_seq(tokens))
        released = Counter(b for seq in victims for b in seq.block_table)
        foretold = self.bm.can_allocate(need, hits, released)
        for seq in victims:
            self.live.remove(seq)
            self.bm.free_seq(seq)
        assert self.bm.match_prefix(make_seq(tokens)) == hits
        assert self.bm.can_allocate(need, hits) == foretold

    @invariant()
    def accounting_is_exact(self) -> None:
        refs = [0] * NUM_BLOCKS
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table)  # no block twice per seq
            for b in seq.block_table:
                refs[b] += 1
        for block in self.bm.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == refs[block.block_id]
            assert (block.ref_count == 0) == (block.block_id in self.bm.free)
        assert self.bm.num_free_blocks == sum(1 for r in refs if r == 0)

    @invariant()
    def shared_blocks_hold_identical_tokens(self) -> None:
        owners: dict[int, tuple[int, ...]] = {}
        for seq in self.live:
            for i, b in enumerate(seq.block_table):
                start = i * BLOCK
                if self.bm.blocks[b].ref_count > 1:
                    tokens = tuple(seq.token_ids[start : start + BLOCK])
                    assert owners.setdefault(b, tokens) == tokens

    @invariant()
    def cached_hashes_point_at_their_blocks(self) -> None:
        for h, b in self.bm.cached.items():
            assert self.bm.blocks[b].hash == h


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_freed_prefix_is_reused_by_a_later_request() -> None:
    bm = BlockManager(8, BLOCK)
    first = make_seq(list(range(10)))
    assert bm.grow(first, 10)
    first.num_computed_tokens = 10
    bm.commit_full_blocks(first, 0)
    table = list(first.block_table)
    bm.free_seq(first)
    second = make_seq(list(range(8)) + [99, 98, 97])
    hits = bm.match_prefix(second)
    assert hits == table[:2]
    bm.allocate_prefix(second, hits)
    assert second.num_computed_tokens == 8


def test_full_prefix_hit_leaves_the_last_token_to_compute() -> None:
    bm = BlockManager(8, BLOCK)
    first = make_seq(list(range(8)))
    assert bm.grow(first, 8)
    first.num_computed_tokens = 8
    bm.commit_full_blocks(first, 0)
    same = make_seq(list(range(8)), 1)
    assert len(bm.match_prefix(same)) == 1  # the block holding the last token is recomputed


def test_exhaustion_is_reported_not_raised() -> None:
    bm = BlockManager(2, BLOCK, enable_prefix_caching=False)
    seq = make_seq([1] * 9)
    assert not bm.grow(seq, 9)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def computed(bm: BlockManager, tokens: list[int], n: int) -> Sequence:
    """A request whose tokens all went through a forward pass: its full blocks are cached."""
    seq = make_seq(tokens, n)
    hits = bm.match_prefix(seq)
    bm.allocate_prefix(seq, hits)
    assert bm.grow(seq, seq.num_tokens)
    prev, seq.num_computed_tokens = seq.num_computed_tokens, seq.num_tokens
    bm.commit_full_blocks(seq, prev)
    return seq


def test_blocks_whose_python_hashes_collide_never_share_a_cache_entry() -> None:
    """Python hashes an int modulo 2**61 - 1, so x and x + 2**61 - 1 collide, and a tuple's
    hash is a function of its items' hashes: blocks that differ in one such id have the same
    ``hash((parent, tokens))`` (the scheme before SHA-256; in-vocabulary collisions can be
    solved for too). With that name, a prefix [ours | shared] whose first block is cached
    under the colliding name was served the second block of [theirs | shared]: K/V computed
    after another user's text."""
    ours = [5, 5, 5, 5]
    theirs = [5 + (2**61 - 1), 5, 5, 5]
    assert theirs != ours and hash((None, tuple(theirs))) == hash((None, tuple(ours)))
    shared = [7, 7, 7, 7]
    bm = BlockManager(8, BLOCK)
    mine = computed(bm, ours + [1, 2, 3, 4, 0], 0)  # caches [ours]
    other = computed(bm, theirs + shared + [0], 1)  # caches [theirs], [theirs | shared]
    assert len(bm.cached) == 4  # four different prefixes, four entries
    again = make_seq(ours + shared + [0], 2)
    assert bm.match_prefix(again) == mine.block_table[:1]  # ours is a hit; shared is not
    assert other.block_table[1] not in bm.match_prefix(again)


def test_a_block_shared_with_a_request_that_stays_is_not_freed_by_releasing() -> None:
    bm = BlockManager(3, BLOCK)
    stays = computed(bm, list(range(5)), 0)  # its first block is full and cached
    leaves = computed(bm, list(range(6)), 1)  # shares that block, and owns one
    assert bm.num_free_blocks == 0
    released = Counter(leaves.block_table)
    assert bm.can_allocate(1, released=released) and not bm.can_allocate(2, released=released)
    released.update(stays.block_table)
    assert bm.can_allocate(3, released=released)
