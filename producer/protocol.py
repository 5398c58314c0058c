"""The tokenq wire protocol: key names, the job payload and the reply events.

Everything a client in another language needs is in docs/protocol.md; this module is the
Python rendering of that document and is shared by the producer and the worker, so both
sides validate a job by the same rules. It imports nothing heavier than msgpack.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 2  # 2: queues per model, priority and tenant (1: one job stream)
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
        "detokenize",
    }
)
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
PAYLOAD_FIELDS = frozenset(
    {
        *PROMPT_FIELDS,
        "params",
        "priority",
        "deadline",
        "model",
        "tenant",
        "metadata",
        "submitted_at",
    }
)
# Job ids become parts of Redis keys and log lines: keep them printable and bounded. Always
# `fullmatch`: with `match`, `$` would let a trailing newline through.
JOB_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}")
# Model names (vLLM's --served-model-name: "smollm2-135m", "org/Model-7B") and tenants
# become parts of Redis keys and log lines.
MODEL_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/@+\-]{0,127}")
TENANT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@\-]{0,63}")
NO_TENANT = "-"  # the queue of jobs that name no tenant
ECHO_CHARS = 100  # how much of a bad value an error message may quote
MAX_PRIORITY = 2**31 - 1

# Reply event types.
TOKEN, DONE, ERROR, RESTART = "token", "done", "error", "restart"
TERMINAL_EVENTS = frozenset({DONE, ERROR})
# Job key values, the job's state as a client sees it (docs/protocol.md, "Keys"): queued,
# then running once tokens stream, then the type of its terminal event.
QUEUED, RUNNING = "queued", "running"
JOB_STATUSES = (QUEUED, RUNNING, DONE, ERROR)


def clip(value: Any, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters: error messages, dead letters and
    log lines quote what was wrong without copying a hostile megabyte into each of them."""
    if isinstance(value, str | bytes | bytearray) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} long)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


@dataclass(frozen=True)
class Limits:
    """Size bounds of one job, checked by the client before anything reaches Redis and by
    the worker before anything reaches the engine (so a producer that skips the client
    meets the same bounds). A bound is what keeps one hostile job from stalling a worker:
    each of these, unbounded, was measured to freeze a worker for seconds.

    The defaults admit any realistic request for a model with a 128k-token context."""

    max_payload_bytes: int = 4 << 20  # the msgpack ``data`` field
    max_prompt_chars: int = 1_000_000  # prompt, or all message contents together
    max_messages: int = 1024
    max_prompt_token_ids: int = 262_144
    # Stop strings cost every step of their job (held-back text is matched against each):
    # 16 x 256 characters keeps that well under a millisecond.
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # each stop string
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # entries
    max_metadata_bytes: int = 64 << 10  # metadata, packed

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = Limits()


# Priority lanes: `priority` keeps vLLM's meaning (an int, lower first) and its sign picks
# the lane. Workers serve the lanes in this order, lower lanes aging up (docs/protocol.md).
INTERACTIVE, DEFAULT, BATCH = "interactive", "default", "batch"
LANES = (INTERACTIVE, DEFAULT, BATCH)
LANE_PRIORITY = {INTERACTIVE: -1, DEFAULT: 0, BATCH: 1}  # what `lane=` alone means


def lane_of(priority: int) -> str:
    return INTERACTIVE if priority < 0 else BATCH if priority > 0 else DEFAULT


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
        """Protocol 1's single job stream: workers answer what lands there with a clear
        `unsupported_version` error instead of leaving an old client waiting."""
        return f"{self.namespace}:jobs"

    def queue(self, model: str, priority: int, tenant: str) -> str:
        """A job stream: one per model, priority and tenant, consumer group `workers`."""
        return f"{self.namespace}:jobs:{model}:{priority}:{tenant}"

    def parse_queue(self, stream: str) -> tuple[str, int, str] | None:
        """(model, priority, tenant) of a queue's key; None for protocol 1's stream."""
        prefix = f"{self.namespace}:jobs:"
        if not stream.startswith(prefix):
            return None
        model, priority, tenant = stream[len(prefix) :].rsplit(":", 2)
        return model, int(priority), tenant

    def queues(self, model: str) -> str:
        """Sorted set of a model's queues: member "<priority>:<tenant>", score priority."""
        return f"{self.namespace}:queues:{model}"

    def backlog(self, model: str, lane: str) -> str:
        """Counter of a model's lane: jobs added and not yet acknowledged (QueueFull)."""
        return f"{self.namespace}:backlog:{model}:{lane}"

    def bell(self, model: str) -> str:
        """A one-entry stream producers touch on every submit: idle workers block on it."""
        return f"{self.namespace}:bell:{model}"

    @property
    def workers(self) -> str:
        """Sorted set of live workers: member consumer name, score last heartbeat (ms)."""
        return f"{self.namespace}:workers"

    def worker(self, consumer: str) -> str:
        """Hash of what a worker serves: names, max_model_len, host, pid, times."""
        return f"{self.namespace}:worker:{consumer}"

    @property
    def dead(self) -> str:
        return f"{self.namespace}:dead"

    @property
    def void(self) -> str:
        """A key that is never written: what a script gets in place of a job's keys when
        an entry has no readable job id."""
        return f"{self.namespace}:void"

    def job(self, job_id: str) -> str:
        return f"{self.namespace}:job:{job_id}"

    def reply(self, job_id: str) -> str:
        return f"{self.namespace}:reply:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self.namespace}:cancel:{job_id}"

    def owner(self, job_id: str) -> str:
        return f"{self.namespace}:owner:{job_id}"

    def entry(self, job_id: str) -> str:
        """The job's own queue entry (`<queue key> <entry id>`), while it is queued."""
        return f"{self.namespace}:entry:{job_id}"

    def metrics(self, consumer: str) -> str:
        return f"{self.namespace}:metrics:{consumer}"


def are_token_ids(ids: list[Any]) -> bool:
    """Whether every item is a non-negative int (bools are not), at C speed: a job's
    prompt ids are checked by the client and again by the worker, and a per-item Python
    check of a long prompt cost more than the rest of its intake."""
    return set(map(type, ids)) <= {int} and (not ids or min(ids) >= 0)


def new_job_id() -> str:
    """A random UUID (version 4) as 32 hex digits, as `uuid.uuid4().hex` writes it, made
    without the UUID object: that cost a client 4.7 us of the 22 us it spent on each job it
    submitted."""
    bits = int.from_bytes(os.urandom(16)) & _UUID4_KEEP | _UUID4_SET
    return f"{bits:032x}"


# The version (4) and variant (10) bits of a random UUID: RFC 4122, 4.4.
_UUID4_KEEP = ~((0xF000 << 64) | (0xC000 << 48)) & ((1 << 128) - 1)
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


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

    def validate(self, limits: Limits = DEFAULT_LIMITS) -> None:
        """Structural checks both sides can make without the model; raises ProtocolError.

        Sizes are checked before contents, so that a hostile entry costs a few length
        checks, never a walk over a megabyte of it."""
        jid = self.job_id

        def bad(message: str, code: str = "invalid_request") -> ProtocolError:
            return ProtocolError(code, message, jid)

        if jid is not None and (not isinstance(jid, str) or not JOB_ID_RE.fullmatch(jid)):
            raise bad(f"job id {clip(jid)} must match {JOB_ID_RE.pattern}")
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
            raise bad(f"model {clip(self.model)} must match {MODEL_RE.pattern}")
        if self.tenant is not None and (
            not isinstance(self.tenant, str) or not TENANT_RE.fullmatch(self.tenant)
        ):
            raise bad(f"tenant {clip(self.tenant)} must match {TENANT_RE.pattern}")
        if self.metadata is not None:
            try:
                size = len(pack(self.metadata))
            except (TypeError, ValueError, OverflowError) as exc:
                raise bad(f"metadata cannot be packed: {clip(str(exc))}") from None
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
        """Names and sizes only: value ranges need the model and are the engine's to check."""
        params = self.params
        if not isinstance(params, dict):
            raise bad("params must be a map", "invalid_params")
        if not SAMPLING_PARAMS.issuperset(params):
            unknown = [k for k in params if k not in SAMPLING_PARAMS]
            names = ", ".join(clip(str(k), 40) for k in unknown[:5])
            raise bad(f"unknown parameter(s): {names}", "invalid_params")
        stop = params.get("stop")
        if isinstance(stop, list):
            if len(stop) > limits.max_stop:
                raise bad(f"stop: {len(stop)} strings (limit {limits.max_stop})", "invalid_params")
        else:
            stop = [stop]
        if any(isinstance(s, str) and len(s) > limits.max_stop_chars for s in stop):
            raise bad(
                f"stop: a string longer than {limits.max_stop_chars} characters", "invalid_params"
            )
        for name, bound in (
            ("stop_token_ids", limits.max_stop_token_ids),
            ("logit_bias", limits.max_logit_bias),
        ):
            value = params.get(name)
            if isinstance(value, list | dict) and len(value) > bound:
                raise bad(f"{name}: {len(value)} entries (limit {bound})", "invalid_params")

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
        for name in ("deadline", "model", "tenant", "metadata", "submitted_at"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @property
    def lane(self) -> str:
        return lane_of(self.priority)

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
        raise ProtocolError("invalid_request", f"job id {clip(job_id)} is not valid", None)
    version = _text(fields.get(b"v"))
    if version != str(PROTOCOL_VERSION):
        raise ProtocolError(
            "unsupported_version",
            f"protocol version {clip(version, 20)} is not supported (this worker speaks "
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
        message = f"data is not msgpack: {clip(str(exc))}"
        raise ProtocolError("invalid_payload", message, job_id) from None
    if not isinstance(data, dict):
        raise ProtocolError("invalid_payload", "data must be a msgpack map", job_id)
    unknown = [k for k in data if k not in PAYLOAD_FIELDS]
    if unknown:
        names = ", ".join(clip(str(k), 40) for k in unknown[:5])
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


@dataclass
class TokenEvent(_Wire):
    index: int  # position of token_ids[0] in the completion
    token_ids: list[int]
    text: str
    logprobs: list[list[tuple[int, float]]] | None = None
    event_id: str = ""
    type: str = field(default=TOKEN, init=False)

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"index": self.index, "token_ids": self.token_ids, "text": self.text}
        if self.logprobs is not None:
            data["logprobs"] = [[list(pair) for pair in top] for top in self.logprobs]
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any], event_id: str) -> TokenEvent:
        logprobs = data.get("logprobs")
        return cls(
            index=data["index"],
            token_ids=list(data["token_ids"]),
            text=data["text"],
            logprobs=None
            if logprobs is None
            else [[(int(t), float(lp)) for t, lp in top] for top in logprobs],
            event_id=event_id,
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
    type: str = field(default=DONE, init=False)

    def to_data(self) -> dict[str, Any]:
        return {
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
    type: str = field(default=RESTART, init=False)

    def to_data(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_data(cls, data: dict[str, Any], event_id: str) -> RestartEvent:
        return cls(data.get("reason", ""), event_id=event_id)


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
        raise ProtocolError("invalid_event", f"unknown reply event type {clip(_text(kind))}")
    return cls.from_data(unpack(fields[b"data"]), _text(event_id) or "")
