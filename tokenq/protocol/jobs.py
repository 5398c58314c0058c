"""The wire format: a job stream entry (`JobRequest`, `decode_job`) and the reply events,
as docs/protocol.md describes them. Producer, gateway and worker validate a job by these
rules; it imports nothing heavier than msgpack."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tokenq.protocol.errors import InvalidRequest, ProtocolError, quote
from tokenq.protocol.keys import JOB_ID_RE, MODEL_RE, TENANT_RE, lane_of
from tokenq.protocol.limits import DEFAULT_LIMITS, MAX_PRIORITY, Limits
from tokenq.protocol.params import are_token_ids, check_sizes
from tokenq.protocol.webhooks import check_owner, check_webhook

PROTOCOL_VERSION = 2  # 2: queues per model, priority and tenant (1: one job stream)
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
# Fields written only when given (the payload leaves absent ones out).
OPTIONAL_FIELDS = (
    "deadline",
    "model",
    "tenant",
    "metadata",
    "submitted_at",
    "webhook",
    "webhook_events_filter",
    "webhook_endpoints",
)
PAYLOAD_FIELDS = frozenset({*PROMPT_FIELDS, "params", "priority", *OPTIONAL_FIELDS})

# Reply event types.
TOKEN, DONE, ERROR, RESTART = "token", "done", "error", "restart"
TERMINAL_EVENTS = frozenset({DONE, ERROR})
# Job key values, the job's state as a client sees it (docs/protocol.md, "Keys"): queued,
# then running once tokens stream, then the type of its terminal event.
QUEUED, RUNNING = "queued", "running"
JOB_STATUSES = (QUEUED, RUNNING, DONE, ERROR)


_packers = threading.local()


def pack(obj: Any) -> bytes:
    """One Packer per thread, kept: `msgpack.packb` builds one per call, which costs more
    than packing a token event (1.7 against 0.7 us), and a worker packs one per job per
    step. (A Packer empties itself when packing fails.)"""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)


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
    tenant: str | None = None
    metadata: Any = None
    submitted_at: float | None = None
    webhook: str | None = None  # a URL told of the job's events (docs/protocol.md, "Webhooks")
    webhook_events_filter: list[str] | None = None  # start, output, completed (the default)
    # Whose endpoints hear the job's job.completed: "" the namespace's, else an API key's.
    webhook_endpoints: str | None = None

    def validate(self, limits: Limits = DEFAULT_LIMITS) -> None:
        """Structural checks both sides can make without the model; raises ProtocolError.

        Sizes are checked before contents, so that a hostile entry costs a few length
        checks, never a walk over a megabyte of it."""
        jid = self.job_id

        def bad(message: str, code: str = "invalid_request") -> ProtocolError:
            return ProtocolError(code, message, jid)

        if jid is not None and (not isinstance(jid, str) or not JOB_ID_RE.fullmatch(jid)):
            raise bad(f"job id {quote(jid)} must match {JOB_ID_RE.pattern}")
        given = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise bad(f"exactly one of prompt, messages, prompt_token_ids is required ({found})")
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise bad("prompt must be a string")
            if len(self.prompt) > limits.max_prompt_chars:
                raise bad(
                    f"prompt has {len(self.prompt)} characters (limit {limits.max_prompt_chars})",
                    "payload_too_large",
                )
        if self.messages is not None:
            self._validate_messages(limits, bad)
        if self.prompt_token_ids is not None:
            ids = self.prompt_token_ids
            if not isinstance(ids, list) or not ids:
                raise bad("prompt_token_ids must be a non-empty list of non-negative integers")
            if len(ids) > limits.max_prompt_token_ids:
                raise bad(
                    f"prompt_token_ids has {len(ids)} ids (limit {limits.max_prompt_token_ids})",
                    "payload_too_large",
                )
            if not are_token_ids(ids):
                raise bad("prompt_token_ids must be a non-empty list of non-negative integers")
        self._validate_params(limits, bad)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise bad("priority must be an integer")
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise bad(f"priority must be within +-{MAX_PRIORITY}")
        for name in ("deadline", "submitted_at"):
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if value is not None and not (number and math.isfinite(value)):
                raise bad(f"{name} must be a finite number (unix seconds)")
        if self.model is not None and (
            not isinstance(self.model, str) or not MODEL_RE.fullmatch(self.model)
        ):
            raise bad(f"model {quote(self.model)} must match {MODEL_RE.pattern}")
        if self.tenant is not None and (
            not isinstance(self.tenant, str) or not TENANT_RE.fullmatch(self.tenant)
        ):
            raise bad(f"tenant {quote(self.tenant)} must match {TENANT_RE.pattern}")
        refused = check_webhook(self.webhook, self.webhook_events_filter)
        if refused is None and self.webhook_endpoints is not None:
            refused = check_owner(self.webhook_endpoints)
        if refused is not None:
            raise bad(refused)
        if self.metadata is not None:
            try:
                size = len(pack(self.metadata))
            except (TypeError, ValueError, OverflowError) as exc:
                raise bad(f"metadata cannot be packed: {quote(str(exc))}") from None
            if size > limits.max_metadata_bytes:
                raise bad(
                    f"metadata is {size} bytes packed (limit {limits.max_metadata_bytes})",
                    "payload_too_large",
                )

    def _validate_messages(self, limits: Limits, bad: Any) -> None:
        messages = self.messages
        if not isinstance(messages, list) or not messages:
            raise bad("messages must be a non-empty list")
        if len(messages) > limits.max_messages:
            raise bad(
                f"{len(messages)} messages (limit {limits.max_messages})", "payload_too_large"
            )
        chars = 0
        for i, msg in enumerate(messages):
            if (
                not isinstance(msg, dict)
                or not isinstance(msg.get("role"), str)
                or not isinstance(msg.get("content"), str)
            ):
                raise bad(f"messages[{i}] must be a map with string role and content")
            chars += len(msg["content"]) + len(msg["role"])
        if chars > limits.max_prompt_chars:
            raise bad(
                f"messages hold {chars} characters (limit {limits.max_prompt_chars})",
                "payload_too_large",
            )

    def _validate_params(self, limits: Limits, bad: Any) -> None:
        """Names and sizes, by the gateway's and the worker's text (`check_sizes`). Values
        are the worker's to check (it builds `SamplingParams`, with the same text)."""
        try:
            check_sizes(self.params, limits)
        except InvalidRequest as exc:
            raise ProtocolError(exc.code, exc.message, self.job_id, exc.param) from None

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
        for name in OPTIONAL_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @property
    def lane(self) -> str:
        return lane_of(self.priority)

    @property
    def weight(self) -> int:
        """What the job counts toward its lane's backlog cap: its outputs (``n``), so that
        one job of n weighs as n jobs of one (1 for an ``n`` the worker will refuse)."""
        n = self.params.get("n", 1) if isinstance(self.params, dict) else 1
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1

    def to_fields(self) -> dict[str, bytes | str]:
        """The job stream entry. The id sits outside the msgpack blob so that a worker can
        still answer the right client when the blob itself is broken."""
        assert self.job_id is not None
        return {"v": str(PROTOCOL_VERSION), "id": self.job_id, "data": pack(self.payload())}


def decode_job(fields: dict[bytes, bytes], limits: Limits = DEFAULT_LIMITS) -> JobRequest:
    """Parse and validate a job stream entry; raises ProtocolError with the job id if the
    id itself could be read. The payload's size is checked before it is unpacked."""
    job_id = _text(fields.get(b"id"))
    if job_id is not None and not JOB_ID_RE.fullmatch(job_id):
        raise ProtocolError("invalid_request", f"job id {quote(job_id)} is not valid", None)
    version = _text(fields.get(b"v"))
    if version != str(PROTOCOL_VERSION):
        raise ProtocolError(
            "unsupported_version",
            f"protocol version {quote(version, 20)} is not supported (this worker speaks "
            f"{PROTOCOL_VERSION})",
            job_id,
        )
    if job_id is None:
        raise ProtocolError("invalid_request", "the entry has no id field", None)
    raw = fields.get(b"data")
    if raw is None:
        raise ProtocolError("invalid_payload", "the entry has no data field", job_id)
    if len(raw) > limits.max_payload_bytes:
        raise ProtocolError(
            "payload_too_large",
            f"data is {len(raw)} bytes (limit {limits.max_payload_bytes})",
            job_id,
        )
    try:
        data = unpack(raw)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        message = f"data is not msgpack: {quote(str(exc))}"
        raise ProtocolError("invalid_payload", message, job_id) from None
    if not isinstance(data, dict):
        raise ProtocolError("invalid_payload", "data must be a msgpack map", job_id)
    unknown = [k for k in data if k not in PAYLOAD_FIELDS]
    if unknown:
        names = ", ".join(quote(str(k), 40) for k in unknown[:5])
        raise ProtocolError("invalid_request", f"unknown field(s): {names}", job_id)
    job = JobRequest(
        prompt=data.get("prompt"),
        messages=data.get("messages"),
        prompt_token_ids=data.get("prompt_token_ids"),
        params=data.get("params", {}),
        job_id=job_id,
        priority=data.get("priority", 0),
        deadline=data.get("deadline"),
        model=data.get("model"),
        tenant=data.get("tenant"),
        metadata=data.get("metadata"),
        submitted_at=data.get("submitted_at"),
        webhook=data.get("webhook"),
        webhook_events_filter=data.get("webhook_events_filter"),
        webhook_endpoints=data.get("webhook_endpoints"),
    )
    job.validate(limits)
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


class _Wire:
    """An event's rendering on the reply stream: fields ``type`` and ``data`` (msgpack)."""

    type: str

    def to_data(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_wire(self) -> dict[str, bytes | str]:
        return {"type": self.type, "data": pack(self.to_data())}


def _pairs(logprobs: list[list[tuple[int, float]]]) -> list[list[list[Any]]]:
    return [[list(pair) for pair in top] for top in logprobs]


def _read_pairs(logprobs: Any) -> list[list[tuple[int, float]]] | None:
    if logprobs is None:
        return None
    return [[(int(t), float(lp)) for t, lp in top] for top in logprobs]


@dataclass
class TokenEvent(_Wire):
    index: int  # position of token_ids[0] in the completion
    token_ids: list[int]
    text: str
    logprobs: list[list[tuple[int, float]]] | None = None
    event_id: str = ""
    output: int = 0  # which of the job's n outputs (sent only when not 0)
    type: str = field(default=TOKEN, init=False)

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"index": self.index, "token_ids": self.token_ids, "text": self.text}
        if self.logprobs is not None:
            data["logprobs"] = _pairs(self.logprobs)
        if self.output:
            data["output"] = self.output
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any], event_id: str) -> TokenEvent:
        return cls(
            index=data["index"],
            token_ids=list(data["token_ids"]),
            text=data["text"],
            logprobs=_read_pairs(data.get("logprobs")),
            event_id=event_id,
            output=int(data.get("output", 0)),
        )


@dataclass
class OutputResult:
    """One of a job's n outputs as its ``done`` event carries it (n > 1)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[list[tuple[int, float]]] | None = None

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": self.index,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            data["logprobs"] = _pairs(self.logprobs)
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> OutputResult:
        return cls(
            int(data["index"]),
            data["text"],
            list(data["token_ids"]),
            data["finish_reason"],
            _read_pairs(data.get("logprobs")),
        )


@dataclass
class DoneEvent(_Wire):
    text: str
    finish_reason: str
    token_ids: list[int] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    metadata: Any = None
    event_id: str = ""
    # n > 1: every output, by index (``text``, ``finish_reason`` and ``token_ids`` above are
    # output 0's); None for one output.
    outputs: list[OutputResult] | None = None
    # The prompt's tokens' log-probabilities (``prompt_logprobs``): None for the first
    # token, then (id, logprob) pairs: that token's first, then the top-k alternatives'.
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_token_ids: list[int] | None = None  # the prompt's tokens, with prompt_logprobs
    prompt_text: str | None = None  # the prompt's text, with prompt_logprobs
    type: str = field(default=DONE, init=False)

    def to_data(self) -> dict[str, Any]:
        data = {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "token_ids": self.token_ids,
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
                "total_tokens": self.usage.total_tokens,
            },
            "timings": {
                "queue_time": self.timings.queue_time,
                "time_to_first_token": self.timings.time_to_first_token,
                "total": self.timings.total,
            },
            "metadata": self.metadata,
        }
        if self.outputs is not None:
            data["outputs"] = [o.to_data() for o in self.outputs]
        if self.prompt_logprobs is not None:
            data["prompt_logprobs"] = [
                None if top is None else [list(pair) for pair in top]
                for top in self.prompt_logprobs
            ]
            data["prompt_token_ids"] = self.prompt_token_ids
            data["prompt_text"] = self.prompt_text
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any], event_id: str) -> DoneEvent:
        usage = data.get("usage") or {}
        timings = data.get("timings") or {}
        return cls(
            text=data["text"],
            finish_reason=data["finish_reason"],
            token_ids=list(data.get("token_ids") or []),
            usage=Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)),
            timings=Timings(
                timings.get("queue_time"), timings.get("time_to_first_token"), timings.get("total")
            ),
            metadata=data.get("metadata"),
            event_id=event_id,
            outputs=None
            if data.get("outputs") is None
            else [OutputResult.from_data(o) for o in data["outputs"]],
            prompt_logprobs=None
            if data.get("prompt_logprobs") is None
            else [
                None if top is None else _read_pairs([top])[0] for top in data["prompt_logprobs"]
            ],
            prompt_token_ids=data.get("prompt_token_ids"),
            prompt_text=data.get("prompt_text"),
        )


@dataclass
class ErrorEvent(_Wire):
    code: str
    message: str
    metadata: Any = None
    event_id: str = ""
    type: str = field(default=ERROR, init=False)

    def to_data(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "metadata": self.metadata}

    @classmethod
    def from_data(cls, data: dict[str, Any], event_id: str) -> ErrorEvent:
        return cls(data["code"], data["message"], data.get("metadata"), event_id=event_id)


@dataclass
class RestartEvent(_Wire):
    """The job was re-run after a worker died and the new run diverged from what had been
    streamed: everything received before this event is void, tokens start again at 0."""

    reason: str
    event_id: str = ""
    output: int = 0  # the output whose tokens start again (n > 1; the others stand)
    type: str = field(default=RESTART, init=False)

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"reason": self.reason}
        if self.output:
            data["output"] = self.output
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any], event_id: str) -> RestartEvent:
        return cls(data.get("reason", ""), event_id=event_id, output=int(data.get("output", 0)))


Event = TokenEvent | DoneEvent | ErrorEvent | RestartEvent
EVENT_TYPES: dict[str, type[TokenEvent | DoneEvent | ErrorEvent | RestartEvent]] = {
    TOKEN: TokenEvent,
    DONE: DoneEvent,
    ERROR: ErrorEvent,
    RESTART: RestartEvent,
}


def encode_event(event: Event) -> dict[str, bytes | str]:
    return event.to_wire()


def reply_seq(event_id: bytes | str) -> int:
    """A reply event's position. Workers write event n at stream id ``0-n``: a worker that
    re-sends a batch whose first send landed (the answer was lost on the way back) is
    recognised by these ids and writes nothing twice."""
    eid = event_id.decode() if isinstance(event_id, bytes) else event_id
    return int(eid.rpartition("-")[2])


# The types by name as a reply stream gives them (bytes) or a decoding client (str).
_TYPES_READ = {**EVENT_TYPES, **{name.encode(): cls for name, cls in EVENT_TYPES.items()}}


def decode_event(event_id: bytes | str, fields: dict[bytes, bytes]) -> Event:
    kind = fields.get(b"type")
    cls = _TYPES_READ.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError("invalid_event", f"unknown reply event type {quote(_text(kind))}")
    return cls.from_data(unpack(fields[b"data"]), _text(event_id) or "")
