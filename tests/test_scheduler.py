"""Scheduling decisions and the request lifecycle, without a model."""

from __future__ import annotations

import pytest

from tokenq.engine.block_manager import BlockManager
from tokenq.engine.errors import InvalidTransition
from tokenq.engine.scheduler import Scheduler, SchedulerOutput
from tokenq.engine.sequence import RequestState, Sequence
from tokenq.protocol.errors import InvalidRequest
from tokenq.protocol.params import SamplingParams

S = RequestState


def seq(rid: str, n_tokens: int, priority: int = 0, order: int = 0) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(range(1, n_tokens + 1)),
        params=SamplingParams(),
        priority=priority,
        arrival_order=order,
    )


def advance(sched: Scheduler) -> SchedulerOutput:
    """Schedule, then pretend the model ran."""
    return ran(sched.schedule())


def ran(out: SchedulerOutput) -> SchedulerOutput:
    """Pretend the model ran the step: advance computed tokens, sample a token."""
    for s in out.scheduled:
        s.seq.num_computed_tokens = s.start + s.num_tokens
        if s.samples:
            if s.seq.state is S.PREFILLING:
                s.seq.transition(S.DECODING)
            s.seq.append_token(7)
    return out


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    return fed(advance(sched))


def fed(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_tokens) for s in out.scheduled]


def test_lifecycle_allows_only_valid_transitions() -> None:
    s = seq("a", 3)
    with pytest.raises(InvalidTransition):
        s.transition(S.DECODING)  # waiting cannot skip prefill
    s.transition(S.PREFILLING)
    assert s.metrics.first_scheduled is not None
    s.transition(S.DECODING)
    s.append_token(5)
    assert s.metrics.first_token is not None and s.metrics.ttft >= 0
    s.transition(S.COMPLETED)
    assert s.metrics.e2e is not None
    with pytest.raises(InvalidTransition):
        s.transition(S.CANCELLED)  # terminal
    w = seq("w", 3)
    with pytest.raises(InvalidTransition):
        w.transition(S.FAILED)  # failure only once the model has the request
    w.transition(S.CANCELLED)


def test_chunked_prefill_respects_the_token_budget_and_mixes_with_decodes() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=6)
    a, b = seq("a", 2, order=0), seq("b", 13, order=1)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [("a", 2), ("b", 4)]
    assert run_step(sched) == [("a", 1), ("b", 5)]  # a decodes while b's prefill goes on
    assert run_step(sched) == [("a", 1), ("b", 4)]
    assert b.state is S.DECODING and b.num_output_tokens == 1
    assert run_step(sched) == [("a", 1), ("b", 1)]


def test_max_num_seqs_caps_admission() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq(f"r{i}", 3, order=i))
    assert [r for r, _ in run_step(sched)] == ["r0", "r1"]
    assert sched.num_waiting == 1


def test_waiting_queue_orders_by_priority_then_arrival() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100)
    sched.add(seq("late-low", 2, priority=5, order=0))
    sched.add(seq("high-2", 2, priority=0, order=2))
    sched.add(seq("high-1", 2, priority=0, order=1))
    assert run_step(sched) == [("high-1", 2)]


def test_block_exhaustion_preempts_the_newest_lowest_priority_request() -> None:
    # 4 blocks of 2 tokens: two requests of 3 tokens fill 2 blocks each after one decode.
    sched = Scheduler(BlockManager(4, 2), max_num_seqs=4, max_num_batched_tokens=100)
    old, new = seq("old", 3, order=0), seq("new", 3, order=1)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # both prefill (2 blocks each) and sample: 4 tokens each
    assert sched.block_manager.num_free_blocks == 0
    run_step(sched)  # position 3 still fits in the second block
    run_step(sched)  # position 4 needs a third block each: the pool is full
    assert new.state is S.PREEMPTED and new.num_computed_tokens == 0
    assert new.block_table == [] and new.num_preemptions == 1
    assert old.state is S.DECODING and old.num_output_tokens == 3
    assert new.num_output_tokens == 2  # kept: it will be recomputed, not regenerated
    sched.remove(old)
    scheduled = run_step(sched)
    assert scheduled == [("new", 5)]  # prompt + its output, prefilled again
    assert new.state is S.DECODING


def test_a_request_that_cannot_fit_waits_instead_of_crashing() -> None:
    sched = Scheduler(BlockManager(2, 2), max_num_seqs=4, max_num_batched_tokens=100)
    sched.add(seq("big", 3, order=0))
    sched.add(seq("small", 1, order=1))
    assert run_step(sched) == [("big", 3)]
    assert run_step(sched) == [("big", 1)]  # small waits: no block for it
    assert sched.num_waiting == 1


# -- priority preemption -----------------------------------------------------------------


def started(sched: Scheduler, *seqs: Sequence, steps: int = 2) -> None:
    """Queue the requests and run them until they decode, none preempted."""
    for s in seqs:
        sched.add(s)
    for _ in range(steps):
        assert not advance(sched).preempted
    assert all(s.state is S.DECODING for s in seqs)


def test_a_higher_priority_request_takes_the_slot_of_the_newest_lowest_priority_one() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=3, max_num_batched_tokens=100)
    mid, b0, b1 = seq("mid", 3, 0, order=0), seq("b0", 3, 5, order=1), seq("b1", 3, 5, order=2)
    started(sched, mid, b0, b1)
    sched.add(seq("hi", 3, -1, order=3))
    out = advance(sched)
    assert out.preempted == {b1: "priority"}
    assert fed(out) == [("mid", 1), ("b0", 1), ("hi", 3)]  # b1's decode is taken back
    assert b1.state is S.PREEMPTED and b1.num_output_tokens == 2 and b1.block_table == []
    assert run_step(sched) == [("hi", 1), ("mid", 1), ("b0", 1)]  # b1 waits for a slot


def test_priority_preemption_frees_just_enough_blocks() -> None:
    # 8 blocks of 2 tokens: four requests of 3 tokens hold 2 blocks each once decoding.
    sched = Scheduler(BlockManager(8, 2), max_num_seqs=8, max_num_batched_tokens=100)
    mid, b0, b1, b2 = (
        seq(r, 3, p, order=i)
        for i, (r, p) in enumerate([("mid", 0), ("b0", 5), ("b1", 5), ("b2", 5)])
    )
    started(sched, mid, b0, b1, b2, steps=1)
    assert sched.block_manager.num_free_blocks == 0
    sched.add(seq("hi", 5, -1, order=4))  # 3 blocks: two requests must go
    out = advance(sched)
    assert list(out.preempted.items()) == [(b2, "priority"), (b1, "priority")]
    assert fed(out) == [("mid", 1), ("b0", 1), ("hi", 5)]
    assert sched.block_manager.num_free_blocks == 1


def test_equal_or_lower_priority_never_preempts() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    hi, mid = seq("hi", 3, -1, order=0), seq("mid", 3, 0, order=1)
    started(sched, hi, mid)
    sched.add(seq("mid-2", 3, 0, order=2))
    sched.add(seq("batch", 3, 5, order=3))
    for _ in range(3):
        out = advance(sched)
        assert not out.preempted and fed(out) == [("hi", 1), ("mid", 1)]
    # Blocks, not slots, the limit: 4 blocks of 2, both running requests hold 2.
    sched = Scheduler(BlockManager(4, 2), max_num_seqs=8, max_num_batched_tokens=100)
    hi, mid = seq("hi", 3, -1, order=0), seq("mid", 3, 0, order=1)
    started(sched, hi, mid, steps=1)
    sched.add(seq("mid-2", 1, 0, order=2))
    out = advance(sched)
    assert not out.preempted and fed(out) == [("hi", 1), ("mid", 1)]


def test_nothing_is_preempted_when_that_would_not_make_room() -> None:
    sched = Scheduler(BlockManager(4, 2), max_num_seqs=8, max_num_batched_tokens=100)
    hi, batch = seq("hi", 3, -1, order=0), seq("batch", 3, 5, order=1)
    started(sched, hi, batch, steps=1)
    sched.add(seq("hi-2", 5, -1, order=2))  # 3 blocks; preempting batch frees only 2
    out = advance(sched)
    assert not out.preempted and fed(out) == [("hi", 1), ("batch", 1)]


def test_a_request_preempted_for_priority_is_not_readmitted_in_the_same_step() -> None:
    # A small token budget: once preempted, the batch request's first chunk would fit in
    # the blocks it freed, and the next step would preempt it again.
    sched = Scheduler(BlockManager(5, 2), max_num_seqs=8, max_num_batched_tokens=8)
    batch = seq("batch", 8, 5, order=0)
    started(sched, batch)  # 10 tokens in 5 blocks: the pool is full
    sched.add(seq("hi", 2, -1, order=1))
    out = advance(sched)
    assert out.preempted == {batch: "priority"} and fed(out) == [("hi", 2)]
    # 6 tokens of budget and 4 free blocks left: its first chunk (6 tokens) would fit.
    assert sched.block_manager.num_free_blocks == 4
    assert batch.state is S.PREEMPTED and sched.num_waiting == 1


def test_free_capacity_for_a_priority_counts_lower_priority_requests_as_room() -> None:
    sched = Scheduler(BlockManager(1024, 4), max_num_seqs=4, max_num_batched_tokens=100)
    started(sched, *(seq(f"b{i}", 3, 5, order=i) for i in range(4)))
    sched.add(seq("b-queued", 3, 5, order=4))
    assert sched.free_capacity() == 0
    assert sched.free_capacity(5) == 0  # equal priority is no room
    assert sched.free_capacity(-1) == sched.free_capacity(0) == 4
    sched.add(seq("hi", 3, -1, order=5))
    assert sched.free_capacity(-1) == 3 and sched.free_capacity(-2) == 4
    # Blocks, not slots: the pool is full of lower-priority requests of the mean size.
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=64, max_num_batched_tokens=1024)
    batch = [seq(f"b{i}", 255, 5, order=i) for i in range(4)]
    for s in batch:
        s.params = SamplingParams(max_tokens=1)  # 256 tokens: the estimate's starting size
    started(sched, *batch, steps=1)
    assert sched.block_manager.num_free_blocks == 0
    assert sched.free_capacity() == sched.free_capacity(5) == 0
    assert sched.free_capacity(0) == 4


def test_invalid_sampling_parameters_name_the_parameter() -> None:
    for bad, name in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"temperature": "hot"}, "temperature"),
        ({"bogus": 1}, "bogus"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            SamplingParams.from_dict(bad)
        assert err.value.code == "invalid_params" and name in str(err.value)


def test_a_step_ahead_admits_only_what_outranks_the_step_in_flight_and_preempts_nothing() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    b0, b1 = seq("b0", 3, 5, order=0), seq("b1", 3, 5, order=1)
    started(sched, b0, b1)
    sched.add(seq("also-batch", 3, 5, order=2))
    sched.add(seq("hi", 4, -1, order=3))
    out = ran(sched.schedule_ahead(5))
    # Beyond max_num_seqs, and only the request that outranks the batch in flight.
    assert fed(out) == [("hi", 4)] and not out.preempted
    assert [s.request_id for s in sched.running] == ["hi", "b0", "b1"]
    assert fed(sched.schedule_ahead(-1)) == []  # nothing outranks an interactive step
    # Over the cap, the engine keeps its requests and admits nothing of their priority
    # until one ends.
    for _ in range(2):
        out = advance(sched)
        assert not out.preempted and fed(out) == [("hi", 1), ("b0", 1), ("b1", 1)]
    sched.remove(b0)
    sched.remove(b1)
    assert fed(advance(sched)) == [("hi", 1), ("also-batch", 3)]


def test_a_step_ahead_waits_when_no_free_block_is_left() -> None:
    sched = Scheduler(BlockManager(4, 2), max_num_seqs=8, max_num_batched_tokens=100)
    batch = seq("batch", 7, 5, order=0)
    started(sched, batch, steps=1)  # 8 tokens in 4 blocks: the pool is full
    sched.add(seq("hi", 3, -1, order=1))
    assert fed(sched.schedule_ahead(5)) == [] and sched.num_waiting == 1
