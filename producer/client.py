"""Producers: submit jobs to the job stream and read their reply streams.

`Client` uses redis-py, `AsyncClient` redis.asyncio; both speak docs/protocol.md and share
the planning code here, so the two cannot drift apart. No torch anywhere: application
servers install only redis, msgpack and structlog.

Connections (docs/protocol.md, "Client connections"): every reply stream a client follows,
however many callers stream at once, is read by one reader (a thread for `Client`, a task
for `AsyncClient`) over one connection with one XREAD for all of them; the reader runs
only while something is followed. Every other command borrows a pooled connection for its
own duration. Both ride out an unreachable Redis for `ClientConfig.retry_for` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import math
import queue
import random
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import hiredis
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenq.producer.errors import (
    ClientClosed,
    JobFailed,
    NotReplicated,
    QueueFull,
    RedisUnavailable,
    UnknownModel,
)
from tokenq.protocol import (
    DEFAULT_LIMITS,
    DEFAULT_NAMESPACE,
    LANE_PRIORITY,
    LANES,
    NO_TENANT,
    PROTOCOL_VERSION,
    TERMINAL_EVENTS,
    DoneEvent,
    ErrorEvent,
    Event,
    JobRequest,
    Keys,
    Limits,
    ProtocolError,
    decode_event,
    lane_of,
    new_job_id,
    pack,
    quote,
)
from tokenq.protocol.connection import (
    CLUSTER_CHANGES,
    DEFAULT_REDIS_URL,
    AsyncCluster,
    Cluster,
    cluster_seeds,
    connect,
    connect_async,
    keepalive_for,
    redacted,
    version_tuple,
)
from tokenq.protocol.keys import Layout
from tokenq.protocol.scripts import source

# Outputs a model's lane may hold (waiting or running) before QueueFull: a job counts its n
# outputs, so one job of n weighs as n jobs of one. Interactive work is refused early (its
# users would rather hear "busy" than wait); batch backlogs are large.
DEFAULT_MAX_BACKLOG = {"interactive": 1_000, "default": 10_000, "batch": 1_000_000}
DEFAULT_JOB_TTL = 24 * 3600  # how long a job id stays taken (the idempotency window)
READ_COUNT = 512
RETRY_BASE = 0.05  # seconds: the pause after a first failure, doubled after each further one
RETRY_CAP = 1.0  # the longest pause, so a server back from a restart is found within ~1 s

# Worth retrying: the server may come back (refused, reset, timed out, loading its data).
# Credentials and ACLs refused are ConnectionErrors too, but waiting does not heal them.
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError)
# On a cluster, also its answers while it changes (a failover): MOVED, CLUSTERDOWN, ...
_CLUSTER_TRANSIENT = (*_TRANSIENT, *CLUSTER_CHANGES)
_PERMANENT = (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)

T = TypeVar("T")


@dataclass(frozen=True)
class ClientConfig:
    """A producer's settings; docs/protocol.md ("Client connections") explains the
    connection and retry ones together."""

    namespace: str = DEFAULT_NAMESPACE
    # The model of jobs that name none (else the one model the live workers serve).
    model: str | None = None
    # Outputs of jobs waiting or running a lane may hold before QueueFull (a job of n counts
    # n), per lane (interactive, default, batch), or one number for every lane.
    max_backlog: int | Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_MAX_BACKLOG))
    job_ttl: int = DEFAULT_JOB_TTL
    # A job for a model no live worker serves fails at once (UnknownModel) unless submitted
    # with queue_anyway=True (or require_worker=False here: workers may start later); the
    # registry of live workers is read at most every registry_ttl seconds.
    require_worker: bool = True
    registry_ttl: float = 2.0
    worker_stale_s: float = 30.0  # a worker silent this long is not counted as live
    # The stream reader's XREAD BLOCK: a newly followed stream joins the read within this
    # time, paid for with one XREAD per block_ms while anything is followed.
    block_ms: int = 100
    # How long a call rides out an unreachable Redis (connection refused or lost, timeouts,
    # a server still loading) before it raises RedisUnavailable; 0 raises at once.
    retry_for: float = 30.0
    # The connection the client builds from a URL; a redis.Redis passed in keeps its own.
    connect_timeout: float = 2.0
    # Also, for any connection, how long past its BLOCK the stream reader waits for an
    # XREAD reply before it counts Redis as unreachable (a frozen server answers nothing).
    socket_timeout: float = 5.0
    health_check_interval: int = 30  # PING a connection idle this long before using it
    max_connections: int = 50  # a command waits for a free connection beyond this
    # Size bounds checked before a job is sent; workers check the same (their own limits).
    limits: Limits = DEFAULT_LIMITS
    # On a Redis Cluster: the namespace's shard count (None: its setting, else one per
    # primary), and whether a submit returns only once a replica holds it (WAIT 1), so
    # that a failover right after cannot lose it (docs/protocol.md, "Redis Cluster").
    shards: int | None = None
    durable_submit: bool = False
    durable_wait_ms: int = 1000  # each WAIT's own timeout; retried within retry_for

    def lane_cap(self, lane: str) -> int:
        caps = self.max_backlog
        return caps if isinstance(caps, int) else caps.get(lane, DEFAULT_MAX_BACKLOG[lane])

    def __post_init__(self) -> None:
        if self.block_ms < 1:
            raise ValueError("block_ms must be at least 1 (XREAD BLOCK 0 would never return)")
        if self.retry_for < 0:
            raise ValueError("retry_for must be >= 0 (0: no retries)")


def make_request(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    prompt_token_ids: list[int] | None = None,
    job_id: str | None = None,
    priority: int | None = None,
    lane: str | None = None,
    deadline: float | None = None,
    model: str | None = None,
    tenant: str | None = None,
    metadata: Any = None,
    webhook: str | None = None,
    webhook_events_filter: list[str] | None = None,
    webhook_endpoints: str | None = None,
    **params: Any,
) -> JobRequest:
    """A job from keyword arguments; sampling parameters go by vLLM's names. Submitting
    checks their names and sizes; their values the worker checks, and a bad one ends the job
    with `invalid_params` and the message `SamplingParams` gives (build one to check first).

    `priority` (lower first) picks the lane by its sign; `lane` alone ("interactive",
    "default", "batch") stands for priority -1, 0 or 1. Both must agree if both are given.

    `webhook`: a URL told of the job's events, those of `webhook_events_filter` ("start",
    "output", "completed"; default completed), by `tokenq webhooks run` (docs/protocol.md).
    `webhook_endpoints`: whose registered endpoints hear its job.completed ("" the
    namespace's)."""
    if lane is not None and lane not in LANES:
        raise ValueError(f"lane must be one of {', '.join(LANES)}, got {lane!r}")
    if priority is None:
        priority = LANE_PRIORITY[lane] if lane is not None else 0
    elif lane is not None and lane_of(priority) != lane:
        raise ValueError(f"priority {priority} is in the {lane_of(priority)} lane, not {lane}")
    return JobRequest(
        prompt=prompt,
        messages=messages,
        prompt_token_ids=prompt_token_ids,
        params=params,
        job_id=job_id,
        priority=priority,
        deadline=deadline,
        model=model,
        tenant=tenant,
        metadata=metadata,
        webhook=webhook,
        webhook_events_filter=webhook_events_filter,
        webhook_endpoints=webhook_endpoints,
    )


def _prepare(requests: Iterable[JobRequest], limits: Limits) -> list[JobRequest]:
    """Copies of the jobs (the caller's stay as they were) with their ids and submit time,
    failing fast on what a worker would reject anyway, before anything reaches Redis."""
    now = time.time()
    out = []
    for req in requests:
        req = copy.copy(req)
        req.job_id = req.job_id or new_job_id()
        req.submitted_at = req.submitted_at or now
        req.validate(limits)
        out.append(req)
    return out


def _payload(req: JobRequest, limits: Limits) -> bytes:
    """A routed job as its entry's msgpack payload, packed once, where its size is checked."""
    try:
        payload = pack(req.payload())
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800"): no UTF-8 holds it
        bad = quote(exc.object[exc.start : exc.end])
        message = f"the job holds text that is not valid Unicode: {bad} has no UTF-8 encoding"
        raise ProtocolError("invalid_request", message, req.job_id) from None
    if len(payload) > limits.max_payload_bytes:
        raise ProtocolError(
            "payload_too_large",
            f"the job is {len(payload)} bytes packed (limit {limits.max_payload_bytes})",
            req.job_id,
        )
    return payload


@dataclass(frozen=True)
class ModelInfo:
    """A model the live workers serve (`Client.models()`), as vLLM's /v1/models lists it."""

    id: str  # the name jobs use (the first --served-model-name)
    aliases: tuple[str, ...]  # further names that reach the same workers
    max_model_len: int
    workers: int  # live workers serving it
    heartbeat_at: float  # unix seconds of the freshest worker's last heartbeat


def _models(rows: list[dict[bytes, bytes]]) -> list[ModelInfo]:
    """Aggregate the registry hashes of live workers by model."""
    by_model: dict[str, dict[str, Any]] = {}
    for row in rows:
        if not row:
            continue
        names = tuple(json.loads(row[b"names"]))
        entry = by_model.setdefault(
            names[0], {"aliases": set(), "len": 0, "workers": 0, "heartbeat": 0.0}
        )
        entry["aliases"].update(names[1:])
        entry["len"] = max(entry["len"], int(row.get(b"max_model_len", b"0")))
        entry["workers"] += 1
        entry["heartbeat"] = max(entry["heartbeat"], float(row.get(b"heartbeat_at", b"0")))
    return [
        ModelInfo(name, tuple(sorted(e["aliases"])), e["len"], e["workers"], e["heartbeat"])
        for name, e in sorted(by_model.items())
    ]


class _Routing:
    """Which model each job goes to: its own, the configured default, or the one model
    served; checked against the live workers (cached for registry_ttl)."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.models: list[ModelInfo] = []
        self.read_at = -math.inf

    @property
    def stale(self) -> bool:
        return time.monotonic() - self.read_at > self.config.registry_ttl

    def update(self, models: list[ModelInfo]) -> None:
        self.models, self.read_at = models, time.monotonic()

    def resolve(self, reqs: list[JobRequest], queue_anyway: bool) -> list[str]:
        """The model each job goes to; UnknownModel if one has none a worker serves."""
        queue_anyway = queue_anyway or not self.config.require_worker
        served = {n for m in self.models for n in (m.id, *m.aliases)}
        out = []
        for req in reqs:
            model = req.model or self.config.model
            if model is None:
                if len(self.models) != 1:
                    raise UnknownModel(None, sorted(served))
                model = self.models[0].id
            if model not in served and not queue_anyway:
                raise UnknownModel(model, sorted(served))
            _check_room(req, model, self.models)
            out.append(model)
        return out

    def needs_registry(self, reqs: list[JobRequest], queue_anyway: bool) -> bool:
        """Whether to read the registry before routing: when the cache is stale, and
        when it would refuse these jobs (a worker may have started since it was read)."""
        queue_anyway = queue_anyway or not self.config.require_worker
        if queue_anyway and all(r.model or self.config.model for r in reqs):
            return False
        if self.stale:
            return True
        try:
            self.resolve(reqs, queue_anyway)
        except UnknownModel:
            return True
        return False


def _check_room(req: JobRequest, model: str, models: list[ModelInfo]) -> None:
    """Refuse a `max_tokens` that the model's context could not hold after even a one-token
    prompt, as vLLM does (the worker, which counts the prompt, checks exactly)."""
    asked = req.params.get("max_tokens")
    context = next((m.max_model_len for m in models if model in (m.id, *m.aliases)), None)
    if isinstance(asked, int) and context is not None and asked > context - 1:
        raise ProtocolError(
            "invalid_params",
            f"max_tokens: {asked} tokens pass model {model}'s context of {context} tokens "
            f"(at most {context - 1} fit after a prompt)",
            req.job_id,
            "max_tokens",
        )


def _submit_args(
    config: ClientConfig,
    reqs: list[JobRequest],
    models: list[str],
    prefix: str | None = None,
    shards: int = 1,
) -> list[Any]:
    """SUBMIT's arguments (tokenq/protocol/scripts/submit.lua) for the prepared jobs, each
    routed to its model and weighing its n outputs; on a cluster, for one shard (its key
    prefix), whose lanes hold a `1/shards` share of each cap."""
    caps = (-(-config.lane_cap(x) // shards) for x in LANES)
    args: list[Any] = [prefix or config.namespace, config.job_ttl, *caps]
    for r, model in zip(reqs, models, strict=True):
        r.model = model  # the client's own copy (_prepare)
        args += [r.job_id, r.model, r.priority, r.tenant or NO_TENANT, r.lane]
        args += [PROTOCOL_VERSION, _payload(r, config.limits), r.weight]
    return args


def _hook_streams(keys: Keys, reqs: list[JobRequest], models: list[str]) -> list[str]:
    """The webhook event streams the routed jobs' webhooks will use: listed for dispatchers
    before the jobs are queued (SADD, one key of its own: no script spans it)."""
    return sorted(
        {
            keys.hooks(keys.queue(model, r.priority, r.tenant or NO_TENANT))
            for r, model in zip(reqs, models, strict=True)
            if r.webhook is not None or r.webhook_endpoints is not None
        }
    )


def _submitted(answer: list[Any]) -> list[bool]:
    if answer[0] == b"full":
        _, lane, have, cap, model = answer
        raise QueueFull(int(have), int(cap), lane.decode(), model.decode())
    return [bool(flag) for flag in answer[1]]


def _registry_rows(conn: Any, keys: Keys, consumers: list[bytes]) -> Any:
    with conn.pipeline(transaction=False) as pipe:
        for consumer in consumers:
            pipe.hgetall(keys.worker(consumer.decode()))
        return pipe.execute()


def _check_binary(conn: Any) -> None:
    kwargs = conn.connection_pool.connection_kwargs
    if kwargs.get("decode_responses"):
        raise ValueError("tokenq needs a Redis client with decode_responses=False (msgpack)")


def _own_pool_options(config: ClientConfig, url: str) -> dict[str, Any]:
    """A URL-built client's pool: bounded waits on connect and on every read, keepalive and
    health checks to find dead connections, and no retries of redis-py's own (they would
    spend retry_for unseen). Beyond max_connections a command waits for a free connection
    rather than failing. Options in the URL's query string win over these."""
    return {
        "socket_connect_timeout": config.connect_timeout,
        "socket_timeout": config.socket_timeout,
        **keepalive_for(url),
        "health_check_interval": config.health_check_interval,
        "max_connections": config.max_connections,
        "timeout": None,
    }


def _where(conn: Any) -> str:
    """The server a client talks to, for error messages: never its password."""
    kwargs = conn.connection_pool.connection_kwargs
    if "cluster" in kwargs:  # a shard's connection (Cluster.bound): the node may change
        return f"cluster {redacted(kwargs['cluster'].url)} slot {kwargs['slot']}"
    if kwargs.get("path"):
        return f"unix://{kwargs['path']} db {kwargs.get('db', 0)}"
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)} db {kwargs.get('db', 0)}"


def _backoff(failures: int) -> float:
    """Exponential, capped, with jitter so that clients cut off together do not come back
    in lockstep."""
    return min(RETRY_CAP, RETRY_BASE * 2 ** (failures - 1)) * random.uniform(0.5, 1.0)


@dataclass
class _RetryBudget:
    """One call's allowance of retries: from its first try, `retry_for` seconds."""

    retry_for: float
    where: str
    started: float = field(default_factory=time.monotonic)
    failures: int = 0

    def pause(self, error: Exception) -> float:
        """The pause before the next try, at most up to the end of the budget (so the
        last try comes at the end); RedisUnavailable once the budget is spent."""
        spent = time.monotonic() - self.started
        if spent >= self.retry_for:
            raise RedisUnavailable(self.where, spent, error) from error
        self.failures += 1
        return min(_backoff(self.failures), self.retry_for - spent)


def _result(job_id: str, event: Event) -> DoneEvent:
    if isinstance(event, ErrorEvent):
        raise JobFailed(job_id, event.code, event.message)
    assert isinstance(event, DoneEvent)
    return event


# --- following reply streams -----------------------------------------------------------

StreamId = tuple[int, int]


def _parse_id(value: str | bytes) -> StreamId:
    ms, _, seq = value.partition(b"-" if isinstance(value, bytes) else "-")  # type: ignore[arg-type]
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        raise ValueError(f"{text!r} is not a stream entry id (such as '0-0')") from None


def _streams(reply: Any) -> list[tuple[Any, Any]]:
    """(stream key, entries) of a raw XREAD reply: RESP2 (an array of [key, entries]) or
    RESP3 (a map of key -> entries); none when BLOCK ran out."""
    return list(reply.items() if isinstance(reply, dict) else reply or ())


def wakes_with_one_stream(info: Any) -> bool:
    """Whether a server (its INFO server answer) ends a blocked read of several streams
    with the one whose write woke it, the others left for the next read: Redis before 7.2
    (7.2 runs the read again and answers with every stream that has entries; Valkey
    reports the Redis version it speaks)."""
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    found = re.search(r"^redis_version:(\S+)", text, re.MULTILINE)
    version = version_tuple(found[1]) if found else ()
    return len(version) == 2 and version < (7, 2)


def _one_stream_wakes(conn: Any) -> bool:
    """`wakes_with_one_stream` of the server behind a reader's connection; False where INFO
    is refused (an ACL): such a reader reads on as a newer server's would."""
    try:
        conn.send_command("INFO", "server")
        return wakes_with_one_stream(conn.read_response())
    except redis.ResponseError:
        return False


async def _one_stream_wakes_async(conn: Any) -> bool:
    try:
        await conn.send_command("INFO", "server")
        return wakes_with_one_stream(await conn.read_response())
    except redis.ResponseError:
        return False


def _entries(reply: Any) -> Iterator[tuple[str, bytes, dict[bytes, bytes]]]:
    """(stream key, entry id, fields) of a raw XREAD reply: RESP2 (an array of [key,
    entries]) or RESP3 (a map of key -> entries); nil when BLOCK ran out."""
    for stream, entries in _streams(reply):
        key = stream.decode() if isinstance(stream, bytes) else stream
        for entry_id, flat in entries:
            if isinstance(flat, dict):
                yield key, entry_id, flat
            elif len(flat) == 4:  # type and data: every event a worker writes
                yield key, entry_id, {flat[0]: flat[1], flat[2]: flat[3]}
            else:
                yield key, entry_id, dict(zip(flat[::2], flat[1::2], strict=True))


class _Sink(Protocol):
    """Where the reader hands a follower its events: queue.SimpleQueue for the sync
    client, asyncio.Queue for the async one."""

    def put_nowait(self, item: Any, /) -> None: ...


# What a sink carries: what one read brought its followers, each entry a follower's next
# event or the exception that ends it (one put for them all: the caller's thread wakes
# once per read, not once per event); None only asks the waiting caller to look at the
# reader's state again (Redis became unreachable).
_Item = list[tuple["_Follower", Event | Exception]] | None


@dataclass(eq=False)
class _Follower:
    """One caller following one reply stream."""

    key: str
    position: StreamId  # the last entry handed to the caller's sink: read after it
    sink: _Sink  # shared by the jobs of one stream_many
    joined: float  # monotonic: an outage counts against this follower from here at most
    after: bytes | str = ""  # `position` as XREAD takes it (the entry's own id, as read)

    def __post_init__(self) -> None:
        self.after = self.after or f"{self.position[0]}-{self.position[1]}"


class _Multiplex:
    """What a client's stream reader does, without the I/O, for the thread reader and the
    task reader alike: which streams to XREAD from which ids, which follower gets which
    entry, and when a waiting follower gives up.

    Each follower keeps its own position, so followers of one stream at different points,
    or joining while others read, each get every entry after theirs exactly once, in
    order; after a reconnect the reader simply reads on from the positions.
    """

    def __init__(
        self, config: ClientConfig, where: str, transient: tuple[type[Exception], ...] = _TRANSIENT
    ) -> None:
        self.transient = transient
        self.config = config
        self.where = where
        self.by_key: dict[str, list[_Follower]] = {}
        self.ok_at = time.monotonic()  # the last XREAD reply
        self.error: Exception | None = None  # why the reads since ok_at failed
        self.failures = 0
        self.closed = False
        # The server's `wakes_with_one_stream`; None: not asked yet (again after a failure:
        # the reader may reconnect to another server).
        self.one_stream_wakes: bool | None = None

    @property
    def reply_wait(self) -> float:
        """How long the reader waits for an XREAD reply before it counts Redis as gone."""
        return self.config.block_ms / 1000 + self.config.socket_timeout

    def add(self, followers: list[_Follower]) -> None:
        if self.closed:
            raise ClientClosed("stream on a closed client")
        for follower in followers:
            self.by_key.setdefault(follower.key, []).append(follower)

    def remove(self, followers: Iterable[_Follower]) -> None:
        for follower in followers:
            same_key = self.by_key.get(follower.key, [])
            if follower in same_key:
                same_key.remove(follower)
                if not same_key:
                    del self.by_key[follower.key]

    def followed_beside(self, sink: _Sink) -> bool:
        """Whether a caller other than `sink`'s follows a stream."""
        return any(f.sink is not sink for same_key in self.by_key.values() for f in same_key)

    def xread_command(self) -> bytes | None:
        """The next read (each stream from its least advanced follower), packed for the
        wire, or None when nothing is followed and the reader should end. Packed by
        hiredis itself: redis-py's `send_command` walks the arguments in Python first,
        twice the time for the 130 arguments of a read of 64 streams."""
        if self.closed or not self.by_key:
            return None
        return self._read(("BLOCK", self.config.block_ms), {})

    def follow_up(self, reply: Any) -> bytes | None:
        """The read, without BLOCK, of the other followed streams after a blocked read
        that a server of `one_stream_wakes` ended with one: a burst of events (a step's
        first tokens for a batch of jobs) fills them all in one call, and the caller is then
        handed them together, as by a newer server, not the rest a wake-up later. None
        when no such read is due."""
        streams = _streams(reply)
        if not self.one_stream_wakes or len(streams) != 1 or len(self.by_key) < 2:
            return None
        key, entries = streams[0]
        key = key.decode() if isinstance(key, bytes) else key
        return self._read((), {key: entries[-1][0]} if entries else {})

    def _read(self, block: tuple[Any, ...], read_to: dict[str, Any]) -> bytes:
        """An XREAD of every followed stream, each from its least advanced follower, or
        from `read_to` (an entry a reply just brought); packed for the wire."""
        keys = list(self.by_key)
        ids = []
        for key, followers in self.by_key.items():
            first = followers[0]  # most often the only one
            if len(followers) > 1:
                first = min(followers, key=lambda f: f.position)
            ids.append(read_to.get(key, first.after))
        return hiredis.pack_command(("XREAD", "COUNT", READ_COUNT, *block, "STREAMS", *keys, *ids))

    def dispatch(self, reply: Any) -> None:
        """Hand each entry to the followers that have not had it; a follower whose stream
        ended (or held an entry that cannot be decoded) is done."""
        self.ok_at = time.monotonic()
        self.error = None
        self.failures = 0
        batches: dict[int, tuple[_Sink, list[tuple[_Follower, Event | Exception]]]] = {}
        for key, entry_id, fields in _entries(reply):
            followers = self.by_key.get(key)
            if not followers:
                continue  # its followers ended while the read was on its way
            position = _parse_id(entry_id)
            item: Event | Exception
            try:
                item = decode_event(entry_id, fields)
            except Exception as exc:  # msgpack raises many types; fail this stream only
                item = exc
            ends = isinstance(item, Exception) or item.type in TERMINAL_EVENTS
            for follower in list(followers) if ends else followers:
                if position <= follower.position:
                    continue
                follower.position, follower.after = position, entry_id
                batch = batches.get(id(follower.sink))
                if batch is None:
                    batch = batches[id(follower.sink)] = (follower.sink, [])
                batch[1].append((follower, item))
                if ends:
                    self.remove([follower])
        for sink, batch in batches.values():
            sink.put_nowait(batch)

    def failed(self, error: Exception) -> float:
        """Record a failed read; returns the pause before the next. Redis unreachable:
        wake every waiting caller to check its retry budget. Anything else (a command
        refused, a bug): no retry helps, every follower gets the error."""
        self.one_stream_wakes = None
        if isinstance(error, _PERMANENT) or not isinstance(error, self.transient):
            self._end_all(error)
            return 0.0
        self.error = error
        self.failures += 1
        followers = [f for same_key in self.by_key.values() for f in same_key]
        for sink in {id(f.sink): f.sink for f in followers}.values():
            sink.put_nowait(None)
        return _backoff(self.failures)

    def close(self) -> None:
        self.closed = True
        self._end_all(ClientClosed("the client was closed"))

    def _end_all(self, error: Exception) -> None:
        for same_key in self.by_key.values():
            for follower in same_key:
                follower.sink.put_nowait([(follower, error)])
        self.by_key.clear()

    def wait_limit(self, joined: float, deadline: float | None) -> float | None:
        """How long a follower may wait for its next item (None: no limit). Raises the
        builtin TimeoutError at its deadline, or RedisUnavailable once Redis has been
        unreachable for retry_for since it joined: whichever comes first."""
        now = time.monotonic()
        give_up = None
        if self.error is not None:
            give_up = max(self.ok_at, joined) + self.config.retry_for
        if deadline is not None and now >= deadline and (give_up is None or deadline <= give_up):
            raise TimeoutError("no terminal event before the timeout")
        if give_up is not None and now >= give_up:
            assert self.error is not None
            waited = now - max(self.ok_at, joined)
            raise RedisUnavailable(self.where, waited, self.error) from self.error
        limits = [t - now for t in (deadline, give_up) if t is not None]
        return min(limits, default=None)


def _unwrap(item: _Item) -> Iterator[tuple[str, Event]]:
    """A sink item's events as (reply key, event), in order; raises the exception that
    ended a follower where it comes."""
    for follower, payload in item or ():
        if isinstance(payload, Exception):
            raise payload
        yield follower.key, payload


def _start(positions: dict[str, str], sink: _Sink) -> list[_Follower]:
    joined = time.monotonic()
    return [_Follower(key, _parse_id(after), sink, joined) for key, after in positions.items()]


def _io_bound(conn: redis.Redis, config: ClientConfig) -> float:
    """The longest one read's socket calls can wait on a server that stopped answering:
    connecting (TCP, then up to six round trips of the handshake), INFO, the XREAD and its
    follow-up; infinite where the connections have no socket timeout."""
    kwargs = conn.connection_pool.connection_kwargs
    socket_timeout = kwargs.get("socket_timeout")
    connect_timeout = kwargs.get("socket_connect_timeout") or socket_timeout
    if socket_timeout is None or connect_timeout is None:
        return math.inf
    return connect_timeout + 10 * socket_timeout + config.block_ms / 1000


class _ThreadReader:
    """The sync client's stream reader: one pooled connection at a time sends one XREAD
    BLOCK over every followed stream and hands entries to the callers' queues. A caller
    that follows alone reads on its own thread, and its events need no hand-off: on a VM
    whose cores a worker kept busy, waking a waiting thread took up to 4 ms
    (docs/performance.md). A thread of the reader's own reads instead while callers of
    other queues follow too (a caller may be busy with its events for any time), and for
    a caller whose deadline comes before its socket calls could time out; it ends
    (returning its connection) when nothing is followed. So a stuck socket never holds a
    caller past its timeout: it waits on its queue, or reads only when the read's every
    wait ends first."""

    def __init__(
        self,
        conn: redis.Redis,
        config: ClientConfig,
        transient: tuple[type[Exception], ...] = _TRANSIENT,
    ) -> None:
        self.redis = conn
        self.mux = _Multiplex(config, _where(conn), transient)
        self.lock = threading.Lock()  # guards mux and what follows; never held across I/O
        self.thread: threading.Thread | None = None
        self.reading = False  # a caller reads now, on its own thread
        self.resume_at = 0.0  # after a caller's failed read: none before (its backoff)
        self.io_bound = _io_bound(conn, config)
        self.stopped = threading.Event()  # cuts a pause short when the client closes

    def follow(
        self, positions: dict[str, str], timeout: float | None
    ) -> Iterator[tuple[str, Event]]:
        """Events of the streams in `positions` (reply key -> the last id handled) until
        each has ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sink: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        followers = _start(positions, sink)
        with self.lock:
            self.mux.add(followers)
        try:
            live = len(followers)
            while live:
                with self.lock:
                    limit = self.mux.wait_limit(followers[0].joined, deadline)
                    backoff = self.resume_at - time.monotonic()
                    idle = self.thread is None and not self.reading  # nobody reads
                    read_here = idle and backoff <= 0 and sink.empty()
                    if read_here and limit is not None and limit < self.io_bound:
                        read_here = False
                        self._start_thread()
                    elif idle and backoff > 0:
                        limit = backoff if limit is None else min(limit, backoff)
                    self.reading |= read_here
                try:
                    if read_here:
                        self._read_here(sink)
                        item = sink.get_nowait()
                    else:
                        item = sink.get(timeout=limit)
                except queue.Empty:
                    continue
                for key, event in _unwrap(item):
                    yield key, event
                    if event.type in TERMINAL_EVENTS:
                        live -= 1
        finally:
            with self.lock:
                self.mux.remove(followers)
                self._hand_over(sink)

    def _read_here(self, sink: _Sink) -> None:
        """One read on the thread of the caller of `sink`; a failure is recorded for every
        follower, as the thread's would be."""
        pool = self.redis.connection_pool
        conn = None
        try:
            with self.lock:
                command = self.mux.xread_command()
            if command is None:
                return  # closed: the callers have their ClientClosed
            conn = pool.get_connection()
            self._read(conn, command)
        except Exception as exc:  # as the thread's: every follower hears of it
            if conn is not None:
                conn.disconnect()
            with self.lock:
                self.resume_at = time.monotonic() + self.mux.failed(exc)
        finally:
            if conn is not None:
                pool.release(conn)
            with self.lock:
                self.reading = False
                self._hand_over(sink)

    def _hand_over(self, sink: _Sink) -> None:
        """(Lock held.) Start the thread when callers other than `sink`'s follow and
        nobody reads for them: the caller that read last may now be busy with its events."""
        if self.thread is None and not self.reading and self.mux.followed_beside(sink):
            self._start_thread()

    def _start_thread(self) -> None:
        self.thread = threading.Thread(target=self._run, name="tokenq-reader", daemon=True)
        self.thread.start()

    def _read(self, conn: Any, command: bytes) -> None:
        """Send one XREAD (and on a server that wakes with one stream, its follow-up) and
        hand what it brings to the callers. Raises redis.TimeoutError if no reply came
        within `reply_wait` (can_read waits at most that, whatever the socket's timeout)."""
        if self.mux.one_stream_wakes is None:
            self.mux.one_stream_wakes = _one_stream_wakes(conn)
        conn.send_packed_command([command])
        wait = self.mux.reply_wait
        if not conn.can_read(timeout=wait):
            raise redis.TimeoutError(f"no XREAD reply in {wait:.1f}s")
        reply = conn.read_response()
        with self.lock:
            follow_up = self.mux.follow_up(reply)
        if follow_up is not None:
            conn.send_packed_command([follow_up])
            reply = _streams(reply) + _streams(conn.read_response())
        with self.lock:
            self.mux.dispatch(reply)

    def _run(self) -> None:
        pool = self.redis.connection_pool
        conn = None
        try:
            while True:
                with self.lock:
                    command = self.mux.xread_command()
                    if command is None:
                        self.thread = None
                        return
                try:
                    if conn is None:
                        conn = pool.get_connection()
                    self._read(conn, command)
                except Exception as exc:  # the reader must not die silently: report it all
                    if conn is not None:
                        conn.disconnect()  # a reply may still be on its way: start clean
                    with self.lock:
                        pause = self.mux.failed(exc)
                    self.stopped.wait(pause)
        finally:
            if conn is not None:
                pool.release(conn)

    def close(self) -> None:
        with self.lock:
            self.mux.close()
        self.stopped.set()


class _TaskReader:
    """The async client's stream reader: as `_ThreadReader`, with a task in the event loop
    of the follower that started it."""

    def __init__(
        self,
        conn: aioredis.Redis,
        config: ClientConfig,
        transient: tuple[type[Exception], ...] = _TRANSIENT,
    ) -> None:
        self.redis = conn
        self.mux = _Multiplex(config, _where(conn), transient)
        self.task: asyncio.Task[None] | None = None

    async def follow(
        self, positions: dict[str, str], timeout: float | None
    ) -> AsyncIterator[tuple[str, Event]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        sink: asyncio.Queue[_Item] = asyncio.Queue()
        followers = _start(positions, sink)
        self.mux.add(followers)
        if self.task is None and followers:
            self.task = asyncio.get_running_loop().create_task(self._run())
        try:
            live = len(followers)
            while live:
                limit = self.mux.wait_limit(followers[0].joined, deadline)
                try:
                    async with asyncio.timeout(limit):
                        item = await sink.get()
                except TimeoutError:
                    continue
                for key, event in _unwrap(item):
                    yield key, event
                    if event.type in TERMINAL_EVENTS:
                        live -= 1
        finally:
            self.mux.remove(followers)

    async def _run(self) -> None:
        pool = self.redis.connection_pool
        conn = None
        try:
            while (command := self.mux.xread_command()) is not None:
                try:
                    if conn is None:
                        conn = await pool.get_connection()
                    if self.mux.one_stream_wakes is None:
                        self.mux.one_stream_wakes = await _one_stream_wakes_async(conn)
                    async with asyncio.timeout(self.mux.reply_wait):
                        await conn.send_packed_command([command])
                        # inf: this wait alone bounds the read, not the socket's timeout
                        # (which may be shorter than the BLOCK).
                        reply = await conn.read_response(timeout=math.inf)
                        follow_up = self.mux.follow_up(reply)
                        if follow_up is not None:
                            await conn.send_packed_command([follow_up])
                            reply = _streams(reply) + _streams(await conn.read_response())
                    self.mux.dispatch(reply)
                except Exception as exc:  # the reader must not die silently: report it all
                    error = exc
                    if isinstance(exc, TimeoutError):  # asyncio's, from our own wait
                        error = redis.TimeoutError(f"no XREAD reply in {self.mux.reply_wait:.1f}s")
                    if conn is not None:
                        await conn.disconnect()
                    await asyncio.sleep(self.mux.failed(error))
        finally:
            # Before any await: a follower arriving from here on starts a new task.
            self.task = None
            if conn is not None:
                await pool.release(conn)

    async def aclose(self) -> None:
        self.mux.close()
        task = self.task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _by_shard(
    layout: Layout, reqs: list[JobRequest], models: list[str]
) -> dict[int, list[tuple[int, str]]]:
    """The prepared jobs' positions with their models, grouped by the shard each job id
    falls in."""
    groups: dict[int, list[tuple[int, str]]] = {}
    for n, (r, model) in enumerate(zip(reqs, models, strict=True)):
        groups.setdefault(layout.index(r.job_id), []).append((n, model))  # type: ignore[arg-type]
    return groups


class _Identified(Protocol):
    @property
    def id(self) -> str: ...


J = TypeVar("J", bound=_Identified)


def _replies_by_shard(
    layout: Layout, shards: list[Any], jobs: Iterable[J]
) -> dict[int, dict[str, J]]:
    """The jobs by the reply stream each follows, grouped by the shard its id falls in."""
    groups: dict[int, dict[str, J]] = {}
    for j in jobs:
        index = layout.index(j.id)
        groups.setdefault(index, {})[shards[index].keys.reply(j.id)] = j
    return groups


def _call_on(conn: Any, *command: Any) -> Any:
    conn.send_packed_command([hiredis.pack_command(command)])
    return conn.read_response()


async def _call_on_async(conn: Any, *command: Any) -> Any:
    await conn.send_packed_command([hiredis.pack_command(command)])
    return await conn.read_response()


def _fan_in(
    follows: list[tuple[Iterator[tuple[str, Event]], dict[str, Any]]],
) -> Iterator[tuple[str, Event, dict[str, Any]]]:
    """The events of several shards' followers as they come, each shard's on a thread
    of its own (one XREAD cannot name keys of several slots); an error of one ends all."""
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stop = threading.Event()

    def pump(follow: Iterator[tuple[str, Event]], by_key: dict[str, Any]) -> None:
        try:
            for key, event in follow:
                out.put((key, event, by_key))
                if stop.is_set():
                    break
        except Exception as exc:
            out.put(exc)
        finally:
            out.put(None)

    threads = [
        threading.Thread(target=pump, args=pair, name="tokenq-fan-in", daemon=True)
        for pair in follows
    ]
    for thread in threads:
        thread.start()
    try:
        live = len(threads)
        while live:
            item = out.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        stop.set()


# --- sync ------------------------------------------------------------------------------


@dataclass
class Job:
    """A handle to one submitted job; cheap, and recreatable from the id with `Client.job`."""

    id: str
    client: Client
    # The id was already taken when this submit looked. Also True when the submit's own
    # transaction ran but its reply was lost and the retry found the job it had queued.
    duplicate: bool = False

    def stream(self, after: str = "0-0", timeout: float | None = None) -> Iterator[Event]:
        """Yield reply events as they arrive, ending with `done` or `error`.

        Pass the `event_id` of the last event you handled as `after` to resume from it.
        Redis going away for less than `retry_for` is ridden out without a gap or a
        repeat; longer raises RedisUnavailable. `timeout` bounds the whole wait: the
        builtin TimeoutError when it runs out, even if Redis stopped answering.
        """
        shard = self.client._shard(self.id)
        for _, event in shard.reader.follow({shard.keys.reply(self.id): after}, timeout):
            yield event

    def result(self, timeout: float | None = None) -> DoneEvent:
        """The final `done` event; raises JobFailed on `error`, TimeoutError on timeout."""
        *_, last = self.stream(timeout=timeout)
        return _result(self.id, last)

    def cancel(self) -> None:
        """Ask the worker to stop this job; the reply ends with finish reason `cancelled`."""
        shard, ttl = self.client._shard(self.id), self.client.config.job_ttl
        key = shard.keys.cancel(self.id)
        self.client._retrying(lambda: shard.redis.set(key, b"1", ex=ttl))

    def status(self) -> str:
        """queued, running (tokens are streaming), done, error, or unknown (never
        submitted, or its idempotency window has passed)."""
        shard = self.client._shard(self.id)
        key = shard.keys.job(self.id)
        value = self.client._retrying(lambda: shard.redis.get(key))
        return value.decode() if value else "unknown"


@dataclass
class _Shard:
    """Where a share of a client's jobs live: one server, or one shard of a cluster (its
    keys, a connection to the primary holding them, SUBMIT bound to it, its reader)."""

    keys: Keys
    redis: Any
    submit: Any
    reader: Any


class Client:
    """Synchronous producer, safe to share between threads.

    Given a URL it builds its own connection pool (see `ClientConfig`); given a
    `redis.Redis` it uses that, with its settings. All the reply streams its callers
    follow are read by one background thread over one connection (on a cluster, one per
    shard). A URL naming a node of a Redis Cluster, or `redis+cluster://` with seed nodes,
    spreads the jobs over the namespace's shards (docs/protocol.md, "Redis Cluster").
    """

    def __init__(
        self,
        conn: redis.Redis | Cluster | str = DEFAULT_REDIS_URL,
        config: ClientConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.config = dataclasses.replace(config or ClientConfig(), **overrides)
        if isinstance(conn, str):
            options = _own_pool_options(self.config, conn)
            conn = connect(
                conn,
                connection_pool_class=redis.BlockingConnectionPool,
                retry=Retry(NoBackoff(), 0),
                **options,
            )
        self.cluster = conn if isinstance(conn, Cluster) else None
        self.keys = Keys(self.config.namespace)
        if self.cluster is None:
            self.redis = conn
            _check_binary(self.redis)
            self.layout = Layout(self.config.namespace)
            self._reader = _ThreadReader(self.redis, self.config)
            self._submit = self.redis.register_script(source("submit"))
            self._shards = [_Shard(self.keys, self.redis, self._submit, self._reader)]
        else:
            self.redis = self.cluster.redis
            count = self.cluster.shard_count(self.config.namespace, self.config.shards)
            self.layout = Layout(self.config.namespace, count)
            self._shards = []
            for keys in self.layout.shards:
                bound = self.cluster.bound(keys.prefix)
                submit = bound.register_script(source("submit"))
                reader = _ThreadReader(bound, self.config, _CLUSTER_TRANSIENT)
                self._shards.append(_Shard(keys, bound, submit, reader))
            self._reader = self._shards[0].reader
        self._routing = _Routing(self.config)
        self._closed = False

    def _shard(self, job_id: str) -> _Shard:
        return self._shards[self.layout.index(job_id)]

    def keys_of(self, job_id: str) -> Keys:
        """The keys of a job (on a cluster, its shard's; `redis` reaches them)."""
        return self._shards[self.layout.index(job_id)].keys

    def submit(
        self, prompt: str | None = None, *, queue_anyway: bool = False, **kwargs: Any
    ) -> Job:
        """Submit one job; see `make_request` for the arguments. Raises QueueFull, and
        UnknownModel when no live worker serves its model (unless `queue_anyway`)."""
        return self.submit_many([make_request(prompt, **kwargs)], queue_anyway=queue_anyway)[0]

    def submit_many(
        self, requests: Iterable[JobRequest], *, queue_anyway: bool = False
    ) -> list[Job]:
        """Submit jobs at once (one script call): all are queued, or QueueFull and none is.
        On a cluster, one script call per shard the jobs fall in: all or none per shard.

        A job id already taken is a duplicate: nothing is added for it, its handle says
        `duplicate` and follows the earlier job. That makes a retry after a lost
        connection safe too: it queues nothing twice.
        """
        if self._closed:
            raise ClientClosed("submit on a closed client")
        reqs = _prepare(requests, self.config.limits)
        if not reqs:
            return []
        if self._routing.needs_registry(reqs, queue_anyway):
            self.models()
        models = self._routing.resolve(reqs, queue_anyway)
        duplicate = [False] * len(reqs)
        for index, routed in _by_shard(self.layout, reqs, models).items():
            group = [reqs[n] for n, _ in routed]
            answer = self._submit_to(self._shards[index], group, [m for _, m in routed])
            for (n, _), flag in zip(routed, _submitted(answer), strict=True):
                duplicate[n] = flag
        return [Job(r.job_id, self, d) for r, d in zip(reqs, duplicate, strict=True)]  # type: ignore[arg-type]

    def _submit_to(self, shard: _Shard, reqs: list[JobRequest], models: list[str]) -> Any:
        hooks = _hook_streams(shard.keys, reqs, models)
        if hooks:
            self._retrying(lambda: self.redis.sadd(self.keys.hook_streams, *hooks))
        args = _submit_args(self.config, reqs, models, shard.keys.prefix, len(self._shards))
        if self.config.durable_submit:
            return self._retrying(lambda: self._durably(shard, args))
        # On a cluster, a key named lets a node that no longer holds the slot say MOVED.
        keys = [] if self.cluster is None else [shard.keys.prefix]
        return self._retrying(lambda: shard.submit(keys=keys, args=args))

    def _durably(self, shard: _Shard, args: list[Any]) -> Any:
        """SUBMIT, then WAIT on the same connection until a replica holds what it wrote
        (each WAIT up to durable_wait_ms; the caller retries within retry_for). A submit
        not confirmed raises NotReplicated: the job may be queued, resubmitting is safe."""
        keys = [shard.keys.prefix] if self.cluster is not None else []
        pool = shard.redis.connection_pool
        conn = pool.get_connection()
        try:
            try:
                answer = _call_on(conn, "EVALSHA", shard.submit.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                shard.submit.sha = shard.redis.script_load(shard.submit.script)
                answer = _call_on(conn, "EVALSHA", shard.submit.sha, len(keys), *keys, *args)
            if answer[0] == b"full":
                return answer
            if not any(flag == 0 for flag in answer[1]):
                # Only duplicates: nothing written here, so this connection's offset may
                # predate their first submit. One write moves it past (replication keeps
                # order: a replica holding it holds them).
                _call_on(conn, "SET", f"{shard.keys.prefix}:durable", b"1", "EX", 60)
            acked = int(_call_on(conn, "WAIT", 1, self.config.durable_wait_ms))
        except redis.ResponseError:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        if acked < 1:
            raise NotReplicated(
                f"no replica confirmed the submit within {self.config.durable_wait_ms} ms"
            )
        return answer

    def models(self) -> list[ModelInfo]:
        """The models live workers serve, with their aliases and how many workers."""

        def read() -> list[ModelInfo]:
            since = (time.time() - self.config.worker_stale_s) * 1000
            consumers = self.redis.zrangebyscore(self.keys.workers, since, "+inf")
            return _models(_registry_rows(self.redis, self.keys, consumers))

        models = self._retrying(read)
        self._routing.update(models)
        return models

    def _retrying(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, tried again while Redis is unreachable, or a replica since a
        failover, up to retry_for."""
        budget = _RetryBudget(self.config.retry_for, self._reader.mux.where)
        while True:
            try:
                return attempt()
            except _PERMANENT:
                raise
            except _CLUSTER_TRANSIENT as exc:
                if self.cluster is None and not isinstance(exc, _TRANSIENT):
                    raise  # one server answering so is refusing, not changing
                time.sleep(budget.pause(exc))
            except redis.exceptions.ReadOnlyError as exc:
                # A failover left this connection on a replica: new ones may reach the new
                # primary (a name that moved with it). The refused call wrote nothing.
                if self.cluster is None:
                    self.redis.connection_pool.disconnect(inuse_connections=False)
                time.sleep(budget.pause(exc))

    def job(self, job_id: str) -> Job:
        return Job(job_id, self)

    def stream_many(
        self, jobs: Iterable[Job], timeout: float | None = None
    ) -> Iterator[tuple[Job, Event]]:
        """Events of many jobs as they arrive (each job's in order), until each has ended."""
        by_shard = _replies_by_shard(self.layout, self._shards, jobs)
        follows = [
            (self._shards[index].reader.follow(dict.fromkeys(by_key, "0-0"), timeout), by_key)
            for index, by_key in by_shard.items()
        ]
        if len(follows) == 1:
            follow, by_key = follows[0]
            for key, event in follow:
                yield by_key[key], event
            return
        for key, event, by_key in _fan_in(follows):
            yield by_key[key], event

    def close(self) -> None:
        """Stop submits; callers still streaming get ClientClosed."""
        self._closed = True
        for shard in self._shards:
            shard.reader.close()
        if self.cluster is not None:
            self.cluster.close()
        else:
            self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- async -----------------------------------------------------------------------------


@dataclass
class AsyncJob:
    id: str
    client: AsyncClient
    duplicate: bool = False  # as `Job.duplicate`

    async def stream(
        self, after: str = "0-0", timeout: float | None = None
    ) -> AsyncIterator[Event]:
        """As `Job.stream`."""
        shard = self.client._shard(self.id)
        follow = shard.reader.follow({shard.keys.reply(self.id): after}, timeout)
        async with contextlib.aclosing(follow):  # stop following as soon as we stop
            async for _, event in follow:
                yield event

    async def result(self, timeout: float | None = None) -> DoneEvent:
        last: Event | None = None
        async for event in self.stream(timeout=timeout):
            last = event
        assert last is not None
        return _result(self.id, last)

    async def cancel(self) -> None:
        shard, ttl = self.client._shard(self.id), self.client.config.job_ttl
        key = shard.keys.cancel(self.id)
        await self.client._retrying(lambda: shard.redis.set(key, b"1", ex=ttl))

    async def status(self) -> str:
        shard = self.client._shard(self.id)
        key = shard.keys.job(self.id)
        value = await self.client._retrying(lambda: shard.redis.get(key))
        return value.decode() if value else "unknown"


class Gate(Protocol):
    """A check that may refuse a submit (the gateway's per-key limits,
    tokenq/server/ratelimit.py). On one server it runs in SUBMIT's own script call, just
    before it: one round trip for both; `script` takes the check's `keys` and `args`, then
    SUBMIT's arguments, and answers {the check's answer, SUBMIT's answer}, or {the check's
    answer} when it refused. On a cluster its keys share no slot with the job's: `script`
    is the check alone, run before SUBMIT with one more argument, 1 if the job `job_id`
    exists already, else 0; the caller settles what it counted if SUBMIT then refuses."""

    script: Any
    keys: list[str]
    args: list[Any]
    job_id: str

    def check(self, answer: Any) -> None:
        """The check's answer; raises when it refused the submit (nothing was queued)."""
        ...


async def _fan_in_async(
    follows: list[tuple[AsyncIterator[tuple[str, Event]], dict[str, Any]]],
) -> AsyncIterator[tuple[str, Event, dict[str, Any]]]:
    """`_fan_in` for asyncio: each shard's follower in a task of its own."""
    out: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(follow: AsyncIterator[tuple[str, Event]], by_key: dict[str, Any]) -> None:
        try:
            async with contextlib.aclosing(follow):  # type: ignore[type-var]
                async for key, event in follow:
                    await out.put((key, event, by_key))
        except Exception as exc:
            await out.put(exc)
        finally:
            await out.put(None)

    tasks = [asyncio.get_running_loop().create_task(pump(*pair)) for pair in follows]
    try:
        live = len(tasks)
        while live:
            item = await out.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class AsyncClient:
    """The asyncio producer; same protocol, semantics and connection use as `Client`, its
    stream readers tasks in the event loop. `AsyncClient(url)` opens one server without
    a round trip; `await AsyncClient.connect(url)` also finds a Redis Cluster behind a
    plain URL (one INFO, as `Client(url)` asks) and opens `redis+cluster://` URLs."""

    def __init__(
        self,
        conn: aioredis.Redis | str = DEFAULT_REDIS_URL,
        config: ClientConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.config = dataclasses.replace(config or ClientConfig(), **overrides)
        if isinstance(conn, str) and cluster_seeds(conn) is not None:
            raise ValueError("a Redis Cluster is opened with `await AsyncClient.connect(url)`")
        if isinstance(conn, str):
            options = _own_pool_options(self.config, conn)
            retry = AsyncRetry(NoBackoff(), 0)
            pool = aioredis.BlockingConnectionPool.from_url(conn, retry=retry, **options)
            conn = aioredis.Redis.from_pool(pool)
        self._open(conn, 0)

    @classmethod
    async def connect(
        cls, url: str = DEFAULT_REDIS_URL, config: ClientConfig | None = None, **overrides: Any
    ) -> AsyncClient:
        """A client for the server or Redis Cluster at `url` (docs/protocol.md, "Redis
        Cluster"); on a cluster its jobs spread over the namespace's shards."""
        client = cls.__new__(cls)
        client.config = dataclasses.replace(config or ClientConfig(), **overrides)
        conn = await connect_async(
            url,
            connection_pool_class=aioredis.BlockingConnectionPool,
            retry=AsyncRetry(NoBackoff(), 0),
            **_own_pool_options(client.config, url),
        )
        count = 0
        if isinstance(conn, AsyncCluster):
            count = await conn.shard_count(client.config.namespace, client.config.shards)
        client._open(conn, count)
        return client

    def _open(self, conn: aioredis.Redis | AsyncCluster, count: int) -> None:
        """Its shards: the one server, or `count` shards of a cluster."""
        self.cluster = conn if isinstance(conn, AsyncCluster) else None
        self.keys = Keys(self.config.namespace)
        self.layout = Layout(self.config.namespace, count)
        if self.cluster is None:
            self.redis = conn
            _check_binary(self.redis)
            reader = _TaskReader(self.redis, self.config)
            submit = self.redis.register_script(source("submit"))
            self._shards = [_Shard(self.keys, self.redis, submit, reader)]
        else:
            self.redis = self.cluster.redis
            self._shards = []
            for keys in self.layout.shards:
                bound = self.cluster.bound(keys.prefix)
                submit = bound.register_script(source("submit"))
                reader = _TaskReader(bound, self.config, _CLUSTER_TRANSIENT)
                self._shards.append(_Shard(keys, bound, submit, reader))
        self._reader = self._shards[0].reader
        self._routing = _Routing(self.config)
        self._closed = False

    def _shard(self, job_id: str) -> _Shard:
        return self._shards[self.layout.index(job_id)]

    def keys_of(self, job_id: str) -> Keys:
        """As `Client.keys_of`."""
        return self._shard(job_id).keys

    async def submit(
        self,
        prompt: str | None = None,
        *,
        queue_anyway: bool = False,
        gate: Gate | None = None,
        **kwargs: Any,
    ) -> AsyncJob:
        request = make_request(prompt, **kwargs)
        jobs = await self.submit_many([request], queue_anyway=queue_anyway, gate=gate)
        return jobs[0]

    async def submit_many(
        self,
        requests: Iterable[JobRequest],
        *,
        queue_anyway: bool = False,
        gate: Gate | None = None,
    ) -> list[AsyncJob]:
        """As `Client.submit_many`; with a `gate`, its check runs before SUBMIT (in the
        same script call on one server) and may refuse the submit (raising what its
        `check` raises)."""
        if self._closed:
            raise ClientClosed("submit on a closed client")
        reqs = _prepare(requests, self.config.limits)
        if not reqs:
            return []
        if self._routing.needs_registry(reqs, queue_anyway):
            await self.models()
        models = self._routing.resolve(reqs, queue_anyway)
        if gate is not None and self.cluster is not None:
            await self._gate_apart(gate)
            gate = None
        duplicate = [False] * len(reqs)
        for index, routed in _by_shard(self.layout, reqs, models).items():
            group = [reqs[n] for n, _ in routed]
            answer = await self._submit_to(self._shards[index], group, [m for _, m in routed], gate)
            for (n, _), flag in zip(routed, _submitted(answer), strict=True):
                duplicate[n] = flag
        return [AsyncJob(r.job_id, self, d) for r, d in zip(reqs, duplicate, strict=True)]  # type: ignore[arg-type]

    async def _gate_apart(self, gate: Gate) -> None:
        """On a cluster: the gate's check in a call of its own, told whether its job
        exists (its keys and the job's lie in different slots)."""
        shard = self._shard(gate.job_id)
        key = shard.keys.job(gate.job_id)
        exists = await self._retrying(lambda: shard.redis.exists(key))
        args = [*gate.args, 1 if exists else 0]
        gate.check(await self._retrying(lambda: gate.script(keys=gate.keys, args=args)))

    async def _submit_to(
        self, shard: _Shard, reqs: list[JobRequest], models: list[str], gate: Gate | None
    ) -> Any:
        hooks = _hook_streams(shard.keys, reqs, models)
        if hooks:
            await self._retrying(lambda: self.redis.sadd(self.keys.hook_streams, *hooks))
        args = _submit_args(self.config, reqs, models, shard.keys.prefix, len(self._shards))
        # On a cluster, a key named lets a node that no longer holds the slot say MOVED.
        keys = [] if self.cluster is None else [shard.keys.prefix]
        if self.config.durable_submit:
            script, keys = (shard.submit, keys) if gate is None else (gate.script, gate.keys)
            full = args if gate is None else [*gate.args, *args]
            answer = await self._retrying(lambda: self._durably(shard, script, keys, full, gate))
            if gate is not None:
                gate.check(answer[0])
                answer = answer[1]
            return answer
        if gate is None:
            return await self._retrying(lambda: shard.submit(keys=keys, args=args))
        both = await self._retrying(lambda: gate.script(keys=gate.keys, args=[*gate.args, *args]))
        gate.check(both[0])
        return both[1]

    async def _durably(
        self, shard: _Shard, script: Any, keys: list[Any], args: list[Any], gate: Any
    ) -> Any:
        """As `Client._durably` (with a gate, its script's answer)."""
        pool = shard.redis.connection_pool
        conn = await pool.get_connection()
        try:
            try:
                answer = await _call_on_async(conn, "EVALSHA", script.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                script.sha = await shard.redis.script_load(script.script)
                answer = await _call_on_async(conn, "EVALSHA", script.sha, len(keys), *keys, *args)
            submitted = answer if gate is None else (answer[1] if len(answer) > 1 else None)
            if submitted is None or submitted[0] == b"full":
                return answer  # nothing queued
            if not any(flag == 0 for flag in submitted[1]):  # only duplicates: see Client
                durable = f"{shard.keys.prefix}:durable"
                await _call_on_async(conn, "SET", durable, b"1", "EX", 60)
            acked = int(await _call_on_async(conn, "WAIT", 1, self.config.durable_wait_ms))
        except redis.ResponseError:
            raise
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
        if acked < 1:
            raise NotReplicated(
                f"no replica confirmed the submit within {self.config.durable_wait_ms} ms"
            )
        return answer

    async def models(self) -> list[ModelInfo]:
        """As `Client.models`."""

        async def read() -> list[ModelInfo]:
            since = (time.time() - self.config.worker_stale_s) * 1000
            consumers = await self.redis.zrangebyscore(self.keys.workers, since, "+inf")
            async with self.redis.pipeline(transaction=False) as pipe:
                for consumer in consumers:
                    pipe.hgetall(self.keys.worker(consumer.decode()))
                return _models(await pipe.execute())

        models = await self._retrying(read)
        self._routing.update(models)
        return models

    async def _retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """As `Client._retrying`."""
        budget = _RetryBudget(self.config.retry_for, self._reader.mux.where)
        while True:
            try:
                return await attempt()
            except _PERMANENT:
                raise
            except _CLUSTER_TRANSIENT as exc:
                if self.cluster is None and not isinstance(exc, _TRANSIENT):
                    raise  # one server answering so is refusing, not changing
                await asyncio.sleep(budget.pause(exc))
            except redis.exceptions.ReadOnlyError as exc:  # as in `Client._retrying`
                if self.cluster is None:
                    await self.redis.connection_pool.disconnect(inuse_connections=False)
                await asyncio.sleep(budget.pause(exc))

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(job_id, self)

    async def stream_many(
        self, jobs: Iterable[AsyncJob], timeout: float | None = None
    ) -> AsyncIterator[tuple[AsyncJob, Event]]:
        """As `Client.stream_many`."""
        by_shard = _replies_by_shard(self.layout, self._shards, jobs)
        follows = [
            (self._shards[index].reader.follow(dict.fromkeys(by_key, "0-0"), timeout), by_key)
            for index, by_key in by_shard.items()
        ]
        if len(follows) == 1:
            follow, by_key = follows[0]
            async with contextlib.aclosing(follow):  # type: ignore[type-var]
                async for key, event in follow:
                    yield by_key[key], event
            return
        merged = _fan_in_async(follows)
        async with contextlib.aclosing(merged):  # type: ignore[type-var]
            async for key, event, by_key in merged:
                yield by_key[key], event

    async def aclose(self) -> None:
        """As `Client.close`."""
        self._closed = True
        for shard in self._shards:
            await shard.reader.aclose()
        if self.cluster is not None:
            await self.cluster.aclose()
        else:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
