"""Sampling parameters, by vLLM's names, validated when built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest


def _bad(name: str, why: str) -> InvalidRequest:
    return InvalidRequest("invalid_params", f"{name}: {why}")


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy. ``max_tokens=None`` runs to the model's context limit.
    ``logprobs=n`` returns the top-n log-probabilities (of the model's raw distribution) for
    every generated token, with the sampled token always included.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._validate()

    def _validate(self) -> None:
        def number(name: str, kinds: tuple[type, ...] = (int, float)) -> Any:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise _bad(name, f"must be a number, got {value!r}")
            return value

        if self.n != 1:
            raise _bad("n", "only n=1 is supported; submit one job per sample")
        if not 0.0 <= number("temperature") <= 100.0:
            raise _bad("temperature", "must be in [0, 100]")
        if not 0.0 < number("top_p") <= 1.0:
            raise _bad("top_p", "must be in (0, 1]")
        top_k = number("top_k", (int,))
        if top_k == 0 or top_k < -1:
            raise _bad("top_k", "must be -1 (off) or at least 1")
        if not 0.0 <= number("min_p") <= 1.0:
            raise _bad("min_p", "must be in [0, 1]")
        if self.seed is not None:
            number("seed", (int,))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                raise _bad(name, "must be in [-2, 2]")
        if not 0.0 < number("repetition_penalty") <= 10.0:
            raise _bad("repetition_penalty", "must be in (0, 10]")
        if self.max_tokens is not None and number("max_tokens", (int,)) < 1:
            raise _bad("max_tokens", "must be at least 1")
        if number("min_tokens", (int,)) < 0:
            raise _bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", "must not exceed max_tokens")
        if self.logprobs is not None and not 0 <= number("logprobs", (int,)) <= 20:
            raise _bad("logprobs", "must be in [0, 20]")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", "must be a boolean")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise _bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise _bad("stop_token_ids", "must be a list of non-negative token ids")
        if not isinstance(self.logit_bias, dict):
            raise _bad("logit_bias", "must be a mapping of token id to bias")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise _bad("logit_bias", f"key {key!r} is not a token id") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _bad("logit_bias", f"bias for {key!r} must be a number")
            if not -100.0 <= value <= 100.0:
                raise _bad("logit_bias", "biases must be in [-100, 100]")
            bias[token] = float(value)
        self.logit_bias = bias

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a wire dict, naming any unknown key instead of ignoring it."""
        if not isinstance(data, dict):
            raise InvalidRequest("invalid_params", "sampling parameters must be a mapping")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise InvalidRequest("invalid_params", f"unknown parameter(s): {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:  # e.g. a list where a scalar belongs, caught in validation
            raise InvalidRequest("invalid_params", str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
