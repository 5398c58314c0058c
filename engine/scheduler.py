"""Token-budget continuous batching with chunked prefill and recompute preemption.

Each step is one forward pass. Running requests are served first, in (priority, arrival)
order (lower priority value first, as in vLLM): decodes take one token each, unfinished
prefills take a chunk of what budget is left. Then waiting requests are admitted in the
same order while the token budget, the sequence cap and the KV pool allow.

Preemption is by recompute: the request's blocks are freed and it waits again, keeping its
output, to prefill prompt and output again later and go on exactly where it was. It has
two causes (vLLM's priority policy):

- ``kv_cache``: a running request needs a block and none is free. The running request that
  comes last in (priority, arrival) order (lowest priority, newest) is preempted.
- ``priority``: the first waiting request cannot be admitted, for want of a sequence slot
  or of KV blocks, while running requests of strictly lower priority hold them. Those are
  preempted, lowest priority and newest first, just as many as it takes to admit it; none
  if even all of them would not make room. Without this an interactive request would wait
  for a full batch of long low-priority generations to end.

Rules that keep preemption from thrashing:

- a step whose running requests ran out of blocks admits nothing: the pool is full;
- a request preempted in a step is not admitted again in that step: admission stops at it
  (the waiting queue is in (priority, arrival) order, so nothing behind it ranks higher);
- priority preemption only ever takes requests of strictly lower priority, so requests of
  one priority never preempt each other for it, and no two requests can preempt each
  other back and forth. Lower priorities wait while higher-priority work keeps the engine
  full (strict priority, as in vLLM).

A step ahead (``schedule_ahead``) is a step run between two layers of the step in flight,
for waiting requests that outrank every request in that step: on a CPU a step takes
hundreds of milliseconds, and an interactive request that waited for it would double its
time to first token. It preempts nothing (the requests in flight hold their blocks until
their pass ends), and it admits beyond ``max_num_seqs`` rather than wait for a seat: the
seats are given back as requests end (nothing is admitted while the engine is over the cap
but by priority preemption), not by preempting a lower-priority request at once, which
would throw its work away for a seat a few steps would free anyway.

A join (``schedule_join``) admits requests into the step in flight, between two of its
layers, as far as its budget, seats and free blocks go: a request that arrives just after
a long prefill began (requests sent over HTTP one after another reach the queue tens of
milliseconds apart) goes through the layers done so far on its own and then shares the
rest of the pass, instead of waiting seconds for the next step. Not in a step that
preempted: a request preempted in a step is never admitted again in it.

The token budget is no cause for preemption: running requests are served first, so a
higher-priority request may wait while lower-priority prefills already running take the
whole budget. That wait is bounded: those prefills end, and new ones are admitted after it.

Because the waiting queue keeps arrival order, a preempted request goes back ahead of
everything of its priority that arrived after it, so nothing starves within a priority level.

The scheduler also keeps the books of a step that ran (``commit``: computed tokens, full
blocks named for the prefix cache) and estimates how much more work fits
(``free_capacity``), so that callers pull only what it can take.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter
from typing import Literal

from tokenq.engine.block_manager import FREED, BlockManager
from tokenq.engine.sequence import RequestState, Sequence

PreemptCause = Literal["kv_cache", "priority"]
_priority = attrgetter("priority")
_block_table = attrgetter("block_table")


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
    preempted: dict[Sequence, PreemptCause] = field(default_factory=dict)  # in order


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int | None = None,
        kv_window: int | None = None,
    ) -> None:
        """``max_model_len`` (tokens a request may reach) defaults to what the pool holds.
        ``kv_window``: the widest sliding window of a model whose every layer has one; the
        blocks before it are given back after each step (None: every block is kept)."""
        self.block_manager = block_manager
        self.kv_window = kv_window
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or block_manager.num_blocks * block_manager.block_size
        self.waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by sort_key
        self.running: list[Sequence] = []  # kept in sort_key order: the last is preempted first
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

    def free_capacity(self, priority: int | None = None) -> int:
        """How many more requests to take now: free sequence slots, and KV blocks left
        after what the queued requests will need, at the recent mean request size.

        With a ``priority``: how many requests of that priority. Running and waiting
        requests of strictly lower priority count as room, since such a request would be
        admitted ahead of them, preempting them (so a worker full of batch jobs keeps
        taking interactive ones). Their blocks count whole, shared prefix blocks included."""
        return self.free_capacities((priority,))[0]

    def free_capacities(self, priorities: Iterable[int | None]) -> list[int]:
        """``free_capacity`` of each priority, from one pass over the queues: the worker
        asks for four after every step, and four passes over a few hundred requests took
        a few percent of a fast step."""
        # priority -> [running, their blocks, waiting, the blocks they will need]
        by_priority: dict[int, list[int]] = {}
        # `running` is in priority order: one group per priority, summed at C speed (a
        # Python loop over 64 requests took 20 us of every step's bookkeeping).
        for priority, group in groupby(self.running, _priority):
            seqs = list(group)
            row = by_priority.setdefault(priority, [0, 0, 0, 0])
            row[0] += len(seqs)
            row[1] += sum(map(len, map(_block_table, seqs)))
            if self.kv_window:
                row[1] -= sum(s.block_table.count(FREED) for s in seqs)
        bm = self.block_manager
        for _, seq in self.waiting:
            row = by_priority.setdefault(seq.priority, [0, 0, 0, 0])
            row[2] += 1
            row[3] += bm.blocks_needed(seq.num_tokens + 1)
        per_request = max(1, bm.blocks_needed(int(self._recent_request_tokens)))
        free = []
        for priority in priorities:
            running = waiting = queued = reclaimable = 0
            for own, (n_running, blocks, n_waiting, needed) in by_priority.items():
                if priority is None or own <= priority:
                    running += n_running
                    waiting += n_waiting
                    queued += needed
                else:
                    reclaimable += blocks
            slots = self.max_num_seqs - running - waiting
            # one block of headroom for each request that stays running
            spare = bm.num_free_blocks + reclaimable - queued - running
            free.append(max(0, min(slots, spare // per_request)))
        return free

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

    def _preempt(self, seq: Sequence, cause: PreemptCause, out: SchedulerOutput) -> int:
        """Send a running request back to wait, its blocks freed and its output kept; all
        the running outputs of its group go with it (they are recomputed together, side by
        side in the queue). Returns the tokens this step had already given them, which are
        unspent again."""
        members = [seq] if seq.group is None else [m for m in seq.group.seqs if m in self.running]
        unspent = 0
        for member in members:
            self.running.remove(member)
            self.block_manager.free_seq(member)
            member.num_computed_tokens = 0
            member.num_preemptions += 1
            member.transition(RequestState.PREEMPTED)
            self._enqueue(member)
            out.preempted[member] = cause
            entry = next((s for s in out.scheduled if s.seq is member), None)
            if entry is not None:
                out.scheduled.remove(entry)
                unspent += entry.num_tokens
        return unspent

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Sequence slots a waiting request takes: a leader brings its group's outputs."""
        return len(seq.group.seqs) if seq.unforked else 1  # type: ignore[union-attr]

    def _fork(self, entry: ScheduledSeq, out: SchedulerOutput) -> None:
        """If ``entry`` computes its group leader's last prompt token, start the group's other
        outputs on the leader's blocks, each sampling from the leader's logits row (a
        scheduled entry of no tokens, right after the leader's)."""
        seq = entry.seq
        if not seq.unforked or entry.start + entry.num_tokens != seq.num_prompt_tokens:
            return
        assert seq.group is not None
        seq.group.forked = True
        at = out.scheduled.index(entry) + 1
        for child in seq.group.seqs[1:]:
            if child.state.finished:
                continue
            self.block_manager.fork(seq, child)
            child.transition(RequestState.PREFILLING)
            bisect.insort(self.running, child, key=lambda s: s.sort_key)
            out.scheduled.insert(at, ScheduledSeq(child, 0, seq.num_prompt_tokens))
            at += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out)
        # Admitting new work in a step whose running requests ran out of blocks would only
        # thrash the pool.
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Serve running requests in order, preempting from the back for blocks; returns
        the token budget left."""
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                # a group's outputs before this one leave too: the walk steps back over them
                i -= sum(1 for m in self.running[:i] if m.group and m.group is victim.group)
                self._preempt(victim, "kv_cache", out)
                if seq not in self.running:
                    break
            else:
                entry = ScheduledSeq(seq, n, seq.num_computed_tokens)
                out.scheduled.append(entry)
                budget -= n
                before = len(self.running)
                self._fork(entry, out)
                i += 1 + len(self.running) - before  # the forked outputs are scheduled
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order, each with its cached prefix and a first chunk,
        preempting lower-priority running requests for it where that makes room. The chunk
        is sized by the budget before preempting: the budget a victim gives back goes to
        the requests after it, so no more is preempted than that chunk needs."""
        bm = self.block_manager
        while self.waiting and budget > 0:
            seq = self.waiting[0][1]
            if seq in out.preempted:
                break  # never back in the step that preempted it
            seats = self._seats(seq)
            if (
                self.running
                and len(self.running) + seats > self.max_num_seqs
                and self.running[-1].priority <= seq.priority
            ):
                break  # no slot to be had: spare hashing its prompt
            hits = self._prefix_hits(seq)
            computed = len(hits) * bm.block_size
            n = min(seq.num_tokens - computed, budget)
            # a group's outputs will each copy the prompt's last partial block
            need = bm.blocks_needed(computed + n) - len(hits) + seats - 1
            victims = self._make_room(seq, need, hits)
            if victims is None:
                break
            for victim in victims:
                budget += self._preempt(victim, "priority", out)
            budget -= self._admit(seq, hits, n, out)

    def schedule_ahead(self, priority: int) -> SchedulerOutput:
        """A step ahead of the one in flight, whose best priority is ``priority``: waiting
        requests of strictly higher priority, in order, as far as free blocks and the token
        budget go, with no preemption and no sequence cap (see the module's docstring)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._admit_free(out, budget, lambda: self.waiting[0][1].priority < priority)
        return out

    def schedule_join(self, in_flight: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Waiting requests that join the step in flight between two layers, in order, as
        far as its token budget, the sequence cap and free blocks go, with no preemption:
        what ``schedule`` would have admitted had they come before the step began."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens - sum(s.num_tokens for s in in_flight)
        self._admit_free(out, budget, lambda: len(self.running) < self.max_num_seqs)
        return out.scheduled

    def _admit_free(self, out: SchedulerOutput, budget: int, more: Callable[[], bool]) -> None:
        """Admit waiting requests in order while ``more()`` and the token budget allow and
        their blocks are free, preempting nothing."""
        bm = self.block_manager
        while self.waiting and budget > 0 and more():
            seq = self.waiting[0][1]
            if seq.needs_prompt_logprobs:
                break  # its logits rows are read in the step's own pass only
            hits = bm.match_prefix(seq)
            computed = len(hits) * bm.block_size
            n = min(seq.num_tokens - computed, budget)
            need = bm.blocks_needed(computed + n) - len(hits) + self._seats(seq) - 1
            if not bm.can_allocate(need, hits):
                break
            budget -= self._admit(seq, hits, n, out)

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached prefix blocks to start on: none for a prompt whose log-probabilities are
        wanted, since every one of its positions must be computed."""
        return [] if seq.needs_prompt_logprobs else self.block_manager.match_prefix(seq)

    def _admit(self, seq: Sequence, hits: list[int], n: int, out: SchedulerOutput) -> int:
        """Start the first waiting request on its cached prefix ``hits`` and a first chunk
        of ``n`` tokens; returns ``n``."""
        bm = self.block_manager
        heapq.heappop(self.waiting)
        bm.allocate_prefix(seq, hits)
        computed = seq.num_computed_tokens
        bm.grow(seq, computed + n)
        seq.transition(RequestState.PREFILLING)
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)
        entry = ScheduledSeq(seq, n, computed)
        out.scheduled.append(entry)
        self._fork(entry, out)
        return n

    def _make_room(
        self, seq: Sequence, num_new_blocks: int, hits: list[int]
    ) -> list[Sequence] | None:
        """The running requests to preempt so that ``seq`` can start: a sequence slot, and
        ``num_new_blocks`` fresh blocks beside its cached prefix blocks ``hits``.

        The fewest of strictly lower priority than ``seq``, lowest priority and newest first
        (none if it fits already); None if even all of them would not make room, since
        preempting them then would only throw their work away."""
        released: Counter[int] = Counter()  # block id -> references the victims hold
        victims: list[Sequence] = []
        candidates = reversed(self.running)
        seats = self._seats(seq)
        while not (
            len(self.running) - len(victims) + seats <= self.max_num_seqs
            and self.block_manager.can_allocate(num_new_blocks, hits, released)
        ):
            victim = next(candidates, None)
            if victim is None or victim.priority <= seq.priority:
                return None
            victims.append(victim)
            released.update(b for b in victim.block_table if b != FREED)
        return victims

    def commit(self, scheduled: list[ScheduledSeq]) -> None:
        """Book a forward pass that ran: the tokens it fed have their K/V in the cache, and
        blocks it filled are named for the prefix cache. Only after this does a request
        count them computed, so a pass that raised leaves every request as it was. With a
        ``kv_window``, the blocks no layer will read again go back to the pool."""
        for s in scheduled:
            prev = s.seq.num_computed_tokens
            s.seq.num_computed_tokens = s.start + s.num_tokens
            self.block_manager.commit_full_blocks(s.seq, prev)
            if self.kv_window:
                # the next token, at num_computed_tokens, sees kv_window keys, its own included
                oldest = s.seq.num_computed_tokens - self.kv_window + 1
                self.block_manager.free_left_behind(s.seq, oldest)
