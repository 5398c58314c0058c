"""Producers: submit jobs to the job stream and read their reply streams.

`Client` uses redis-py, `AsyncClient` redis.asyncio; both speak docs/protocol.md and share
the planning code here, so the two cannot drift apart. No torch anywhere: application
servers install only redis, msgpack and structlog.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from producer.errors import ClientClosed, JobFailed, QueueFull
from producer.protocol import (
    DEFAULT_NAMESPACE,
    TERMINAL_EVENTS,
    DoneEvent,
    ErrorEvent,
    Event,
    JobRequest,
    Keys,
    decode_event,
    new_job_id,
)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MAX_BACKLOG = 10_000
DEFAULT_JOB_TTL = 24 * 3600  # how long a job id stays taken (the idempotency window)
READ_COUNT = 512
JOB_QUEUED = b"queued"


@dataclass(frozen=True)
class ClientConfig:
    namespace: str = DEFAULT_NAMESPACE
    max_backlog: int = DEFAULT_MAX_BACKLOG
    job_ttl: int = DEFAULT_JOB_TTL
    block_ms: int = 1000  # one XREAD BLOCK; also how often a stream() timeout is checked


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


def _prepare(requests: Iterable[JobRequest]) -> list[JobRequest]:
    """Give each job its id and submit time and fail fast on what a worker would reject
    anyway, before anything reaches Redis."""
    now = time.time()
    out = []
    for req in requests:
        req = dataclasses.replace(
            req, job_id=req.job_id or new_job_id(), submitted_at=req.submitted_at or now
        )
        req.validate()
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


def _decode_reply(resp: Any) -> Iterator[tuple[str, Event]]:
    for stream, entries in resp or []:
        key = stream.decode() if isinstance(stream, bytes) else stream
        for event_id, fields in entries:
            yield key, decode_event(event_id, fields)


def _block_ms(default_ms: int, deadline: float | None) -> int:
    if deadline is None:
        return default_ms
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no terminal event before the timeout")
    return max(1, min(default_ms, int(left * 1000)))


def _result(job_id: str, event: Event) -> DoneEvent:
    if isinstance(event, ErrorEvent):
        raise JobFailed(job_id, event.code, event.message)
    assert isinstance(event, DoneEvent)
    return event


# --- sync ------------------------------------------------------------------------------


@dataclass
class Job:
    """A handle to one submitted job; cheap, and recreatable from the id with `Client.job`."""

    id: str
    client: Client
    duplicate: bool = False  # the id was already taken: this submit added nothing

    def stream(self, after: str = "0-0", timeout: float | None = None) -> Iterator[Event]:
        """Yield reply events as they arrive, ending with `done` or `error`.

        Pass the `event_id` of the last event you handled as `after` to resume after a
        disconnect. `timeout` bounds the whole wait (TimeoutError).
        """
        for _, event in self.client._read({self.client.keys.reply(self.id): after}, timeout):
            yield event
            if event.type in TERMINAL_EVENTS:
                return

    def result(self, timeout: float | None = None) -> DoneEvent:
        """The final `done` event; raises JobFailed on `error`, TimeoutError on timeout."""
        *_, last = self.stream(timeout=timeout)
        return _result(self.id, last)

    def cancel(self) -> None:
        """Ask the worker to stop this job; the reply ends with finish reason `cancelled`."""
        self.client.redis.set(self.client.keys.cancel(self.id), b"1", ex=self.client.config.job_ttl)

    def status(self) -> str:
        """queued, running (tokens are streaming), done, error, or unknown (never
        submitted, or its idempotency window has passed)."""
        value = self.client.redis.get(self.client.keys.job(self.id))
        return value.decode() if value else "unknown"


class Client:
    """Synchronous producer. Thread-safe as far as redis-py's connection pool is."""

    def __init__(
        self,
        conn: redis.Redis | str = DEFAULT_REDIS_URL,
        config: ClientConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.redis = redis.Redis.from_url(conn) if isinstance(conn, str) else conn
        _check_binary(self.redis)
        self.config = dataclasses.replace(config or ClientConfig(), **overrides)
        self.keys = Keys(self.config.namespace)
        self._closed = False

    def submit(self, prompt: str | None = None, **kwargs: Any) -> Job:
        """Submit one job; see `make_request` for the arguments. Raises QueueFull."""
        return self.submit_many([make_request(prompt, **kwargs)])[0]

    def submit_many(self, requests: Iterable[JobRequest]) -> list[Job]:
        """Submit jobs in one transaction: all are queued, or QueueFull and none is.

        The job keys are WATCHed so that a concurrent submit of the same id either lands
        first (and we see a duplicate) or aborts our transaction (and we retry and see it).
        """
        if self._closed:
            raise ClientClosed("submit on a closed client")
        reqs = _prepare(requests)
        if not reqs:
            return []
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
                        pipe.set(self.keys.job(req.job_id), JOB_QUEUED, ex=self.config.job_ttl)
                        pipe.xadd(self.keys.jobs, req.to_fields())
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        return [Job(r.job_id, self, d) for r, d in zip(reqs, duplicate, strict=True)]

    def job(self, job_id: str) -> Job:
        return Job(job_id, self)

    def stream_many(
        self, jobs: Iterable[Job], timeout: float | None = None
    ) -> Iterator[tuple[Job, Event]]:
        """Events of many jobs through one XREAD per round, until each has finished."""
        by_key = {self.keys.reply(j.id): j for j in jobs}
        positions = dict.fromkeys(by_key, "0-0")
        for key, event in self._read(positions, timeout):
            yield by_key[key], event
            if event.type in TERMINAL_EVENTS:
                del positions[key]

    def _read(
        self, positions: dict[str, str], timeout: float | None
    ) -> Iterator[tuple[str, Event]]:
        """XREAD rounds over `positions` (reply key -> last id), which the caller may
        shrink between events; ends when it is empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while positions:
            resp = self.redis.xread(
                dict(positions), count=READ_COUNT, block=_block_ms(self.config.block_ms, deadline)
            )
            for key, event in _decode_reply(resp):
                if key in positions:
                    positions[key] = event.event_id
                    yield key, event

    def close(self) -> None:
        self._closed = True
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
    duplicate: bool = False

    async def stream(
        self, after: str = "0-0", timeout: float | None = None
    ) -> AsyncIterator[Event]:
        """As `Job.stream`."""
        key = self.client.keys.reply(self.id)
        async for event in self.client._read(key, after, timeout):
            yield event
            if event.type in TERMINAL_EVENTS:
                return

    async def result(self, timeout: float | None = None) -> DoneEvent:
        last: Event | None = None
        async for event in self.stream(timeout=timeout):
            last = event
        assert last is not None
        return _result(self.id, last)

    async def cancel(self) -> None:
        await self.client.redis.set(
            self.client.keys.cancel(self.id), b"1", ex=self.client.config.job_ttl
        )

    async def status(self) -> str:
        value = await self.client.redis.get(self.client.keys.job(self.id))
        return value.decode() if value else "unknown"


class AsyncClient:
    """The asyncio producer; same protocol and semantics as `Client`."""

    def __init__(
        self,
        conn: aioredis.Redis | str = DEFAULT_REDIS_URL,
        config: ClientConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.redis = aioredis.Redis.from_url(conn) if isinstance(conn, str) else conn
        _check_binary(self.redis)
        self.config = dataclasses.replace(config or ClientConfig(), **overrides)
        self.keys = Keys(self.config.namespace)
        self._closed = False

    async def submit(self, prompt: str | None = None, **kwargs: Any) -> AsyncJob:
        return (await self.submit_many([make_request(prompt, **kwargs)]))[0]

    async def submit_many(self, requests: Iterable[JobRequest]) -> list[AsyncJob]:
        if self._closed:
            raise ClientClosed("submit on a closed client")
        reqs = _prepare(requests)
        if not reqs:
            return []
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
                        pipe.set(self.keys.job(req.job_id), JOB_QUEUED, ex=self.config.job_ttl)
                        pipe.xadd(self.keys.jobs, req.to_fields())
                    await pipe.execute()
                    break
                except redis.WatchError:
                    continue
        return [AsyncJob(r.job_id, self, d) for r, d in zip(reqs, duplicate, strict=True)]

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(job_id, self)

    async def _read(self, key: str, after: str, timeout: float | None) -> AsyncIterator[Event]:
        deadline = None if timeout is None else time.monotonic() + timeout
        position = after
        while True:
            resp = await self.redis.xread(
                {key: position}, count=READ_COUNT, block=_block_ms(self.config.block_ms, deadline)
            )
            for _, event in _decode_reply(resp):
                position = event.event_id
                yield event

    async def aclose(self) -> None:
        self._closed = True
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
