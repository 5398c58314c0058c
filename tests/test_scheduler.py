"""Scheduling decisions and the request lifecycle, without a model."""

from __future__ import annotations

import pytest

from tokenq.engine.block_manager import BlockManager
from tokenq.engine.errors import InvalidRequest, InvalidTransition
from tokenq.engine.sampling_params import SamplingParams
from tokenq.engine.scheduler import Scheduler
from tokenq.engine.sequence import RequestState, Sequence

S = RequestState


def seq(rid: str, n_tokens: int, priority: int = 0, order: int = 0) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(range(1, n_tokens + 1)),
        params=SamplingParams(),
        priority=priority,
        arrival_order=order,
    )


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then pretend the model ran: advance computed tokens, sample a token."""
    out = sched.schedule()
    for s in out.scheduled:
        s.seq.num_computed_tokens = s.start + s.num_tokens
        if s.samples:
            if s.seq.state is S.PREFILLING:
                s.seq.transition(S.DECODING)
            s.seq.append_token(7)
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
