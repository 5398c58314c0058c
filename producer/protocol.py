"""The tokenq wire protocol: key names, the job payload and the reply events.

Everything a client in another language needs is in docs/protocol.md; this module is the
Python rendering of that document and is shared by the producer and the worker, so both
sides validate a job by the same rules. It imports nothing heavier than msgpack.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
DEFAULT_NAMESPACE = "tokenq"
GROUP = "workers"

# vLLM's names. Values are validated by the worker's engine, which knows the model.
SAMPLING_PARAMS = frozenset(
    {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logprobs",
        "logit_bias",
    }
)
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
PAYLOAD_FIELDS = frozenset(
    {*PROMPT_FIELDS, "params", "priority", "deadline", "model", "metadata", "submitted_at"}
)
# Job ids become parts of Redis keys and log lines: keep them printable and bounded.
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}$")

TOKEN, DONE, ERROR, RESTART = "token", "done", "error", "restart"
TERMINAL_EVENTS = frozenset({DONE, ERROR})


class ProtocolError(ValueError):
    """A job that breaks the protocol; ``code`` is the error code sent to the client."""

    def __init__(self, code: str, message: str, job_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.job_id = job_id


@dataclass(frozen=True)
class Keys:
    """Every Redis key tokenq uses lives under one namespace, so deployments can share a
    server and tests can clean up after themselves with one SCAN pattern."""

    namespace: str = DEFAULT_NAMESPACE

    @property
    def jobs(self) -> str:
        return f"{self.namespace}:jobs"

    @property
    def dead(self) -> str:
        return f"{self.namespace}:dead"

    def job(self, job_id: str) -> str:
        return f"{self.namespace}:job:{job_id}"

    def reply(self, job_id: str) -> str:
        return f"{self.namespace}:reply:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self.namespace}:cancel:{job_id}"

    def owner(self, job_id: str) -> str:
        return f"{self.namespace}:owner:{job_id}"

    def metrics(self, consumer: str) -> str:
        return f"{self.namespace}:metrics:{consumer}"


def new_job_id() -> str:
    return uuid.uuid4().hex


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    # Integer map keys are legal msgpack (logit_bias); strict_map_key would refuse them.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _text(value: bytes | str | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return value.decode("utf-8", errors="replace")


@dataclass
class JobRequest:
    """One generation job as it travels on the job stream."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    job_id: str | None = None
    priority: int = 0
    deadline: float | None = None  # unix seconds: producers and workers share no clock base
    model: str | None = None
    metadata: Any = None
    submitted_at: float | None = None

    def validate(self) -> None:
        """Structural checks both sides can make without the model; raises ProtocolError."""
        jid = self.job_id

        def bad(message: str, code: str = "invalid_request") -> ProtocolError:
            return ProtocolError(code, message, jid)

        if jid is not None and (not isinstance(jid, str) or not JOB_ID_RE.match(jid)):
            raise bad(f"job id {jid!r} must match {JOB_ID_RE.pattern}")
        given = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise bad(f"exactly one of prompt, messages, prompt_token_ids is required ({found})")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise bad("prompt must be a string")
        if self.messages is not None:
            if not isinstance(self.messages, list) or not self.messages:
                raise bad("messages must be a non-empty list")
            for i, msg in enumerate(self.messages):
                if (
                    not isinstance(msg, dict)
                    or not isinstance(msg.get("role"), str)
                    or not isinstance(msg.get("content"), str)
                ):
                    raise bad(f"messages[{i}] must be a map with string role and content")
        if self.prompt_token_ids is not None:
            ids = self.prompt_token_ids
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise bad("prompt_token_ids must be a non-empty list of non-negative integers")
        if not isinstance(self.params, dict):
            raise bad("params must be a map", "invalid_params")
        unknown = sorted(str(k) for k in self.params if k not in SAMPLING_PARAMS)
        if unknown:
            raise bad(f"unknown parameter(s): {', '.join(unknown)}", "invalid_params")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise bad("priority must be an integer")
        for name in ("deadline", "submitted_at"):
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if value is not None and not number:
                raise bad(f"{name} must be a number (unix seconds)")
        if self.model is not None and not isinstance(self.model, str):
            raise bad("model must be a string")

    def payload(self) -> dict[str, Any]:
        """The msgpack map, without absent optional fields."""
        out: dict[str, Any] = {}
        for name in PROMPT_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.params:
            out["params"] = self.params
        if self.priority:
            out["priority"] = self.priority
        for name in ("deadline", "model", "metadata", "submitted_at"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def to_fields(self) -> dict[str, bytes | str]:
        """The job stream entry. The id sits outside the msgpack blob so that a worker can
        still answer the right client when the blob itself is broken."""
        assert self.job_id is not None
        return {"v": str(PROTOCOL_VERSION), "id": self.job_id, "data": pack(self.payload())}


def decode_job(fields: dict[bytes, bytes]) -> JobRequest:
    """Parse and validate a job stream entry; raises ProtocolError with the job id if the
    id itself could be read."""
    job_id = _text(fields.get(b"id"))
    if job_id is not None and not JOB_ID_RE.match(job_id):
        raise ProtocolError("invalid_request", f"job id {job_id!r} is not valid", None)
    version = _text(fields.get(b"v"))
    if version != str(PROTOCOL_VERSION):
        raise ProtocolError(
            "unsupported_version",
            f"protocol version {version!r} is not supported (this worker speaks "
            f"{PROTOCOL_VERSION})",
            job_id,
        )
    if job_id is None:
        raise ProtocolError("invalid_request", "the entry has no id field", None)
    raw = fields.get(b"data")
    if raw is None:
        raise ProtocolError("invalid_payload", "the entry has no data field", job_id)
    try:
        data = unpack(raw)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError("invalid_payload", f"data is not msgpack: {exc}", job_id) from None
    if not isinstance(data, dict):
        raise ProtocolError("invalid_payload", "data must be a msgpack map", job_id)
    unknown = sorted(str(k) for k in data if k not in PAYLOAD_FIELDS)
    if unknown:
        raise ProtocolError("invalid_request", f"unknown field(s): {', '.join(unknown)}", job_id)
    job = JobRequest(
        prompt=data.get("prompt"),
        messages=data.get("messages"),
        prompt_token_ids=data.get("prompt_token_ids"),
        params=data.get("params", {}),
        job_id=job_id,
        priority=data.get("priority", 0),
        deadline=data.get("deadline"),
        model=data.get("model"),
        metadata=data.get("metadata"),
        submitted_at=data.get("submitted_at"),
    )
    job.validate()
    return job


# --- reply events ---------------------------------------------------------------------


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    """Seconds, measured by the worker from the moment the job entered the job stream."""

    queue_time: float | None = None
    time_to_first_token: float | None = None
    total: float | None = None


@dataclass
class TokenEvent:
    index: int  # position of token_ids[0] in the completion
    token_ids: list[int]
    text: str
    logprobs: list[list[tuple[int, float]]] | None = None
    event_id: str = ""
    type: str = field(default=TOKEN, init=False)


@dataclass
class DoneEvent:
    text: str
    finish_reason: str
    token_ids: list[int] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    metadata: Any = None
    event_id: str = ""
    type: str = field(default=DONE, init=False)


@dataclass
class ErrorEvent:
    code: str
    message: str
    metadata: Any = None
    event_id: str = ""
    type: str = field(default=ERROR, init=False)


@dataclass
class RestartEvent:
    """The job was re-run after a worker died and the new run diverged from what had been
    streamed: everything received before this event is void, tokens start again at 0."""

    reason: str
    event_id: str = ""
    type: str = field(default=RESTART, init=False)


Event = TokenEvent | DoneEvent | ErrorEvent | RestartEvent


def encode_event(event: Event) -> dict[str, bytes | str]:
    if isinstance(event, TokenEvent):
        data: dict[str, Any] = {
            "index": event.index,
            "token_ids": event.token_ids,
            "text": event.text,
        }
        if event.logprobs is not None:
            data["logprobs"] = [[list(pair) for pair in top] for top in event.logprobs]
    elif isinstance(event, DoneEvent):
        data = {
            "text": event.text,
            "finish_reason": event.finish_reason,
            "token_ids": event.token_ids,
            "usage": {
                "prompt_tokens": event.usage.prompt_tokens,
                "completion_tokens": event.usage.completion_tokens,
                "total_tokens": event.usage.total_tokens,
            },
            "timings": {
                "queue_time": event.timings.queue_time,
                "time_to_first_token": event.timings.time_to_first_token,
                "total": event.timings.total,
            },
            "metadata": event.metadata,
        }
    elif isinstance(event, ErrorEvent):
        data = {"code": event.code, "message": event.message, "metadata": event.metadata}
    else:
        data = {"reason": event.reason}
    return {"type": event.type, "data": pack(data)}


def decode_event(event_id: bytes | str, fields: dict[bytes, bytes]) -> Event:
    eid = _text(event_id) or ""
    kind = _text(fields.get(b"type"))
    data = unpack(fields[b"data"])
    if kind == TOKEN:
        logprobs = data.get("logprobs")
        return TokenEvent(
            index=data["index"],
            token_ids=list(data["token_ids"]),
            text=data["text"],
            logprobs=None
            if logprobs is None
            else [[(int(t), float(lp)) for t, lp in top] for top in logprobs],
            event_id=eid,
        )
    if kind == DONE:
        usage = data.get("usage") or {}
        timings = data.get("timings") or {}
        return DoneEvent(
            text=data["text"],
            finish_reason=data["finish_reason"],
            token_ids=list(data.get("token_ids") or []),
            usage=Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)),
            timings=Timings(
                timings.get("queue_time"), timings.get("time_to_first_token"), timings.get("total")
            ),
            metadata=data.get("metadata"),
            event_id=eid,
        )
    if kind == ERROR:
        return ErrorEvent(data["code"], data["message"], data.get("metadata"), event_id=eid)
    if kind == RESTART:
        return RestartEvent(data.get("reason", ""), event_id=eid)
    raise ProtocolError("invalid_event", f"unknown reply event type {kind!r}")
