"""The OpenAI API as tokenq jobs: request bodies in, response bodies and stream chunks out.

Pure functions over plain dicts, no web framework: `tokenq serve` (tokenq/server/gateway.py)
and `tokenq batch run` (OpenAI's batch files) share them, so a request means the same job
whichever way it arrives. Validation happens here, before anything reaches Redis: a bad
request is answered with a 400 naming its parameter and never becomes a job. Sampling
parameters are OpenAI's names mapped onto the job's (vLLM's) and checked by the contract's
`SamplingParams` and `check_sizes`, as the worker checks them: a bad value has one message
whichever way it arrives, and the 400 names the field as the request named it.

Logprobs: workers report, per generated token, the top-n token ids with their
log-probabilities, the chosen token always included, but no token strings (the gateway
has no tokenizer). Tokens are therefore named as vLLM names them with
``--return-tokens-as-token-ids``: ``"token_id:1234"``; ``bytes`` and ``text_offset`` are
null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenq.protocol import (
    DEFAULT_LIMITS,
    LANE_PRIORITY,
    LANES,
    MAX_PRIORITY,
    SAMPLING_PARAMS,
    TENANT_RE,
    DoneEvent,
    InvalidRequest,
    Limits,
    RestartEvent,
    SamplingParams,
    TokenEvent,
    are_token_ids,
    check_sizes,
    lane_of,
    quote,
)
from tokenq.protocol.structured import check as check_structured
from tokenq.protocol.webhooks import check_webhook

COMPLETIONS, CHAT = "completions", "chat"
KINDS = (COMPLETIONS, CHAT)

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
        "response_format",  # text, json_object, json_schema
        "structured_outputs",  # vLLM's extra body field
        "webhook",  # Replicate's: a URL told of the job's events (docs/protocol.md)
        "webhook_events_filter",
    }
)
FIELDS = {
    COMPLETIONS: _COMMON | {"prompt", "best_of", "echo", "suffix"},
    CHAT: _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
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
    n: int = 1  # choices
    echo: bool = False  # completions: the prompt before each choice's text
    prompt_only: bool = False  # echo with max_tokens 0: the prompt scored, nothing generated
    prompt: str = ""  # what echo puts before each choice's text


# --- requests ------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise BadRequest(f"{name} must be an integer, got {quote(value)}", name)
    if not low <= value <= high:
        raise BadRequest(f"{name} must be in [{low}, {high}], got {quote(value)}", name)
    return value


def _only(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    """Fields tokenq takes only at their neutral value (echo=false, ...)."""
    value = body.get(name)
    if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
        raise BadRequest(f"{name}={quote(value)} is not supported: {why}", name)


# Parameters OpenAI (or vLLM's extensions to its API) names as the job does.
_SAME_NAMES = (
    "temperature",
    "top_p",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
)
# Left out of the job at their neutral value, as a request that does not name them.
_NEUTRAL_OMITTED = frozenset({"min_tokens", "ignore_eos", "stop", "stop_token_ids", "logit_bias"})


def _sampling(kind: str, body: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """Sampling parameters by vLLM's names (the job's `params`), checked as the worker
    checks them (`check_sizes`, `SamplingParams`); a refusal's `param` is the request's
    own name for the field."""
    params = {name: body[name] for name in _SAME_NAMES if body.get(name) is not None}
    stop = body.get("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else stop
    top_k = body.get("top_k")
    if top_k is not None and not (_is_int(top_k) and top_k in (0, -1)):  # both off, as in vLLM
        params["top_k"] = top_k
    names = ["max_tokens"] + (["max_completion_tokens"] if kind == CHAT else [])
    given = {n: body[n] for n in names if body.get(n) is not None}
    values = list(given.values())
    if any(v != values[0] or type(v) is not type(values[0]) for v in values):
        raise BadRequest("max_tokens and max_completion_tokens disagree", "max_tokens")
    if given:
        params["max_tokens"] = values[0]
    elif kind == CHAT:
        params["max_tokens"] = None  # as OpenAI and vLLM: up to the model's context
    logprobs = rendering(kind, body).logprobs
    if logprobs is not None:
        params["logprobs"] = logprobs
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        params["n"] = n  # SamplingParams refuses what is not a count
    form = rendering(kind, body)
    if form.echo and logprobs is not None:
        params["prompt_logprobs"] = logprobs  # the prompt's tokens scored, as OpenAI's echo
    if form.prompt_only:
        params["max_tokens"] = 1  # one token is generated (and left out of the answer)
    try:
        check_sizes(params, limits)
        SamplingParams.from_dict(params)
    except InvalidRequest as exc:
        asked = {
            "max_tokens": next(iter(given), "max_tokens"),
            "logprobs": "top_logprobs" if kind == CHAT else "logprobs",
        }
        param = asked.get(exc.param or "", exc.param)
        raise BadRequest(exc.message, param, code=exc.code) from None
    return {k: v for k, v in params.items() if v or k not in _NEUTRAL_OMITTED}


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


def _prompt(body: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """A completion's prompt: a string or token ids, alone or as a batch of one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list):
        bound = limits.max_prompt_token_ids
        if len(prompt) > bound:
            raise BadRequest(f"prompt: {len(prompt)} token ids (limit {bound})", "prompt")
        if not are_token_ids(prompt):
            raise BadRequest("prompt must be a list of non-negative token ids", "prompt")
        return {"prompt_token_ids": prompt}
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


def _structured(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``response_format`` (json_schema, json_object) or vLLM's
    ``structured_outputs`` as the job's ``structured_outputs``, compiled here: a schema the
    checker cannot enforce is a 400 naming it, never a job that ignores it."""
    fmt = body.get("response_format")
    given = body.get("structured_outputs")
    if fmt is not None and fmt != {"type": "text"}:
        if given is not None:
            why = "give response_format or structured_outputs, not both"
            raise BadRequest(why, "response_format")
        param = "response_format"
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            given = {"json_object": True}
        elif kind == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
                raise BadRequest("response_format.json_schema.schema must be an object", param)
            given = {"json": inner["schema"]}
        else:
            raise BadRequest(
                f"response_format.type must be text, json_object or json_schema, got {quote(kind)}",
                param,
            )
    elif given is not None:
        param = "structured_outputs"
    else:
        return {}
    try:
        return {"structured_outputs": check_structured(given, param)}
    except InvalidRequest as exc:
        raise BadRequest(exc.message, param, code=exc.code) from None


def _chat_only(body: dict[str, Any]) -> None:
    if body.get("tools"):
        raise BadRequest("tools are not supported", "tools")
    _only(body, "tool_choice", ("none",), "tools are not supported")


def rendering(kind: str, body: dict[str, Any]) -> Rendering:
    """The answer's form: streamed or not, usage chunk, logprobs per token. The top-n's
    value is the job's `logprobs`, checked by `to_submit_kwargs`, which callers call first."""
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
    if kind == CHAT:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise BadRequest("logprobs must be a boolean", "logprobs")
        top = body.get("top_logprobs")
        if top is not None and not wanted:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (0 if top is None else top) if wanted else None
    else:
        logprobs = body.get("logprobs")
    n = body.get("n")
    echo = kind == COMPLETIONS and body.get("echo") is True
    prompt_only = echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    prompt = body.get("prompt") if echo else ""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return Rendering(
        bool(stream),
        include_usage,
        logprobs,
        n if _is_int(n) else 1,
        echo,
        prompt_only,
        prompt if isinstance(prompt, str) else "",
    )


def to_submit_kwargs(kind: str, body: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Keyword arguments for `Client.submit` / `AsyncClient.submit` from an OpenAI request
    body (`kind`: "completions" or "chat"); raises BadRequest naming the field at fault.

    Unknown fields are refused rather than ignored, so that a client relying on a feature
    tokenq lacks (tools, best_of, suffix) hears so instead of getting something else."""
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
    if kind == COMPLETIONS:
        _only(body, "best_of", (1,), "one completion per request")
        _only(body, "echo", (False, True), "echo is a boolean")
        if body.get("max_tokens") == 0 and body.get("echo") is not True:
            raise BadRequest("max_tokens: 0 only with echo=true (scoring the prompt)", "max_tokens")
        if (
            body.get("echo")
            and "prompt" not in _prompt(body, limits)
            and body.get("logprobs") is None
        ):
            # the gateway has no tokenizer: a scored prompt's text comes from the worker
            raise BadRequest("echo of a token-id prompt needs logprobs", "echo")
        _only(body, "suffix", ("",), "no insertion")
        kwargs: dict[str, Any] = _prompt(body, limits)
    else:
        _chat_only(body)
        kwargs = {"messages": _messages(body)}
    kwargs.update(_sampling(kind, body, limits))
    kwargs.update(_structured(body))
    kwargs.update(_lane(body))
    if model:
        kwargs["model"] = model
    user = body.get("user")
    if user is not None and user != "":
        if not isinstance(user, str) or not TENANT_RE.fullmatch(user):
            raise BadRequest(f"user {quote(user)} must match {TENANT_RE.pattern}", "user")
        kwargs["tenant"] = user
    kwargs.update(_webhook(body))
    return kwargs


def _webhook(body: dict[str, Any]) -> dict[str, Any]:
    webhook, events = body.get("webhook"), body.get("webhook_events_filter")
    refused = check_webhook(webhook, events)
    if refused is not None:
        name = "webhook_events_filter"
        raise BadRequest(refused, name if refused.startswith(name) else "webhook")
    out: dict[str, Any] = {} if webhook is None else {"webhook": webhook}
    if events is not None:
        out["webhook_events_filter"] = events
    return out


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

    def render(self, kind: str, n: int, prompt: DoneEvent | None = None) -> dict[str, Any]:
        """OpenAI's logprobs object: the chosen token's logprob and at most n alternatives.
        With ``prompt`` (a done event holding prompt_logprobs: completions' echo), the
        prompt's tokens come first, the first of them with no logprob (as OpenAI's)."""
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
        tokens = [token_name(t) for t in self.tokens]
        top = [{token_name(t): v for t, v in pairs[: max(n, 1)]} for pairs in self.top]
        if prompt is not None and prompt.prompt_logprobs is not None:
            ids = prompt.prompt_token_ids or []
            scored = prompt.prompt_logprobs
            tokens = [token_name(t) for t in ids] + tokens
            # each position's pairs: the prompt's own token first, then the top-k
            chosen = [None if p is None else p[0][1] for p in scored] + chosen
            top = [
                None if p is None else {token_name(t): v for t, v in [p[0], *p[1:][:n]]}
                for p in scored
            ] + top  # type: ignore[operator]
        return {
            "tokens": tokens,
            "token_logprobs": chosen,
            "top_logprobs": top,
            "text_offset": None,
        }


@dataclass
class ChoiceLogprobs:
    """Each choice's logprobs as its token events bring them (a restart voids its own)."""

    by_choice: dict[int, Logprobs] = field(default_factory=dict)

    def add(self, event: TokenEvent) -> None:
        self.by_choice.setdefault(event.output, Logprobs()).add(event)

    def restart(self, event: RestartEvent) -> None:
        self.by_choice[event.output] = Logprobs()

    def get(self, index: int) -> Logprobs:
        return self.by_choice.get(index) or Logprobs()


def echoed_text(form: Rendering, result: DoneEvent) -> str:
    """What echo puts first: the prompt's text as given, or as the worker decoded a
    token-id prompt it scored."""
    return form.prompt or result.prompt_text or ""


def usage_body(result: DoneEvent, prompt_only: bool = False) -> dict[str, int]:
    """The job's usage: completion tokens summed over its choices (none when only the
    prompt was scored: the token generated for it is not answered)."""
    completion = 0 if prompt_only else result.usage.completion_tokens
    return {
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.usage.prompt_tokens + completion,
    }


@dataclass
class Choice:
    """One choice of an answer: its index, text, finish reason and logprobs."""

    index: int
    text: str
    finish_reason: str


def choices_of(result: DoneEvent) -> list[Choice]:
    """A done event's outputs as choices (one for a job of one output)."""
    if result.outputs is None:
        return [Choice(0, result.text, result.finish_reason)]
    return [Choice(o.index, o.text, o.finish_reason) for o in result.outputs]


def response_body(
    kind: str,
    job_id: str,
    model: str,
    result: DoneEvent,
    created: int,
    logprobs: ChoiceLogprobs | None = None,
    form: Rendering = Rendering(),
) -> dict[str, Any]:
    """The non-streaming answer: `text_completion` or `chat.completion`, a choice per
    output; with echo, each completion's text starts with the prompt."""
    top_logprobs = form.logprobs or 0
    choices = []
    for c in choices_of(result):
        lp = None if logprobs is None else logprobs.get(c.index)
        if lp is not None and form.prompt_only:
            lp = Logprobs()
        echoed = result if form.echo else None
        rendered = None if lp is None else lp.render(kind, top_logprobs, echoed)
        if kind == CHAT:
            choice: dict[str, Any] = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": rendered,
                "finish_reason": c.finish_reason,
            }
        else:
            text = "" if form.prompt_only else c.text
            choice = {
                "index": c.index,
                "text": echoed_text(form, result) + text if form.echo else text,
                "logprobs": rendered,
                "finish_reason": "length" if form.prompt_only else c.finish_reason,
            }
        choices.append(choice)
    return {
        "id": response_id(kind, job_id),
        "object": "chat.completion" if kind == CHAT else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(result, form.prompt_only),
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
    index: int = 0,
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
            "index": index,
            "delta": delta,
            "logprobs": rendered,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": index,
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
    the client's fault 4xx, a deadline 504, anything else the server's (500). A parameter
    the worker refused is named in `param`: its message starts with the field's name, as
    every `SamplingParams` message does."""
    status, kind = _JOB_ERRORS.get(code, (500, "server_error"))
    field = message.partition(":")[0]
    param = field if code == "invalid_params" and field in SAMPLING_PARAMS else None
    return BadRequest(message, param, status, kind, code)
