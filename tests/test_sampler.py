"""The sampler on its own: any parameters that pass validation give a token, never a raise."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenq.engine.sampler import sample
from tokenq.protocol.params import SamplingParams

VOCAB = 49152  # the default model's, as in the engine
FLOAT32_MAX = torch.finfo(torch.float32).max


def _logits(vocab: int, seed: int, scale: float) -> torch.Tensor:
    """Model-like logits, scaled up to the edge of float32 (finite, as a model's are)."""
    g = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(vocab, generator=g, dtype=torch.float64) * scale)
        .clamp(-FLOAT32_MAX, FLOAT32_MAX)
        .float()
    )


@st.composite
def extreme_requests(draw: st.DrawFn) -> tuple[torch.Tensor, SamplingParams, list, list, list]:
    vocab = draw(st.sampled_from([20, 1000, VOCAB]))
    token = st.integers(0, vocab - 1)
    logits = _logits(
        vocab, draw(st.integers(0, 2**16)), draw(st.sampled_from([1, 1e4, 1e30, 1e38]))
    )

    def real(lo: float, hi: float, **kw) -> st.SearchStrategy[float]:
        return st.one_of(st.sampled_from([lo, hi]), st.floats(lo, hi, **kw))

    params = SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(5e-324, 1e-2), real(0.0, 100.0))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(5e-324, 1.0, exclude_min=True))),
        top_k=draw(st.one_of(st.just(-1), st.integers(1, 2 * vocab))),
        min_p=draw(real(0.0, 1.0)),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))),
        presence_penalty=draw(real(-2.0, 2.0)),
        frequency_penalty=draw(real(-2.0, 2.0)),
        repetition_penalty=draw(real(0.01, 10.0)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        logit_bias=draw(st.dictionaries(token, real(-100.0, 100.0), max_size=8)),
        max_tokens=None,
    )
    prompt = draw(st.lists(token, min_size=1, max_size=20))
    output = draw(st.lists(token, max_size=20))
    kept = draw(token)
    banned = draw(
        st.one_of(
            st.just(list(range(vocab))),  # everything: the ban must be dropped
            st.just([t for t in range(vocab) if t != kept]),  # all but one
            st.lists(token, max_size=50),
        )
    )
    return logits, params, prompt, output, banned


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extreme_requests())
def test_sampling_never_raises_and_gives_an_unbanned_token_in_range(request) -> None:
    logits, params, prompt, output, banned = request
    vocab = logits.numel()
    (result,) = sample(logits[None], [params], [prompt], [output], [banned])
    assert 0 <= result.token_id < vocab
    if len(set(banned)) < vocab:  # a ban over everything is dropped, any other one holds
        assert result.token_id not in banned
    if params.logprobs is not None:
        assert result.token_id in result.logprobs


def test_a_ban_over_the_whole_vocabulary_is_dropped_instead_of_failing() -> None:
    logits = _logits(VOCAB, 0, 3.0)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=1)):
        (result,) = sample(logits[None], [params], [[1]], [[]], [list(range(VOCAB))])
        (free,) = sample(logits[None], [params], [[1]], [[]], [[]])
        assert result.token_id == free.token_id


def test_overflow_from_tiny_temperature_and_penalty_samples_the_top_token() -> None:
    # A logit at the float32 limit, pushed past it by the repetition penalty and the
    # temperature: inf - inf would be NaN in the softmax; it must stay the certain pick.
    logits = _logits(VOCAB, 1, 3.0)
    logits[123] = FLOAT32_MAX
    params = SamplingParams(temperature=1e-300, repetition_penalty=0.01, seed=3)
    for seed in range(5):
        params.seed = seed
        (result,) = sample(logits[None], [params], [[123, 9]], [[]], [[]])
        assert result.token_id == 123


def test_a_row_with_no_finite_candidate_falls_back_to_the_best_unbanned_raw_logit() -> None:
    # Every logit so negative that dividing by the temperature makes it -inf.
    logits = torch.full((VOCAB,), -FLOAT32_MAX / 2)
    logits[7], logits[8] = -FLOAT32_MAX / 8, -FLOAT32_MAX / 4
    params = SamplingParams(temperature=0.01, seed=0)
    (result,) = sample(logits[None], [params], [[1]], [[]], [[]])
    assert result.token_id == 7
    (result,) = sample(logits[None], [params], [[1]], [[]], [[7]])
    assert result.token_id == 8
