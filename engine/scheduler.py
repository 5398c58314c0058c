"""Token-budget continuous batching with chunked prefill and recompute preemption.

Each step is one forward pass. Running requests are served first, in (priority, arrival)
order: decodes take one token each, unfinished prefills take a chunk of what budget is
left. Then waiting requests are admitted in the same order while the token budget, the
sequence cap and the KV pool allow. When a running request needs a block and none is free,
the running request that comes last in that order (lowest priority, newest) is preempted:
its blocks are freed and it waits again, keeping its output, to recompute later. Because
the waiting queue keeps arrival order, a preempted request goes back ahead of everything
that arrived after it, so nothing starves within a priority level.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from tokenq.engine.block_manager import BlockManager
from tokenq.engine.sequence import RequestState, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens fed this step: token_ids[start : start + num_tokens]
    start: int

    @property
    def samples(self) -> bool:
        """A step that reaches the end of the known tokens yields logits for a new one."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by sort_key
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self.waiting, (seq.sort_key, seq))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a request out wherever it is (finish, abort) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            entry = next((e for e in self.waiting if e[1] is seq), None)
            if entry is not None:
                self.waiting.remove(entry)
                heapq.heapify(self.waiting)
        self.block_manager.free_seq(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.transition(RequestState.PREEMPTED)
        self.add(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        self.running.sort(key=lambda s: s.sort_key)
        scheduled_ids: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
                scheduled_ids.add(id(seq))
                budget -= n
                i += 1

        # Admitting new work in a step that had to preempt would only thrash the pool.
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0][1]
            hits = bm.match_prefix(seq)
            computed = len(hits) * bm.block_size
            n = min(seq.num_tokens - computed, budget)
            if not bm.can_allocate(bm.blocks_needed(computed + n) - len(hits), hits):
                break
            heapq.heappop(self.waiting)
            bm.allocate_prefix(seq, hits)
            bm.grow(seq, computed + n)
            seq.transition(RequestState.PREFILLING)
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, computed))
            budget -= n
        return out
