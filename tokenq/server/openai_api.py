"""The OpenAI API as tokenq jobs: request bodies in, response bodies and stream chunks out.

Pure functions over plain dicts, no web framework: `tokenq serve` (tokenq/server/gateway.py)
and `tokenq batch run` (OpenAI's batch files) share them, so a request means the same job
whichever way it arrives. Validation happens here, before anything reaches Redis: a bad
request is answered with a 400 naming its parameter and never becomes a job. The ranges
are the engine's (tokenq/protocol/params.py), which the producer may not import (no torch
on the client side); tests/test_openai_api.py checks the two agree.

Logprobs: workers report, per generated token, the top-n token ids with their
log-probabilities, the chosen token always included, but no token strings (the gateway
has no tokenizer). Tokens are therefore named as vLLM names them with
``--return-tokens-as-token-ids``: ``"token_id:1234"``; ``bytes`` and ``text_offset`` are
null.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tokenq.protocol import (
    DEFAULT_LIMITS,
    LANE_PRIORITY,
    LANES,
    MAX_PRIORITY,
    TENANT_RE,
    DoneEvent,
    Limits,
    TokenEvent,
    lane_of,
    quote,
)

COMPLETIONS, CHAT = "completions", "chat"
KINDS = (COMPLETIONS, CHAT)
MAX_LOGPROBS = 20  # the engine's bound (top-n per token)
INT64 = (-(2**63), 2**63 - 1)

# Fields read by both endpoints: OpenAI's, vLLM's sampling extras, and tokenq's own
# (`priority` as in vLLM, `lane` as in Client.submit).
_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stream_options",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "user",
        "seed",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "stop_token_ids",
        "ignore_eos",
        "priority",
        "lane",
    }
)
FIELDS = {
    COMPLETIONS: _COMMON | {"prompt", "best_of", "echo", "suffix"},
    CHAT: _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
}
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})


class BadRequest(Exception):
    """A request refused before it became a job, with its HTTP status and OpenAI's error
    shape: ``param`` names the field at fault (None when no single field is)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object, as its SDKs parse it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class Rendering:
    """How a request wants its answer, beside the job itself (`rendering`)."""

    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    logprobs: int | None = None  # top-n per token to return (0: the chosen token's only)


# --- requests ------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number, got {quote(value)}", name)
    if not math.isfinite(value) or not low <= value <= high:
        raise BadRequest(f"{name} must be in [{low:g}, {high:g}], got {quote(value)}", name)
    return value


def _integer(body: dict[str, Any], name: str, low: int, high: int = INT64[1]) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise BadRequest(f"{name} must be an integer, got {quote(value)}", name)
    if not low <= value <= high:
        bound = f"at least {low}" if high == INT64[1] else f"in [{low}, {high}]"
        raise BadRequest(f"{name} must be {bound}, got {quote(value)}", name)
    return value


def _only(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    """Fields tokenq takes only at their neutral value (n=1, echo=false, ...)."""
    value = body.get(name)
    if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
        raise BadRequest(f"{name}={quote(value)} is not supported: {why}", name)


def _stop(body: dict[str, Any], limits: Limits) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > limits.max_stop:
        raise BadRequest(f"stop: {len(stops)} strings (limit {limits.max_stop})", "stop")
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise BadRequest(f"stop: a string over {limits.max_stop_chars} characters", "stop")
    return stops


def _token_ids(value: Any, name: str, bound: int) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise BadRequest(f"{name} must be a list of non-negative token ids", name)
    if len(value) > bound:
        raise BadRequest(f"{name}: {len(value)} ids (limit {bound})", name)
    return value


def _logit_bias(value: Any, limits: Limits) -> dict[str, float]:
    if not isinstance(value, dict):
        raise BadRequest("logit_bias must map token ids to biases", "logit_bias")
    if len(value) > limits.max_logit_bias:
        bound = limits.max_logit_bias
        raise BadRequest(f"logit_bias: {len(value)} entries (limit {bound})", "logit_bias")
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19):
            raise BadRequest(f"logit_bias key {quote(key)} is not a token id", "logit_bias")
        number = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not (number and math.isfinite(bias) and -100 <= bias <= 100):
            raise BadRequest(f"logit_bias[{key}] must be in [-100, 100]", "logit_bias")
    return value


def _sampling(kind: str, body: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """Sampling parameters by vLLM's names (the job's `params`), values checked."""
    params: dict[str, Any] = {}
    for name, low, high in (
        ("temperature", 0.0, 100.0),
        ("top_p", 0.0, 1.0),
        ("min_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
        ("repetition_penalty", 0.01, 10.0),
    ):
        value = _number(body, name, low, high)
        if value is not None:
            params[name] = value
    if params.get("top_p") == 0:
        raise BadRequest("top_p must be in (0, 1], got 0", "top_p")
    top_k = _integer(body, "top_k", -1)
    if top_k is not None and top_k not in (0, -1):  # 0 and -1 both mean off, as in vLLM
        params["top_k"] = top_k
    seed = _integer(body, "seed", INT64[0])
    if seed is not None:
        params["seed"] = seed
    names = ["max_tokens"] + (["max_completion_tokens"] if kind == CHAT else [])
    given = {n: _integer(body, n, 1) for n in names if body.get(n) is not None}
    if len(given) > 1 and len(set(given.values())) > 1:
        raise BadRequest("max_tokens and max_completion_tokens disagree", "max_tokens")
    if given:
        params["max_tokens"] = next(iter(given.values()))
    elif kind == CHAT:
        params["max_tokens"] = None  # as OpenAI and vLLM: up to the model's context
    min_tokens = _integer(body, "min_tokens", 0)
    if min_tokens:
        if params.get("max_tokens") is not None and min_tokens > params["max_tokens"]:
            raise BadRequest("min_tokens must not exceed max_tokens", "min_tokens")
        params["min_tokens"] = min_tokens
    stop = _stop(body, limits)
    if stop:
        params["stop"] = stop
    if body.get("stop_token_ids") is not None:
        ids = _token_ids(body["stop_token_ids"], "stop_token_ids", limits.max_stop_token_ids)
        if ids:
            params["stop_token_ids"] = ids
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise BadRequest("ignore_eos must be a boolean", "ignore_eos")
        if ignore_eos:
            params["ignore_eos"] = True
    if body.get("logit_bias") is not None:
        bias = _logit_bias(body["logit_bias"], limits)
        if bias:
            params["logit_bias"] = bias
    logprobs = rendering(kind, body).logprobs
    if logprobs is not None:
        params["logprobs"] = logprobs
    return params


def _lane(body: dict[str, Any]) -> dict[str, Any]:
    priority = _integer(body, "priority", -MAX_PRIORITY, MAX_PRIORITY)
    lane = body.get("lane")
    if lane is not None and lane not in LANES:
        raise BadRequest(f"lane must be one of {', '.join(LANES)}, got {quote(lane)}", "lane")
    if priority is not None and lane is not None and lane_of(priority) != lane:
        raise BadRequest(f"priority {priority} is in the {lane_of(priority)} lane", "lane")
    if priority is None and lane is not None:
        priority = LANE_PRIORITY[lane]
    return {"priority": priority} if priority else {}


def _prompt(body: dict[str, Any]) -> dict[str, Any]:
    """A completion's prompt: a string or token ids, alone or as a batch of one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return {
            "prompt_token_ids": _token_ids(prompt, "prompt", DEFAULT_LIMITS.max_prompt_token_ids)
        }
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest(
            f"one prompt per request ({len(prompt)} given): send one request each", "prompt"
        )
    raise BadRequest("prompt must be a non-empty string or a list of token ids", "prompt")


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (other parts are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(
                    f"{where}[{j}]: only text parts are supported, got {quote(kind)}", where
                )
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}[{j}].text must be a string", where)
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where} must be a string or a list of text parts", where)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise BadRequest(f"{where} must be an object", where)
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(
                f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {quote(role)}"
                + (" (tools are not supported)" if role in ("tool", "function") else ""),
                f"{where}.role",
            )
        if msg.get("tool_calls"):
            raise BadRequest("tool calls are not supported", f"{where}.tool_calls")
        # OpenAI's newer name for system; chat templates know only system.
        out.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content(msg.get("content"), f"{where}.content"),
            }
        )
    return out


def _chat_only(body: dict[str, Any]) -> None:
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest("response_format: only {'type': 'text'} is supported", "response_format")
    if body.get("tools"):
        raise BadRequest("tools are not supported", "tools")
    _only(body, "tool_choice", ("none",), "tools are not supported")


def rendering(kind: str, body: dict[str, Any]) -> Rendering:
    """The answer's form: streamed or not, usage chunk, logprobs per token."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
        if not isinstance(options, dict) or not set(options) <= {
            "include_usage",
            "continuous_usage_stats",
        }:
            raise BadRequest("stream_options must be {include_usage: bool}", "stream_options")
        include_usage = bool(options.get("include_usage"))
    logprobs: int | None
    if kind == CHAT:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise BadRequest("logprobs must be a boolean", "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not wanted:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (top or 0) if wanted else None
    else:
        logprobs = _integer(body, "logprobs", 0, MAX_LOGPROBS)
    return Rendering(bool(stream), include_usage, logprobs)


def to_submit_kwargs(kind: str, body: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Keyword arguments for `Client.submit` / `AsyncClient.submit` from an OpenAI request
    body (`kind`: "completions" or "chat"); raises BadRequest naming the field at fault.

    Unknown fields are refused rather than ignored, so that a client relying on a feature
    tokenq lacks (tools, n > 1, echo) hears so instead of getting something else."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(str(k) for k in body if k not in FIELDS[kind])
    if unknown:
        names = quote(", ".join(unknown))
        raise BadRequest(f"unsupported parameter(s): {names}", unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    _only(body, "n", (1,), "one completion per request")
    if kind == COMPLETIONS:
        _only(body, "best_of", (1,), "one completion per request")
        _only(body, "echo", (False,), "the prompt is not echoed")
        _only(body, "suffix", ("",), "no insertion")
        kwargs: dict[str, Any] = _prompt(body)
    else:
        _chat_only(body)
        kwargs = {"messages": _messages(body)}
    kwargs.update(_sampling(kind, body, limits))
    kwargs.update(_lane(body))
    if model:
        kwargs["model"] = model
    user = body.get("user")
    if user is not None and user != "":
        if not isinstance(user, str) or not TENANT_RE.fullmatch(user):
            raise BadRequest(f"user {quote(user)} must match {TENANT_RE.pattern}", "user")
        kwargs["tenant"] = user
    return kwargs


# --- responses -----------------------------------------------------------------------


def response_id(kind: str, job_id: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{job_id}"


def token_name(token_id: int) -> str:
    """How a token is named without a tokenizer (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}"


@dataclass
class Logprobs:
    """Per generated token: its id and the top-n (id, logprob) pairs, the chosen included."""

    tokens: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)

    def add(self, event: TokenEvent) -> None:
        if event.logprobs is not None:
            self.tokens.extend(event.token_ids)
            self.top.extend(event.logprobs)

    def render(self, kind: str, n: int) -> dict[str, Any]:
        """OpenAI's logprobs object: the chosen token's logprob and at most n alternatives."""
        # The chosen token is always among the pairs (docs/protocol.md, token events).
        chosen = [dict(pairs)[tok] for tok, pairs in zip(self.tokens, self.top, strict=True)]
        if kind == CHAT:
            return {
                "content": [
                    {
                        "token": token_name(tok),
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [
                            {"token": token_name(t), "logprob": v, "bytes": None}
                            for t, v in pairs[:n]
                        ],
                    }
                    for tok, lp, pairs in zip(self.tokens, chosen, self.top, strict=True)
                ],
                "refusal": None,
            }
        return {
            "tokens": [token_name(t) for t in self.tokens],
            "token_logprobs": chosen,
            "top_logprobs": [
                {token_name(t): v for t, v in pairs[: max(n, 1)]} for pairs in self.top
            ],
            "text_offset": None,
        }


def usage_body(result: DoneEvent) -> dict[str, int]:
    return {
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": result.usage.completion_tokens,
        "total_tokens": result.usage.total_tokens,
    }


def response_body(
    kind: str,
    job_id: str,
    model: str,
    result: DoneEvent,
    created: int,
    logprobs: Logprobs | None = None,
    top_logprobs: int = 0,
) -> dict[str, Any]:
    """The non-streaming answer: `text_completion` or `chat.completion`, one choice."""
    rendered = None if logprobs is None else logprobs.render(kind, top_logprobs)
    if kind == CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": rendered,
            "finish_reason": result.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": result.text,
            "logprobs": rendered,
            "finish_reason": result.finish_reason,
        }
        obj = "text_completion"
    return {
        "id": response_id(kind, job_id),
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_body(result),
    }


def chunk_body(
    kind: str,
    job_id: str,
    model: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    logprobs: Logprobs | None = None,
    top_logprobs: int = 0,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: `text_completion` or `chat.completion.chunk`. `role` makes a
    chat's first chunk (the assistant role, empty content); with `include_usage` every
    chunk carries `usage: null`, as OpenAI's do before the last one (`usage_chunk`)."""
    rendered = None if logprobs is None else logprobs.render(kind, top_logprobs)
    if kind == CHAT:
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": rendered,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": text or "",
            "logprobs": rendered,
            "finish_reason": finish_reason,
        }
        obj = "text_completion"
    chunk = {
        "id": response_id(kind, job_id),
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(kind: str, job_id: str, model: str, created: int, result: DoneEvent) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, usage."""
    return {
        "id": response_id(kind, job_id),
        "object": "chat.completion.chunk" if kind == CHAT else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(result),
    }


# A job's error code (docs/protocol.md, "Error codes") as an HTTP status and OpenAI type.
_JOB_ERRORS = {
    "invalid_params": (400, "invalid_request_error"),
    "invalid_input": (400, "invalid_request_error"),
    "invalid_request": (400, "invalid_request_error"),
    "empty_prompt": (400, "invalid_request_error"),
    "prompt_too_long": (400, "invalid_request_error"),
    "payload_too_large": (413, "invalid_request_error"),
    "unknown_model": (404, "invalid_request_error"),
    "deadline_exceeded": (504, "timeout_error"),
}


def job_error(code: str, message: str) -> BadRequest:
    """A job's `error` event (or a ProtocolError's code) as the HTTP error to answer with:
    the client's fault 4xx, a deadline 504, anything else the server's (500)."""
    status, kind = _JOB_ERRORS.get(code, (500, "server_error"))
    return BadRequest(message, None, status, kind, code)
