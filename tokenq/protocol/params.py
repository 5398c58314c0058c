"""Sampling parameters, by vLLM's names, validated when built: the one set of bounds and
messages that the gateway (which maps OpenAI's names onto these) and the worker share, and
`check_sizes`, the names and sizes of a job's ``params``, which the client checks too."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from tokenq.protocol.errors import InvalidRequest, clip, quote
from tokenq.protocol.limits import DEFAULT_LIMITS, Limits
from tokenq.protocol.structured import check as check_structured

# vLLM's _MAX_TEMP: a positive temperature below this is raised to it (as vLLM does), since
# dividing logits by less only overflows them while sampling is already all but greedy.
MIN_TEMPERATURE = 1e-2
# Below this a repetition penalty multiplies logits by more than 100: no sampling use, only
# overflow.
MIN_REPETITION_PENALTY = 1e-2
MAX_LOGPROBS = 20  # top-n per generated token
_INT64 = (-(2**63), 2**63 - 1)


def are_token_ids(ids: list[Any], vocab: int | None = None) -> bool:
    """Whether every item is a non-negative int (bools are not), below ``vocab`` if given,
    at C speed (types in one set, then min and max): a job's prompt ids are checked by the
    client and again by the worker, and a per-id Python check of a long prompt cost more
    than all the rest of its intake."""
    if not ids:
        return True
    if not set(map(type, ids)) <= {int} or min(ids) < 0:
        return False
    return vocab is None or max(ids) < vocab


def _bad(name: str, why: str) -> InvalidRequest:
    return InvalidRequest("invalid_params", f"{name}: {why}", name)


def _got(value: Any) -> str:
    return clip(repr(value))


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy. ``max_tokens=None`` runs to the model's context limit.
    ``logprobs=n`` returns the top-n log-probabilities (of the model's raw distribution) for
    every generated token, with the sampled token always included. ``detokenize=False``
    returns token ids only, the text left empty (as vLLM's): a caller that decodes them
    elsewhere spares the engine's thread that work. Stop strings need the text.

    ``n`` outputs are sampled from one prompt, prefilled once (its KV blocks shared); with
    a ``seed``, output i samples as a request of its own with ``seed + i`` would (vLLM's
    rule), so one choice can be reproduced alone. ``prompt_logprobs=k`` returns, for every
    prompt token but the first, its log-probability and the top-k alternatives (scoring).

    Every number must be finite (NaN and infinities are refused by name) and within:

    - ``temperature`` in [0, 100]; a value in (0, 0.01) is raised to 0.01, as vLLM does
      (``_MAX_TEMP``): only 0 is greedy.
    - ``top_p`` in (0, 1]; ``top_k`` -1 (off) or >= 1; ``min_p`` in [0, 1].
    - ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI's range);
      ``repetition_penalty`` in [0.01, 10].
    - ``seed`` a signed 64-bit integer; ``max_tokens`` >= 1; 0 <= ``min_tokens`` <=
      ``max_tokens``; ``logprobs`` and ``prompt_logprobs`` in [0, 20]; ``n`` >= 1 (the
      client, gateway and worker bound it by ``Limits.max_n``).
    - ``logit_bias`` maps non-negative integer token ids (ints, or decimal strings as JSON
      object keys arrive) to biases in [-100, 100] (OpenAI's range).

    Token ids (``stop_token_ids``, ``logit_bias`` keys) are checked against the vocabulary
    by ``LLMEngine.add_request``, which knows it.

    ``structured_outputs`` constrains the output, as vLLM's: exactly one of ``json`` (a
    JSON Schema), ``json_object``, ``regex``, ``choice`` or ``grammar``; it must compile
    with llguidance (tokenq/protocol/structured.py) and is kept in its normalized form.
    Each of ``n`` outputs follows it on its own.
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
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    detokenize: bool = True
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def _validate(self) -> None:
        def number(name: str, kinds: tuple[type, ...] = (int, float)) -> Any:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                what = "an integer" if kinds == (int,) else "a number"
                raise _bad(name, f"must be {what}, got {_got(value)}")
            if isinstance(value, float) and not math.isfinite(value):
                raise _bad(name, f"must be a finite number, got {value}")
            return value

        def out_of(name: str, bounds: str) -> InvalidRequest:
            return _bad(name, f"must be {bounds}, got {_got(getattr(self, name))}")

        if number("n", (int,)) < 1:
            raise out_of("n", "at least 1")
        if not 0.0 <= number("temperature") <= 100.0:
            raise out_of("temperature", "in [0, 100]")
        if not 0.0 < number("top_p") <= 1.0:
            raise out_of("top_p", "in (0, 1]")
        top_k = number("top_k", (int,))
        if top_k == 0 or top_k < -1:
            raise out_of("top_k", "-1 (off) or at least 1")
        if not 0.0 <= number("min_p") <= 1.0:
            raise out_of("min_p", "in [0, 1]")
        if self.seed is not None and not _INT64[0] <= number("seed", (int,)) <= _INT64[1]:
            raise out_of("seed", "a signed 64-bit integer")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                raise out_of(name, "in [-2, 2]")
        if not MIN_REPETITION_PENALTY <= number("repetition_penalty") <= 10.0:
            raise out_of("repetition_penalty", f"in [{MIN_REPETITION_PENALTY}, 10]")
        if self.max_tokens is not None and number("max_tokens", (int,)) < 1:
            raise out_of("max_tokens", "at least 1")
        if number("min_tokens", (int,)) < 0:
            raise out_of("min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= number(name, (int,)) <= MAX_LOGPROBS:
                raise out_of(name, f"in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.ignore_eos, bool):
            raise out_of("ignore_eos", "a boolean")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise _bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.detokenize, bool):
            raise out_of("detokenize", "a boolean")
        if self.stop and not self.detokenize:
            raise _bad("stop", "stop strings need detokenize=True (they are found in the text)")
        if not isinstance(self.stop_token_ids, list) or not are_token_ids(self.stop_token_ids):
            raise _bad("stop_token_ids", "must be a list of non-negative token ids")
        if not isinstance(self.logit_bias, dict):
            raise _bad("logit_bias", "must be a mapping of token id to bias")
        self.logit_bias = {
            _bias_token(key): _bias_value(key, value) for key, value in self.logit_bias.items()
        }
        if self.structured_outputs is not None:
            self.structured_outputs = check_structured(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a wire dict, naming any unknown key instead of ignoring it."""
        _check_names(data)
        try:
            return cls(**data)
        except TypeError as exc:  # e.g. a list where a scalar belongs, caught in validation
            raise InvalidRequest("invalid_params", clip(str(exc))) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
SAMPLING_PARAMS = _FIELDS  # the names a job's ``params`` may hold


def _check_names(params: Any) -> None:
    if not isinstance(params, dict):
        raise InvalidRequest("invalid_params", "params must be a mapping")
    if not _FIELDS.issuperset(params):
        # The first few, as they came: a hostile map may hold 100,000s of keys.
        unknown = [k for k in params if k not in _FIELDS]
        names = ", ".join(quote(k, 40) for k in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        param = unknown[0] if isinstance(unknown[0], str) else None
        raise InvalidRequest(
            "invalid_params", f"unknown parameter(s): {names}{more}", param and clip(param, 40)
        )


def check_sizes(params: Any, limits: Limits = DEFAULT_LIMITS) -> None:
    """A job's ``params`` before any value is read: a mapping of known names whose
    ``stop``, ``stop_token_ids`` and ``logit_bias`` are within ``limits``, so that a
    hostile entry costs a few length checks; then ``structured_outputs``, compiled, so that
    a constraint that cannot be enforced never reaches Redis. The client, the gateway and
    the worker all check this; values are `SamplingParams`'s to check."""
    _check_names(params)
    stop = params.get("stop")
    if isinstance(stop, list):
        if len(stop) > limits.max_stop:
            raise _bad("stop", f"{len(stop)} strings (limit {limits.max_stop})")
    else:
        stop = [stop]
    if any(isinstance(s, str) and len(s) > limits.max_stop_chars for s in stop):
        raise _bad("stop", f"a string longer than {limits.max_stop_chars} characters")
    n = params.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > limits.max_n:
        raise _bad("n", f"{n} outputs (limit {limits.max_n})")
    for name, bound in (
        ("stop_token_ids", limits.max_stop_token_ids),
        ("logit_bias", limits.max_logit_bias),
    ):
        value = params.get(name)
        if isinstance(value, list | dict) and len(value) > bound:
            raise _bad(name, f"{len(value)} entries (limit {bound})")
    structured = params.get("structured_outputs")
    if structured is not None:
        _check_structured_size(structured, limits)
        check_structured(structured)


def _check_structured_size(spec: Any, limits: Limits) -> None:
    """The spec's size as JSON text, before llguidance reads it."""
    try:
        size = len(json.dumps(spec, ensure_ascii=False))
    except (TypeError, ValueError) as exc:
        raise _bad("structured_outputs", f"must be JSON: {clip(str(exc))}") from None
    if size > limits.max_structured_chars:
        raise _bad(
            "structured_outputs",
            f"{size} characters as JSON (limit {limits.max_structured_chars})",
        )


def _bias_token(key: Any) -> int:
    """A ``logit_bias`` key as a token id: an int, or the decimal string a JSON key is.
    Floats are refused rather than truncated (1.5 is no token id, inf not even a number);
    a string longer than any int64 is not converted (it names no token either)."""
    token = key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
        token = int(key)
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise _bad("logit_bias", f"key {clip(repr(key))} is not a non-negative integer token id")
    return token


def _bias_value(key: Any, value: Any) -> float:
    where = f"bias for {clip(repr(key))}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad("logit_bias", f"{where} must be a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad("logit_bias", f"{where} must be a finite number, got {value}")
    if not -100.0 <= value <= 100.0:
        raise _bad("logit_bias", f"{where} must be in [-100, 100], got {_got(value)}")
    return float(value)
