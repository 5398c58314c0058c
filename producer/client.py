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
import dataclasses
import math
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenq.producer.errors import ClientClosed, JobFailed, QueueFull, RedisUnavailable
from tokenq.producer.protocol import (
    DEFAULT_LIMITS,
    DEFAULT_NAMESPACE,
    QUEUED,
    TERMINAL_EVENTS,
    DoneEvent,
    ErrorEvent,
    Event,
    JobRequest,
    Keys,
    Limits,
    ProtocolError,
    decode_event,
    new_job_id,
    pack,
)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MAX_BACKLOG = 10_000
DEFAULT_JOB_TTL = 24 * 3600  # how long a job id stays taken (the idempotency window)
READ_COUNT = 512
RETRY_BASE = 0.05  # seconds: the pause after a first failure, doubled after each further one
RETRY_CAP = 1.0  # the longest pause, so a server back from a restart is found within ~1 s

# Worth retrying: the server may come back (refused, reset, timed out, loading its data).
# Credentials and ACLs refused are ConnectionErrors too, but waiting does not heal them.
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError)
_PERMANENT = (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)

T = TypeVar("T")


@dataclass(frozen=True)
class ClientConfig:
    """A producer's settings; docs/protocol.md ("Client connections") explains the
    connection and retry ones together."""

    namespace: str = DEFAULT_NAMESPACE
    max_backlog: int = DEFAULT_MAX_BACKLOG
    job_ttl: int = DEFAULT_JOB_TTL
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
    priority: int = 0,
    deadline: float | None = None,
    model: str | None = None,
    metadata: Any = None,
    **params: Any,
) -> JobRequest:
    """A job from keyword arguments; sampling parameters go by vLLM's names."""
    return JobRequest(
        prompt=prompt,
        messages=messages,
        prompt_token_ids=prompt_token_ids,
        params=params,
        job_id=job_id,
        priority=priority,
        deadline=deadline,
        model=model,
        metadata=metadata,
    )


def _prepare(requests: Iterable[JobRequest], limits: Limits) -> list[JobRequest]:
    """Give each job its id and submit time and fail fast on what a worker would reject
    anyway, before anything reaches Redis."""
    now = time.time()
    out = []
    for req in requests:
        req = dataclasses.replace(
            req, job_id=req.job_id or new_job_id(), submitted_at=req.submitted_at or now
        )
        req.validate(limits)
        size = len(pack(req.payload()))
        if size > limits.max_payload_bytes:
            raise ProtocolError(
                "payload_too_large",
                f"the job is {size} bytes packed (limit {limits.max_payload_bytes})",
                req.job_id,
            )
        out.append(req)
    return out


def _plan(
    requests: list[JobRequest], existing: list[bytes | None], backlog: int, max_backlog: int
) -> tuple[list[JobRequest], list[bool]]:
    """Which jobs to add (first occurrence of an id not yet taken) and which are duplicates."""
    taken = {req.job_id for req, value in zip(requests, existing, strict=True) if value}
    fresh: list[JobRequest] = []
    duplicate: list[bool] = []
    for req in requests:
        is_dup = req.job_id in taken
        duplicate.append(is_dup)
        if not is_dup:
            taken.add(req.job_id)
            fresh.append(req)
    if fresh and backlog + len(fresh) > max_backlog:
        raise QueueFull(backlog, max_backlog)
    return fresh, duplicate


def _check_binary(conn: Any) -> None:
    kwargs = conn.connection_pool.connection_kwargs
    if kwargs.get("decode_responses"):
        raise ValueError("tokenq needs a Redis client with decode_responses=False (msgpack)")


def _own_pool_options(config: ClientConfig) -> dict[str, Any]:
    """A URL-built client's pool: bounded waits on connect and on every read, keepalive and
    health checks to find dead connections, and no retries of redis-py's own (they would
    spend retry_for unseen). Beyond max_connections a command waits for a free connection
    rather than failing. Options in the URL's query string win over these."""
    return {
        "socket_connect_timeout": config.connect_timeout,
        "socket_timeout": config.socket_timeout,
        "socket_keepalive": True,
        "health_check_interval": config.health_check_interval,
        "max_connections": config.max_connections,
        "timeout": None,
    }


def _where(conn: Any) -> str:
    """The server a client talks to, for error messages: never its password."""
    kwargs = conn.connection_pool.connection_kwargs
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
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        raise ValueError(f"{text!r} is not a stream entry id (such as '0-0')") from None


def _entries(reply: Any) -> Iterator[tuple[str, bytes, dict[bytes, bytes]]]:
    """(stream key, entry id, fields) of a raw XREAD reply: RESP2 (an array of [key,
    entries]) or RESP3 (a map of key -> entries); nil when BLOCK ran out."""
    streams = reply.items() if isinstance(reply, dict) else reply or ()
    for stream, entries in streams:
        key = stream.decode() if isinstance(stream, bytes) else stream
        for entry_id, flat in entries:
            fields = (
                flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2], strict=True))
            )
            yield key, entry_id, fields


class _Sink(Protocol):
    """Where the reader hands a follower its events: queue.SimpleQueue for the sync
    client, asyncio.Queue for the async one."""

    def put_nowait(self, item: Any, /) -> None: ...


# What a sink carries: a follower's next event, or the exception that ends it; None only
# asks the waiting caller to look at the reader's state again (Redis became unreachable).
_Item = tuple["_Follower", Event | Exception] | None


@dataclass(eq=False)
class _Follower:
    """One caller following one reply stream."""

    key: str
    position: StreamId  # the last entry handed to the caller's sink: read after it
    sink: _Sink  # shared by the jobs of one stream_many
    joined: float  # monotonic: an outage counts against this follower from here at most


class _Multiplex:
    """What a client's stream reader does, without the I/O, for the thread reader and the
    task reader alike: which streams to XREAD from which ids, which follower gets which
    entry, and when a waiting follower gives up.

    Each follower keeps its own position, so followers of one stream at different points,
    or joining while others read, each get every entry after theirs exactly once, in
    order; after a reconnect the reader simply reads on from the positions.
    """

    def __init__(self, config: ClientConfig, where: str) -> None:
        self.config = config
        self.where = where
        self.by_key: dict[str, list[_Follower]] = {}
        self.ok_at = time.monotonic()  # the last XREAD reply
        self.error: Exception | None = None  # why the reads since ok_at failed
        self.failures = 0
        self.closed = False

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

    def xread_command(self) -> list[Any] | None:
        """The next read (each stream from its least advanced follower), or None when
        nothing is followed and the reader should end."""
        if self.closed or not self.by_key:
            return None
        keys = list(self.by_key)
        ids = []
        for key in keys:
            ms, seq = min(f.position for f in self.by_key[key])
            ids.append(f"{ms}-{seq}")
        block = ["BLOCK", self.config.block_ms]
        return ["XREAD", "COUNT", READ_COUNT, *block, "STREAMS", *keys, *ids]

    def dispatch(self, reply: Any) -> None:
        """Hand each entry to the followers that have not had it; a follower whose stream
        ended (or held an entry that cannot be decoded) is done."""
        self.ok_at = time.monotonic()
        self.error = None
        self.failures = 0
        for key, entry_id, fields in _entries(reply):
            position = _parse_id(entry_id)
            item: Event | Exception
            try:
                item = decode_event(entry_id, fields)
            except Exception as exc:  # msgpack raises many types; fail this stream only
                item = exc
            for follower in list(self.by_key.get(key, ())):
                if position <= follower.position:
                    continue
                follower.position = position
                follower.sink.put_nowait((follower, item))
                if isinstance(item, Exception) or item.type in TERMINAL_EVENTS:
                    self.remove([follower])

    def failed(self, error: Exception) -> float:
        """Record a failed read; returns the pause before the next. Redis unreachable:
        wake every waiting caller to check its retry budget. Anything else (a command
        refused, a bug): no retry helps, every follower gets the error."""
        if isinstance(error, _PERMANENT) or not isinstance(error, _TRANSIENT):
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
                follower.sink.put_nowait((follower, error))
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


def _unwrap(item: _Item) -> tuple[_Follower, Event] | None:
    """A sink item as (follower, event); raises the exception that ended a follower."""
    if item is None:
        return None
    follower, payload = item
    if isinstance(payload, Exception):
        raise payload
    return follower, payload


def _start(positions: dict[str, str], sink: _Sink) -> list[_Follower]:
    joined = time.monotonic()
    return [_Follower(key, _parse_id(after), sink, joined) for key, after in positions.items()]


class _ThreadReader:
    """The sync client's stream reader: one thread with one pooled connection, sending one
    XREAD BLOCK over every followed stream and handing entries to the callers' queues.
    Callers wait on their queues with their own deadlines, so a stuck socket never holds
    them past their timeout. The thread ends (returning its connection) when nothing is
    followed, and the next follower starts another."""

    def __init__(self, conn: redis.Redis, config: ClientConfig) -> None:
        self.redis = conn
        self.mux = _Multiplex(config, _where(conn))
        self.lock = threading.Lock()  # guards mux; never held across I/O
        self.thread: threading.Thread | None = None
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
            if self.thread is None and followers:
                self.thread = threading.Thread(target=self._run, name="tokenq-reader", daemon=True)
                self.thread.start()
        try:
            live = len(followers)
            while live:
                with self.lock:
                    limit = self.mux.wait_limit(followers[0].joined, deadline)
                try:
                    got = _unwrap(sink.get(timeout=limit))
                except queue.Empty:
                    continue
                if got is None:
                    continue
                follower, event = got
                yield follower.key, event
                if event.type in TERMINAL_EVENTS:
                    live -= 1
        finally:
            with self.lock:
                self.mux.remove(followers)

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
                    conn.send_command(*command)
                    # can_read waits at most reply_wait, whatever the socket's timeout.
                    if not conn.can_read(timeout=self.mux.reply_wait):
                        raise redis.TimeoutError(f"no XREAD reply in {self.mux.reply_wait:.1f}s")
                    reply = conn.read_response()
                    with self.lock:
                        self.mux.dispatch(reply)
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

    def __init__(self, conn: aioredis.Redis, config: ClientConfig) -> None:
        self.redis = conn
        self.mux = _Multiplex(config, _where(conn))
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
                got = _unwrap(item)
                if got is None:
                    continue
                follower, event = got
                yield follower.key, event
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
                    async with asyncio.timeout(self.mux.reply_wait):
                        await conn.send_command(*command)
                        # inf: this wait alone bounds the read, not the socket's timeout
                        # (which may be shorter than the BLOCK).
                        reply = await conn.read_response(timeout=math.inf)
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
        for _, event in self.client._reader.follow(
            {self.client.keys.reply(self.id): after}, timeout
        ):
            yield event

    def result(self, timeout: float | None = None) -> DoneEvent:
        """The final `done` event; raises JobFailed on `error`, TimeoutError on timeout."""
        *_, last = self.stream(timeout=timeout)
        return _result(self.id, last)

    def cancel(self) -> None:
        """Ask the worker to stop this job; the reply ends with finish reason `cancelled`."""
        key, ttl = self.client.keys.cancel(self.id), self.client.config.job_ttl
        self.client._retrying(lambda: self.client.redis.set(key, b"1", ex=ttl))

    def status(self) -> str:
        """queued, running (tokens are streaming), done, error, or unknown (never
        submitted, or its idempotency window has passed)."""
        key = self.client.keys.job(self.id)
        value = self.client._retrying(lambda: self.client.redis.get(key))
        return value.decode() if value else "unknown"


class Client:
    """Synchronous producer, safe to share between threads.

    Given a URL it builds its own connection pool (see `ClientConfig`); given a
    `redis.Redis` it uses that, with its settings. All the reply streams its callers
    follow are read by one background thread over one connection.
    """

    def __init__(
        self,
        conn: redis.Redis | str = DEFAULT_REDIS_URL,
        config: ClientConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.config = dataclasses.replace(config or ClientConfig(), **overrides)
        if isinstance(conn, str):
            options = _own_pool_options(self.config)
            pool = redis.BlockingConnectionPool.from_url(
                conn, retry=Retry(NoBackoff(), 0), **options
            )
            conn = redis.Redis.from_pool(pool)
        self.redis = conn
        _check_binary(self.redis)
        self.keys = Keys(self.config.namespace)
        self._reader = _ThreadReader(self.redis, self.config)
        self._closed = False

    def submit(self, prompt: str | None = None, **kwargs: Any) -> Job:
        """Submit one job; see `make_request` for the arguments. Raises QueueFull."""
        return self.submit_many([make_request(prompt, **kwargs)])[0]

    def submit_many(self, requests: Iterable[JobRequest]) -> list[Job]:
        """Submit jobs in one transaction: all are queued, or QueueFull and none is.

        The job keys are WATCHed so that a concurrent submit of the same id either lands
        first (and we see a duplicate) or aborts our transaction (and we retry and see it).
        That makes a retry after a lost connection safe too: it queues nothing twice.
        """
        if self._closed:
            raise ClientClosed("submit on a closed client")
        reqs = _prepare(requests, self.config.limits)
        if not reqs:
            return []
        duplicate = self._retrying(lambda: self._submit_once(reqs))
        return [Job(r.job_id, self, d) for r, d in zip(reqs, duplicate, strict=True)]

    def _submit_once(self, reqs: list[JobRequest]) -> list[bool]:
        job_keys = [self.keys.job(r.job_id) for r in reqs]
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(*job_keys)
                    existing = pipe.mget(job_keys)
                    backlog = pipe.xlen(self.keys.jobs)
                    fresh, duplicate = _plan(reqs, existing, backlog, self.config.max_backlog)
                    pipe.multi()
                    for req in fresh:
                        pipe.set(self.keys.job(req.job_id), QUEUED, ex=self.config.job_ttl)
                        pipe.xadd(self.keys.jobs, req.to_fields())
                    pipe.execute()
                    return duplicate
                except redis.WatchError:
                    # Also what redis-py raises when the connection drops while keys are
                    # WATCHed: start over, and the next WATCH meets the outage itself.
                    continue

    def _retrying(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, tried again while Redis is unreachable, up to retry_for."""
        budget = _RetryBudget(self.config.retry_for, self._reader.mux.where)
        while True:
            try:
                return attempt()
            except _PERMANENT:
                raise
            except _TRANSIENT as exc:
                time.sleep(budget.pause(exc))

    def job(self, job_id: str) -> Job:
        return Job(job_id, self)

    def stream_many(
        self, jobs: Iterable[Job], timeout: float | None = None
    ) -> Iterator[tuple[Job, Event]]:
        """Events of many jobs as they arrive (each job's in order), until each has ended."""
        by_key = {self.keys.reply(j.id): j for j in jobs}
        for key, event in self._reader.follow(dict.fromkeys(by_key, "0-0"), timeout):
            yield by_key[key], event

    def close(self) -> None:
        """Stop submits; callers still streaming get ClientClosed."""
        self._closed = True
        self._reader.close()
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
        follow = self.client._reader.follow({self.client.keys.reply(self.id): after}, timeout)
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
        key, ttl = self.client.keys.cancel(self.id), self.client.config.job_ttl
        await self.client._retrying(lambda: self.client.redis.set(key, b"1", ex=ttl))

    async def status(self) -> str:
        key = self.client.keys.job(self.id)
        value = await self.client._retrying(lambda: self.client.redis.get(key))
        return value.decode() if value else "unknown"


class AsyncClient:
    """The asyncio producer; same protocol, semantics and connection use as `Client`, its
    stream reader a task in the event loop."""

    def __init__(
        self,
        conn: aioredis.Redis | str = DEFAULT_REDIS_URL,
        config: ClientConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.config = dataclasses.replace(config or ClientConfig(), **overrides)
        if isinstance(conn, str):
            options = _own_pool_options(self.config)
            retry = AsyncRetry(NoBackoff(), 0)
            pool = aioredis.BlockingConnectionPool.from_url(conn, retry=retry, **options)
            conn = aioredis.Redis.from_pool(pool)
        self.redis = conn
        _check_binary(self.redis)
        self.keys = Keys(self.config.namespace)
        self._reader = _TaskReader(self.redis, self.config)
        self._closed = False

    async def submit(self, prompt: str | None = None, **kwargs: Any) -> AsyncJob:
        return (await self.submit_many([make_request(prompt, **kwargs)]))[0]

    async def submit_many(self, requests: Iterable[JobRequest]) -> list[AsyncJob]:
        """As `Client.submit_many`."""
        if self._closed:
            raise ClientClosed("submit on a closed client")
        reqs = _prepare(requests, self.config.limits)
        if not reqs:
            return []
        duplicate = await self._retrying(lambda: self._submit_once(reqs))
        return [AsyncJob(r.job_id, self, d) for r, d in zip(reqs, duplicate, strict=True)]

    async def _submit_once(self, reqs: list[JobRequest]) -> list[bool]:
        job_keys = [self.keys.job(r.job_id) for r in reqs]
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(*job_keys)
                    existing = await pipe.mget(job_keys)
                    backlog = await pipe.xlen(self.keys.jobs)
                    fresh, duplicate = _plan(reqs, existing, backlog, self.config.max_backlog)
                    pipe.multi()
                    for req in fresh:
                        pipe.set(self.keys.job(req.job_id), QUEUED, ex=self.config.job_ttl)
                        pipe.xadd(self.keys.jobs, req.to_fields())
                    await pipe.execute()
                    return duplicate
                except redis.WatchError:
                    continue  # as in Client._submit_once

    async def _retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """As `Client._retrying`."""
        budget = _RetryBudget(self.config.retry_for, self._reader.mux.where)
        while True:
            try:
                return await attempt()
            except _PERMANENT:
                raise
            except _TRANSIENT as exc:
                await asyncio.sleep(budget.pause(exc))

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(job_id, self)

    async def stream_many(
        self, jobs: Iterable[AsyncJob], timeout: float | None = None
    ) -> AsyncIterator[tuple[AsyncJob, Event]]:
        """As `Client.stream_many`."""
        by_key = {self.keys.reply(j.id): j for j in jobs}
        follow = self._reader.follow(dict.fromkeys(by_key, "0-0"), timeout)
        async with contextlib.aclosing(follow):
            async for key, event in follow:
                yield by_key[key], event

    async def aclose(self) -> None:
        """As `Client.close`."""
        self._closed = True
        await self._reader.aclose()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
