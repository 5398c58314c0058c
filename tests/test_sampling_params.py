"""Validation at the door: every value the sampler could choke on is refused, by name."""

from __future__ import annotations

import pytest

from tokenq.engine import InvalidRequest, SamplingParams
from tokenq.protocol.errors import clip


def refused(**params) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_dict(params)
    assert err.value.code == "invalid_params"
    return err.value


@pytest.mark.parametrize(
    "name",
    [
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinities_are_refused_by_name(name: str, value: float) -> None:
    err = refused(**{name: value})
    assert err.message == f"{name}: must be a finite number, got {value}"


def test_a_non_finite_logit_bias_is_refused_by_name() -> None:
    assert "finite" in refused(logit_bias={"5": float("nan")}).message
    assert "finite" in refused(logit_bias={"5": float("-inf")}).message


@pytest.mark.parametrize(
    "key", [float("inf"), float("nan"), 1.5, 2.0, "1e400", "abc", "-3", " 7", True, -1, "9" * 30]
)
def test_logit_bias_keys_must_be_integer_token_ids(key) -> None:
    assert refused(logit_bias={key: 1.0}).message.startswith("logit_bias: key")


@pytest.mark.parametrize("ids", [[-1], [1, True], [2.0], ["3"], [None], "5"])
def test_stop_token_ids_must_be_a_list_of_non_negative_ints(ids) -> None:
    assert refused(stop_token_ids=ids).message.startswith("stop_token_ids:")


def test_logit_bias_keys_may_be_ints_or_the_decimal_strings_json_sends() -> None:
    assert SamplingParams(logit_bias={"12": 1, 7: -2.5}).logit_bias == {12: 1.0, 7: -2.5}


def test_a_positive_temperature_below_vllms_floor_is_raised_to_it() -> None:
    for tiny in (1e-300, 5e-324, 1e-5, 0.0099):
        params = SamplingParams(temperature=tiny)
        assert params.temperature == 0.01 and not params.greedy
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_repetition_penalty_and_seed_have_bounds() -> None:
    assert "repetition_penalty" in refused(repetition_penalty=1e-300).message
    assert "repetition_penalty" in refused(repetition_penalty=0.0099).message
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01
    assert "seed" in refused(seed=2**63).message
    assert "seed" in refused(seed=-(2**63) - 1).message
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_error_messages_never_echo_a_huge_value() -> None:
    huge = "x" * 1_000_000
    for params in (
        {"temperature": huge},
        {"seed": [0] * 100_000},
        {huge: 1},
        {"logit_bias": {huge: 1}},
        {"logit_bias": {"1": huge}},
    ):
        assert len(refused(**params).message) < 250


def test_clip_keeps_short_text_and_marks_a_cut() -> None:
    assert clip("short") == "short"
    assert clip("y" * 500) == "y" * 100 + "... (500 chars)"
