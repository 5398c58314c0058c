"""`tokenq webhooks run`: deliver the webhook events workers and gateways write, at least
once, signed (Standard Webhooks), in order per job, retried with backoff until delivered or
the retry time is spent. Any number of dispatchers share the consumer group `dispatchers`
of every webhook event stream; one killed mid-delivery loses nothing: its entries stay
pending and another takes them over (XAUTOCLAIM).

On a Redis Cluster (an `AsyncCluster` given) the streams of one slot are read together, each
slot by a read loop of its own (one XREADGROUP cannot span slots), and a job's state
(`prev`, `done`) is kept in its stream's slot, where PUBLISH writes it: `<shard>:hook:<id>`;
a batch's in the batch stream's (`ns:{ns:hooks:batches}:hook:<id>`)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aioredis
import structlog

from tokenq.protocol import DEFAULT_NAMESPACE, Keys, unpack
from tokenq.protocol.connection import AsyncCluster
from tokenq.protocol.scripts import source
from tokenq.protocol.webhooks import BATCH_TYPES, DISPATCHERS, HookEvent
from tokenq.webhooks import endpoints
from tokenq.webhooks.addresses import Refused, resolve, shown
from tokenq.webhooks.metrics import DispatcherMetrics
from tokenq.webhooks.signing import headers
from tokenq.webhooks.whsec import endpoint_secret, secret_bytes

log = structlog.get_logger("tokenq.webhooks")
FAILURES_MAXLEN = 10_000


def default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(2).hex()}"


@dataclass
class DispatcherConfig:
    secret: str  # the namespace's whsec_ secret: signs jobs' own webhooks, derives endpoints'
    namespace: str = DEFAULT_NAMESPACE
    consumer: str = field(default_factory=default_consumer)
    allow_private: bool = False  # http, loopback and private addresses (development)
    retry_for_s: float = 24 * 3600  # from the event's making
    first_backoff_s: float = 1.0  # doubling, with jitter, up to max_backoff_s
    max_backoff_s: float = 600.0
    attempt_timeout_s: float = 10.0
    per_endpoint: int = 8  # attempts at once to one endpoint (URL origin)
    max_held: int = 1000  # events held at once (delivering, waiting their turn, retrying)
    max_body_bytes: int = 256 * 1024  # a bigger event has its text cut to fit
    max_response_bytes: int = 64 * 1024  # read of an answer, then the connection is dropped
    claim_idle_ms: int = 60_000  # an entry idle this long belongs to a dead dispatcher
    discover_interval_s: float = 1.0  # how often the list of event streams is reread
    block_ms: int = 1000
    state_ttl_s: int = 25 * 3600

    def __post_init__(self) -> None:
        secret_bytes(self.secret)  # ValueError for a bad one, before anything runs


@dataclass
class Target:
    """Where one event goes: a job's own URL, or one endpoint."""

    url: str
    secret: str
    endpoint: str | None = None  # the endpoint's id

    @property
    def origin(self) -> str:
        return urlsplit(self.url).netloc


class Dispatcher:
    def __init__(self, conn: aioredis.Redis | AsyncCluster, config: DispatcherConfig) -> None:
        self.cluster = conn if isinstance(conn, AsyncCluster) else None
        self.redis: Any = conn if self.cluster is None else self.cluster.redis
        self.config = config
        self.keys = Keys(config.namespace)
        self.metrics = DispatcherMetrics()
        self.http = httpx.AsyncClient(
            follow_redirects=False,
            trust_env=False,  # no proxy from the environment: the address checked is the one called
            timeout=config.attempt_timeout_s,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._done = self.redis.register_script(source("hook_done"))
        self.streams: set[str] = set()
        # On a cluster: the read loop of each slot that holds a stream (None: one loop)
        self.readers: dict[int | None, asyncio.Task[None]] = {}
        self.gone: set[str] = set()  # jobs' URLs that answered 410 (reread with the streams)
        self.held: dict[tuple[str, bytes], asyncio.Task[None]] = {}
        self.slots: dict[str, asyncio.Semaphore] = {}
        self.waiters: dict[str, asyncio.Event] = {}  # by job: one of its events went out
        self._endpoints: list[endpoints.Endpoint] = []
        self._endpoints_at = 0.0
        self.stopping = asyncio.Event()
        self._room = asyncio.Event()  # set when an event held leaves
        self.log = log.bind(consumer=config.consumer)

    # --- the loops -------------------------------------------------------------------

    async def run(self) -> None:
        """Deliver until `stop()`; then hand what is held back to the other dispatchers."""
        await self.discover()
        loops = [
            asyncio.create_task(self._every(self.config.discover_interval_s, self.discover)),
            asyncio.create_task(self._every(self.config.claim_idle_ms / 4000, self.reclaim)),
            asyncio.create_task(self._every(self.config.claim_idle_ms / 3000, self.keep)),
        ]
        if self.cluster is None:
            self.readers[None] = asyncio.create_task(self._read_loop(None))
        self.log.info("webhook dispatcher started", streams=len(self.streams))
        try:
            await self.stopping.wait()
        finally:
            for task in (*loops, *self.readers.values()):
                task.cancel()
            await self.hand_back()
            await self.http.aclose()

    def stop(self) -> None:
        self.stopping.set()

    async def _every(self, interval: float, work: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await asyncio.sleep(max(0.05, interval))
            try:
                await work()
            except (aioredis.RedisError, OSError) as exc:
                self.log.warning("redis call failed", error=str(exc))

    async def discover(self) -> None:
        """The event streams producers listed, a consumer group on each new one; and the
        URLs gone."""
        gone = await self.redis.smembers(self.keys.webhook_gone)
        self.gone |= {url.decode() for url in gone}
        names = {m.decode() for m in await self.redis.smembers(self.keys.hook_streams)}
        names.add(self.keys.batch_hooks)
        for stream in names - self.streams:
            try:
                await self.redis.xgroup_create(stream, DISPATCHERS, id="0", mkstream=True)
            except aioredis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            self.streams.add(stream)
            if self.cluster is not None:
                slot = self.redis.keyslot(stream)
                if slot not in self.readers:
                    self.readers[slot] = asyncio.create_task(self._read_loop(slot))

    def state_key(self, stream: str, subject: str) -> str:
        """Where a job's (or batch's) webhook state lives: beside its event stream."""
        if self.cluster is None:
            return self.keys.hook(subject)
        if stream.startswith(f"{self.keys.namespace}:{{"):  # a shard's: PUBLISH's prefix
            return f"{stream[: stream.index('}') + 1]}:hook:{subject}"
        return f"{self.keys.namespace}:{{{stream}}}:hook:{subject}"

    async def _read_loop(self, slot: int | None) -> None:
        """New entries of the streams of `slot` (None: of every stream), as many as the
        dispatcher may hold."""
        c = self.config
        while True:
            room = c.max_held - len(self.held)
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                streams = sorted(
                    s for s in self.streams if slot is None or self.redis.keyslot(s) == slot
                )
                reply = await self.redis.xreadgroup(
                    DISPATCHERS,
                    c.consumer,
                    dict.fromkeys(streams, ">"),
                    count=min(room, 512),
                    block=c.block_ms,
                )
            except aioredis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                self.streams.clear()  # a stream deleted by hand: list and group them again
                await self.discover()
                continue
            except (aioredis.RedisError, OSError) as exc:
                self.log.warning("read failed", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            for stream, entries in reply or []:
                for eid, fields in entries:
                    self._hold(stream.decode(), eid, fields)

    async def reclaim(self) -> None:
        """Entries of dispatchers that died (idle past the claim time) are taken over."""
        for stream in list(self.streams):
            start = "0-0"
            while True:
                answer = await self.redis.xautoclaim(
                    stream, DISPATCHERS, self.config.consumer, self.config.claim_idle_ms, start, 100
                )
                start, claimed = answer[0], answer[1]
                for eid, fields in claimed:
                    if fields:
                        self._hold(stream, eid, fields)
                    else:  # deleted while pending: nothing to deliver
                        await self.redis.xack(stream, DISPATCHERS, eid)
                if start in (b"0-0", "0-0"):
                    break

    async def keep(self) -> None:
        """Our entries' idle time reset: an event retried for hours stays ours."""
        by_stream: dict[str, list[bytes]] = {}
        for stream, eid in list(self.held):
            by_stream.setdefault(stream, []).append(eid)
        for stream, ids in by_stream.items():
            await self.redis.xclaim(stream, DISPATCHERS, self.config.consumer, 0, ids, justid=True)

    async def hand_back(self) -> None:
        """On stop: what we hold is marked idle past the claim time, so that the next
        XAUTOCLAIM of any dispatcher takes it at once."""
        held = list(self.held)
        for task in self.held.values():
            task.cancel()
        idle = self.config.claim_idle_ms
        for stream, eid in held:
            try:
                await self.redis.xclaim(
                    stream, DISPATCHERS, self.config.consumer, 0, [eid], idle=idle, justid=True
                )
            except (aioredis.RedisError, OSError):
                return

    # --- one event -------------------------------------------------------------------

    def _hold(self, stream: str, eid: bytes, fields: dict[bytes, bytes]) -> None:
        if (stream, eid) in self.held:
            return
        task = asyncio.create_task(self._handle(stream, eid, fields))
        self.held[(stream, eid)] = task
        self.metrics.held.set(len(self.held))

        def forget(_: asyncio.Task[None]) -> None:
            self.held.pop((stream, eid), None)
            self.metrics.held.set(len(self.held))
            self._room.set()

        task.add_done_callback(forget)

    async def _handle(self, stream: str, eid: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            subject = fields[b"job"].decode()
            seq, prev = int(fields[b"seq"]), int(fields[b"prev"])
            event = HookEvent.from_payload(subject, seq, unpack(fields[b"data"]))
        except (KeyError, ValueError, TypeError) as exc:
            self.log.warning(
                "unreadable webhook event dropped", entry_id=eid.decode(), error=str(exc)
            )
            await self.redis.xack(stream, DISPATCHERS, eid)
            return
        try:
            state = self.state_key(stream, subject)
            if event.url is not None:  # endpoints hear a job's end alone: nothing before it
                await self._in_turn(event, prev, state)
            await self._deliver(event)
            await self._done(
                keys=[stream, state],
                args=[DISPATCHERS, eid, seq, self.config.state_ttl_s],
            )
        except (aioredis.RedisError, OSError) as exc:
            # Left pending: the next reclaim (ours or another's) tries it again.
            self.log.warning("webhook event left pending", job_id=subject, error=str(exc))
            return
        waiter = self.waiters.pop(subject, None)
        if waiter is not None:
            waiter.set()

    async def _in_turn(self, event: HookEvent, prev: int, state: str) -> None:
        """Wait until the job's previous event is done (here or at another dispatcher), or
        this event's retry time is spent; `state`: the job's webhook state key."""
        if prev < 0:
            return
        deadline = event.created + self.config.retry_for_s
        while time.time() < deadline:
            done = await self.redis.hget(state, "done")
            if done is not None and int(done) >= prev:
                return
            waiter = self.waiters.setdefault(event.subject, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), 0.5)
            except TimeoutError:
                pass

    async def _targets(self, event: HookEvent) -> list[Target]:
        if event.url is not None:
            return [Target(event.url, self.config.secret)]
        now = time.monotonic()
        if now - self._endpoints_at > 2.0:
            self._endpoints = await endpoints.listed(self.redis, self.keys)
            self._endpoints_at = now
        # The namespace's endpoints hear every batch; a key's, its own batches and jobs.
        batch = event.type in BATCH_TYPES
        return [
            Target(e.url, endpoint_secret(self.config.secret, e.id, e.nonce), e.id)
            for e in self._endpoints
            if (e.owner == event.owner or (batch and not e.owner))
            and event.type in e.events
            and not e.disabled
        ]

    async def _deliver(self, event: HookEvent) -> None:
        """Every target, each until it answers 2xx, is gone, refused, or time runs out."""
        c = self.config
        body = self._body(event)
        pending = await self._targets(event)
        deadline = event.created + c.retry_for_s
        tries = 0
        while pending:
            retry = []
            for target in pending:
                outcome, why = await self._attempt(target, event, body)
                self.metrics.deliveries.labels(outcome).inc()
                if outcome == "delivered":
                    self.metrics.lag_seconds.observe(max(0.0, time.time() - event.created))
                elif outcome == "failed":
                    retry.append(target)
                else:
                    await self._failed(event, target, outcome, why)
            pending = retry
            if not pending:
                return
            pause = min(c.max_backoff_s, c.first_backoff_s * 2**tries) * random.uniform(0.5, 1.0)
            tries += 1
            if time.time() + pause > deadline:
                for target in pending:
                    self.metrics.deliveries.labels("expired").inc()
                    await self._failed(event, target, "expired", f"retried {tries} times")
                return
            await asyncio.sleep(pause)

    def _body(self, event: HookEvent) -> bytes:
        """The body, its text cut (and `text_truncated` set) when over the size cap."""
        body = event.body()
        limit = self.config.max_body_bytes
        text = event.data.get("text")
        while len(body) > limit and isinstance(text, str) and text:
            text = text[: max(0, len(text) - (len(body) - limit) - 64)]
            data = {**event.data, "text": text, "text_truncated": True}
            body = HookEvent(event.subject, event.seq, event.type, data, event.created).body()
        return body

    async def _attempt(self, target: Target, event: HookEvent, body: bytes) -> tuple[str, str]:
        """One POST: (outcome, why)."""
        c = self.config
        if target.endpoint is None and target.url in self.gone:
            return "gone", "the URL answered 410 Gone before"
        slot = self.slots.setdefault(target.origin, asyncio.Semaphore(c.per_endpoint))
        async with slot:
            started = time.monotonic()
            try:
                to = await resolve(target.url, c.allow_private)
            except Refused as exc:
                return "refused", str(exc)
            sent = headers(target.secret, event.webhook_id, int(time.time()), body)
            sent["host"] = to.host
            extensions = {"sni_hostname": to.sni} if to.sni else {}
            try:
                status = await asyncio.wait_for(
                    self._post(to.url, body, sent, extensions), c.attempt_timeout_s
                )
            except (httpx.HTTPError, OSError, TimeoutError) as exc:
                return "failed", type(exc).__name__
            finally:
                self.metrics.attempt_seconds.observe(time.monotonic() - started)
        if 200 <= status < 300:
            return "delivered", ""
        if status == 410:
            return "gone", "410 Gone"
        if 300 <= status < 400:
            return "refused", f"answered {status}: redirects are not followed"
        return "failed", f"answered {status}"

    async def _post(self, url: str, body: bytes, sent: dict[str, str], ext: dict) -> int:
        async with self.http.stream("POST", url, content=body, headers=sent, extensions=ext) as r:
            read = 0
            async for chunk in r.aiter_raw():
                read += len(chunk)
                if read >= self.config.max_response_bytes:
                    break
            return r.status_code

    async def _failed(self, event: HookEvent, target: Target, outcome: str, why: str) -> None:
        """A delivery given up: recorded (for `tokenq inspect`), an endpoint gone disabled."""
        if outcome == "gone":
            if target.endpoint is not None:
                await endpoints.disable(self.redis, self.keys, target.endpoint, why)
            else:
                self.gone.add(target.url)
                await self.redis.sadd(self.keys.webhook_gone, target.url)
        record = {
            "subject": event.subject,
            "type": event.type,
            "url": shown(target.url),
            "endpoint": target.endpoint or "",
            "outcome": outcome,
            "reason": why,
            "at": round(time.time(), 3),
        }
        await self.redis.xadd(
            self.keys.webhook_failures, record, maxlen=FAILURES_MAXLEN, approximate=True
        )
        self.log.warning("webhook not delivered", job_id=event.subject, **record)
