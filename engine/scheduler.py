"""Token-budget continuous batching with chunked prefill and recompute preemption.

Each step is one forward pass. Running requests are served first, in (priority, arrival)
order: decodes take one token each, unfinished prefills take a chunk of what budget is
left. Then waiting requests are admitted in the same order while the token budget, the
sequence cap and the KV pool allow. When a running request needs a block and none is free,
the running request that comes last in that order (lowest priority, newest) is preempted:
its blocks are freed and it waits again, keeping its output, to recompute later. Because
the waiting queue keeps arrival order, a preempted request goes back ahead of everything
that arrived after it, so nothing starves within a priority level.

The scheduler also keeps the books of a step that ran (``commit``: computed tokens, full
blocks named for the prefix cache) and estimates how much more work fits
(``free_capacity``), so that callers pull only what it can take.
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

    @property
    def num_prompt_tokens(self) -> int:
        """How many of the tokens fed are prompt tokens (the rest: output, recomputed)."""
        return max(0, min(self.start + self.num_tokens, self.seq.num_prompt_tokens) - self.start)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int | None = None,
    ) -> None:
        """``max_model_len`` (tokens a request may reach) defaults to what the pool holds."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or block_manager.num_blocks * block_manager.block_size
        self.waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by sort_key
        self.running: list[Sequence] = []
        self._recent_request_tokens = 256.0  # running mean of prompt + max_tokens, for admission

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request, and let its size move the admission estimate."""
        want = seq.num_prompt_tokens + (seq.params.max_tokens or self.max_model_len)
        self._recent_request_tokens += 0.1 * (
            min(want, self.max_model_len) - self._recent_request_tokens
        )
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        heapq.heappush(self.waiting, (seq.sort_key, seq))

    def free_capacity(self) -> int:
        """How many more requests to take now: free sequence slots, and KV blocks left
        after what the queued requests will need, at the recent mean request size."""
        slots = self.max_num_seqs - len(self.running) - len(self.waiting)
        bm = self.block_manager
        queued = sum(bm.blocks_needed(seq.num_tokens + 1) for _, seq in self.waiting)
        running_growth = len(self.running)  # one block of headroom each
        spare = bm.num_free_blocks - queued - running_growth
        per_request = bm.blocks_needed(int(self._recent_request_tokens))
        return max(0, min(slots, spare // max(1, per_request)))

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
        self._enqueue(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        self.running.sort(key=lambda s: s.sort_key)

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

    def commit(self, scheduled: list[ScheduledSeq]) -> None:
        """Book a forward pass that ran: the tokens it fed have their K/V in the cache, and
        blocks it filled are named for the prefix cache. Only after this does a request
        count them computed, so a pass that raised leaves every request as it was."""
        for s in scheduled:
            prev = s.seq.num_computed_tokens
            s.seq.num_computed_tokens = s.start + s.num_tokens
            self.block_manager.commit_full_blocks(s.seq, prev)
