"""`tokenq serve`: the OpenAI API in front of the queue (FastAPI on uvicorn, no torch).

Each HTTP request becomes one job submitted with `AsyncClient`, and its answer is read
from the job's reply stream; the translation both ways is tokenq/server/openai_api.py. The
gateway keeps no state of its own that matters: jobs, replies and the few bookmarks below
live in Redis, so any number of gateways serve side by side and a restarted one loses
nothing the workers are running.

- `Idempotency-Key` is the job id. A retried POST attaches to the job already submitted
  and gets its generation, never a second run. A streaming retry continues after the last
  event its client saw: the `Last-Event-ID` header (every SSE event carries the reply
  stream's id), else the event the gateway last sent for that key (the bookmark
  `ns:gw:sent:<id>`, written when a stream's client leaves).
- A client that disconnects cancels its job, after `cancel_grace` seconds during which a
  retry with the same key may attach instead, unless it sent `X-Tokenq-Keep-Running: 1`.
  `ns:gw:watchers:<id>` counts the connections a job has beyond its first, so one leaving
  while another watches cancels nothing.
- Errors come in OpenAI's shape with their HTTP status; `create_app` leaves room for more
  routers (`app.include_router`), which find the shared client in `app.state.client` and
  its Redis connection in `app.state.redis`.
- Operators get the fleet's Prometheus gauges at `/metrics` and a live page at
  `/dashboard` (tokenq/server/dashboard.py), read from Redis on a blocking connection of their
  own (prometheus_client collects synchronously) in the thread pool.
- Access (docs/security.md): `Guard` (tokenq/server/auth.py) lets `/v1/*` through only with
  an API key once keys are configured, and knows the principal each request is; the job
  an `Idempotency-Key` names is that principal's (`Principal.job_id`); per-key limits are
  counted in Redis (tokenq/server/ratelimit.py) by every gateway alike.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from tokenq.producer.client import AsyncClient, AsyncJob
from tokenq.producer.errors import QueueFull, UnknownModel
from tokenq.protocol import (
    DEFAULT_NAMESPACE,
    DONE,
    ERROR,
    JOB_ID_RE,
    DoneEvent,
    ErrorEvent,
    Event,
    ProtocolError,
    RestartEvent,
    TokenEvent,
    clip,
    new_job_id,
    quote,
    reply_seq,
)
from tokenq.protocol.connection import DEFAULT_REDIS_URL, Cluster, connect, redacted
from tokenq.server.auth import (
    ANONYMOUS,
    OPEN_POLICY,
    BodyLimits,
    Guard,
    KeyRing,
    Policy,
    Principal,
    apply_principal,
)
from tokenq.server.batch_api import BatchConfig, batch_router
from tokenq.server.dashboard import dashboard_router
from tokenq.server.openai_api import (
    BadRequest,
    ChoiceLogprobs,
    Logprobs,
    Rendering,
    choices_of,
    chunk_body,
    error_body,
    job_error,
    rendering,
    response_body,
    to_submit_kwargs,
    usage_chunk,
)
from tokenq.server.ratelimit import (
    DEFAULT_MAX_TOKENS,
    Admission,
    AdmitGate,
    Limited,
    RateLimiter,
    estimate_tokens,
)
from tokenq.server.webhooks_api import EndpointOwners, webhooks_router

KEEP_RUNNING = "x-tokenq-keep-running"
TIMEOUT_HEADER = "x-tokenq-timeout"
JOB_HEADER = "X-Tokenq-Job-Id"
EVENT_ID_RE = re.compile(r"\d{1,20}-\d{1,20}")
FLEET_TIMEOUT_S = 5.0  # /metrics and /dashboard/data: Redis silent this long is an error
TRUE = ("1", "true", "yes", "on")
log = logging.getLogger("tokenq.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str = DEFAULT_REDIS_URL
    namespace: str = DEFAULT_NAMESPACE
    # Bodies beyond this are refused (413) before they are read whole. A job's own limits
    # (tokenq.protocol.Limits) apply to what is inside.
    max_body_bytes: int = 8 << 20
    # A job's deadline, from its submit, unless the request's X-Tokenq-Timeout is shorter:
    # past it the job is stopped and the request answered 504.
    request_timeout: float = 600.0
    retry_after: int = 1  # seconds, in a 429's Retry-After
    # How long a job whose client left keeps running for a retry to attach, then cancelled.
    cancel_grace: float = 3.0
    # The AsyncClient's reply reader: a new stream joins the shared XREAD within this.
    block_ms: int = 10
    max_connections: int = 100  # to Redis, shared by every request
    retry_for: float = 5.0  # how long a request rides out an unreachable Redis: then 503
    # Outputs (n per job) a model's lane may hold before 429 (ClientConfig.max_backlog; None: its
    # default).
    max_backlog: int | None = None
    # A submit is answered only once a replica holds the job (ClientConfig.durable_submit).
    durable_submit: bool = False
    # Access (docs/security.md). No key and no key file: open to whoever reaches it.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_file: Path | None = None
    # What a key may do unless its line in the file says otherwise; without keys, the
    # limits apply to everyone together (every lane and priority open).
    key_policy: Policy = field(default_factory=Policy)
    admin_key: str | None = field(default=None, repr=False)  # for /metrics and /dashboard
    admin_port: int | None = None  # serve those there instead of on the public port
    admin_host: str = "127.0.0.1"
    log_payloads: bool = False  # prompts and outputs at INFO, for debugging
    # The namespace's whsec_ secret: /v1/webhooks derives each endpoint's secret from it.
    webhook_secret: str | None = field(default=None, repr=False)


def key_ring(config: GatewayConfig) -> KeyRing:
    """The keys `config` names (KeyFileError if its file cannot be read)."""
    policy = config.key_policy
    anonymous = replace(
        OPEN_POLICY,
        requests_per_minute=policy.requests_per_minute,
        tokens_per_minute=policy.tokens_per_minute,
        concurrent_jobs=policy.concurrent_jobs,
        storage_bytes=policy.storage_bytes,
    )
    return KeyRing(
        config.api_keys, config.api_keys_file, policy, Principal(ANONYMOUS, None, anonymous)
    )


class ClientLeft(Exception):
    """The HTTP client disconnected while its request was being answered."""


def _error(exc: BadRequest, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    size = request.headers.get("content-length")
    too_big = BadRequest(
        f"the request body is over {limit} bytes", None, 413, code="payload_too_large"
    )
    if size is not None and size.isdigit() and int(size) > limit:
        raise too_big
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_big
    return bytes(body)


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {quote(str(exc))}") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply to parse") from None


async def _client_gone(request: Request) -> None:
    """Returns when the HTTP client disconnects (the body has been read: nothing else
    can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Attachment:
    """One HTTP request following one job: its events, and what happens when it leaves."""

    def __init__(
        self, app: FastAPI, job: AsyncJob, keep_running: bool, admission: Admission | None
    ) -> None:
        self.app = app
        self.job = job
        self.keep_running = keep_running
        self.admission = admission
        self.last_sent = "0-0"
        self.finished = False

    def settle(self, used: int | None) -> None:
        """The request is over: its key's limits learn what it used (None: unknown), off
        the request's path (it only schedules)."""
        admission = self.admission
        if admission is None or admission.settled:
            return
        admission.settled = True
        if admission.tokens or admission.claimed:
            limiter: RateLimiter = self.app.state.limiter
            _background(self.app, limiter.settle(admission, used))

    async def attach(self) -> None:
        """A second connection to a job (a retry): counted, so that an earlier one's leaving
        does not cancel the job this one follows."""
        client: AsyncClient = self.app.state.client
        key = _watchers_key(client, self.job.id)
        async with client.redis.pipeline(transaction=False) as pipe:
            pipe.incr(key)
            pipe.expire(key, client.config.job_ttl)
            await pipe.execute()

    def leave(self) -> None:
        """The client left before the end: bookmark what it was sent, and cancel the job
        after the grace period unless another connection follows it by then. Safe to call
        from a cancelled task (it only schedules)."""
        self.settle(None)
        if self.finished:
            return
        _background(self.app, self._leave())

    async def _leave(self) -> None:
        try:
            await self._bookmark_and_cancel()
        except redis.RedisError as exc:  # the job then runs to its end: nothing is lost
            log.warning("job %s: its client left, and Redis failed: %s", self.job.id, exc)

    async def _bookmark_and_cancel(self) -> None:
        client: AsyncClient = self.app.state.client
        config: GatewayConfig = self.app.state.config
        watchers, sent = _watchers_key(client, self.job.id), _sent_key(client, self.job.id)
        ttl = client.config.job_ttl
        async with client.redis.pipeline(transaction=False) as pipe:
            if self.last_sent != "0-0":
                pipe.set(sent, self.last_sent, ex=ttl)
            if not self.keep_running:
                pipe.decr(watchers)
                pipe.expire(watchers, ttl)
            await pipe.execute()
        if self.keep_running:
            log.info("job %s: its client left; it runs on (%s)", self.job.id, KEEP_RUNNING)
            return
        await asyncio.sleep(config.cancel_grace)
        left = int(await client.redis.get(watchers) or 0)
        if left < 0:  # counts the connections beyond the first: -1 is nobody
            await self.job.cancel()
            log.info("job %s: its client left before the end; cancelled", self.job.id)
        else:
            log.info("job %s: its client left; another connection follows it", self.job.id)


def _background(app: FastAPI, work: Any) -> None:
    """Run `work` after the answer, awaited before the gateway stops."""

    async def logged() -> None:
        try:
            await work
        except redis.RedisError as exc:  # a count left as it was: it lapses with its window
            log.warning("Redis failed after a request: %s", exc)

    task = asyncio.get_running_loop().create_task(logged())
    tasks: set[asyncio.Task[None]] = app.state.leaving
    tasks.add(task)
    task.add_done_callback(tasks.discard)


def _watchers_key(client: AsyncClient, job_id: str) -> str:
    return f"{client.config.namespace}:gw:watchers:{job_id}"


def _sent_key(client: AsyncClient, job_id: str) -> str:
    return f"{client.config.namespace}:gw:sent:{job_id}"


async def _missing_model(client: AsyncClient, exc: UnknownModel) -> BadRequest:
    """404 for a model nobody serves, 503 when its workers (or all workers) are gone."""
    live = await client.models()
    if not live:
        return BadRequest("no live worker", "model", 503, "service_unavailable", "no_live_worker")
    if exc.model is None:  # several models served: which one?
        return BadRequest(str(exc), "model")
    keys = client.keys
    registered = await client.redis.zrange(keys.workers, 0, -1)
    async with client.redis.pipeline(transaction=False) as pipe:
        for consumer in registered:
            pipe.hget(keys.worker(consumer.decode()), "names")
        rows = await pipe.execute()
    known = {name for row in rows if row for name in json.loads(row)}
    if exc.model in known:
        message = f"no live worker serves model {exc.model!r} (its workers stopped answering)"
        return BadRequest(message, "model", 503, "service_unavailable", "no_live_worker")
    return BadRequest(str(exc), "model", 404, "invalid_request_error", "model_not_found")


def _timeout(request: Request, config: GatewayConfig) -> float:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return config.request_timeout
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise BadRequest(f"{TIMEOUT_HEADER} must be a positive number of seconds", TIMEOUT_HEADER)
    return min(value, config.request_timeout)


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is not None and not JOB_ID_RE.fullmatch(key):
        raise BadRequest(
            f"Idempotency-Key {quote(key)} must match {JOB_ID_RE.pattern}", "Idempotency-Key"
        )
    return key


@dataclass
class Submitted:
    """A request's job, queued (or found: its Idempotency-Key's), and how to answer."""

    model: str
    job: AsyncJob
    form: Rendering
    timeout: float
    admission: Admission | None  # what the key's limits counted, to settle at the end


async def _context(client: AsyncClient, model: str | None) -> int | None:
    """The model's context length: what a request without max_tokens may generate."""
    return next((m.max_model_len for m in await client.models() if m.id == model), None)


async def _gate(
    request: Request, principal: Principal, kwargs: dict[str, Any], job_id: str, timeout: float
) -> AdmitGate | None:
    """What counts the request against its key's limits and binds its Idempotency-Key to
    the job it asks for, in the script call that submits it (None when there is nothing
    to count or bind). The job, not the body's bytes: a retry may ask for the answer
    another way (streamed or not, with a usage chunk or not), never for another job."""
    keyed = request.headers.get("idempotency-key") is not None
    policy = principal.policy
    if not policy.limited and not keyed:
        return None
    tokens = 0
    if policy.tokens_per_minute:
        context = None
        if kwargs.get("max_tokens", DEFAULT_MAX_TOKENS) is None:
            context = await _context(request.app.state.client, kwargs.get("model"))
        tokens = estimate_tokens(kwargs, context)
    digest = None
    if keyed:
        job = json.dumps(kwargs, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(job.encode()).hexdigest()
    limiter: RateLimiter = request.app.state.limiter
    return limiter.gate(principal, job_id, tokens, timeout, digest)


async def _submit(request: Request, kind: str) -> Submitted:
    """Validate the request and queue its job (or find the job its key names)."""
    app = request.app
    client: AsyncClient = app.state.client
    config: GatewayConfig = app.state.config
    principal: Principal = request.state.principal
    raw = await _read_body(request, config.max_body_bytes)
    body = _parse_json(raw)
    kwargs = to_submit_kwargs(kind, body, client.config.limits)
    form = rendering(kind, body)
    principal.policy.check_priority(kwargs.get("priority", 0))
    apply_principal(kwargs, principal)
    if await app.state.endpoint_owners.hears_jobs(principal.id):
        kwargs["webhook_endpoints"] = principal.id  # its endpoints hear its jobs' ends
    key = _idempotency_key(request)
    job_id = new_job_id() if key is None else principal.job_id(key)
    timeout = _timeout(request, config)
    if "model" not in kwargs:  # the one model served, as the client would pick it
        models = await client.models()
        if len(models) == 1:
            kwargs["model"] = models[0].id
    gate = await _gate(request, principal, kwargs, job_id, timeout)
    if config.log_payloads:
        log.info("job %s: request %s", job_id, clip(raw.decode(errors="replace")))
    limiter: RateLimiter = app.state.limiter
    deadline = time.time() + timeout
    try:
        job = await client.submit(job_id=job_id, deadline=deadline, gate=gate, **kwargs)
    except (UnknownModel, QueueFull, ProtocolError) as exc:
        if gate is not None and gate.admission is not None:  # counted, nothing queued
            await limiter.settle(gate.admission, 0)
        if isinstance(exc, UnknownModel):
            raise await _missing_model(client, exc) from None
        if isinstance(exc, QueueFull):
            raise BadRequest(str(exc), None, 429, "rate_limit_error", "queue_full") from None
        raise job_error(exc.code, exc.message) from None
    admission = None if gate is None else gate.admission
    if job.duplicate and admission is not None and admission.tokens:
        # Another request queued it first (between a cluster's RATE_ADMIT and SUBMIT),
        # and pays; the slot both claimed under the job's id stays its.
        admission.claimed = False
        await limiter.settle(admission, 0)
    return Submitted(kwargs.get("model", ""), job, form, timeout, admission)


async def _check_reply(client: AsyncClient, job: AsyncJob) -> None:
    """A retry after the job's reply expired (an hour after it ended) would wait forever."""
    if await job.status() in (DONE, ERROR) and not await client.redis.exists(
        client.keys_of(job.id).reply(job.id)
    ):
        raise BadRequest(
            f"job {job.id} ended and its reply has expired", None, 409, code="reply_expired"
        )


def _failure(event: Event) -> BadRequest | None:
    if isinstance(event, ErrorEvent):
        return job_error(event.code, event.message)
    if isinstance(event, DoneEvent) and event.finish_reason == "deadline":
        return job_error(
            "deadline_exceeded",
            f"the deadline passed after {event.usage.completion_tokens} generated tokens",
        )
    return None


async def generate(request: Request, kind: str) -> Response:
    """One completion request, answered whole or as a stream; see the module's doc."""
    app = request.app
    config: GatewayConfig = app.state.config
    client: AsyncClient = app.state.client
    try:
        submitted = await _submit(request, kind)
        job, form, model = submitted.job, submitted.form, submitted.model
        keep = request.headers.get(KEEP_RUNNING, "").lower() in TRUE
        watch = Attachment(app, job, keep, submitted.admission)
        headers = {JOB_HEADER: job.id}
        if submitted.admission is not None:
            headers.update(submitted.admission.headers)
        after = "0-0"
        if job.duplicate:
            try:
                await _check_reply(client, job)
                await watch.attach()
                if form.stream:
                    after = await _resume_point(request, client, job)
            except BadRequest as exc:
                raise _Answered(exc, headers) from None
        ended = after != "0-0" and await _ended_at(client, job, after)
        # The wait is bounded by the job's deadline: the worker stops it there. The margin
        # covers a worker that died holding it (another takes it over, within a minute).
        events = job.stream(after=after, timeout=submitted.timeout + 90)
        handed_over = False
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            if not form.stream:
                return await _collect(kind, watch, model, form, events, gone, headers)
            # The first event decides the status: an error before any token gets its own.
            first = None if ended else await _next(events, gone)
            if first is not None and (failure := _failure(first)) is not None:
                watch.finished = True
                watch.settle(_used(first))
                return _error(failure, headers)
            stream = _sse(kind, job, model, form, events, first, ended, watch)
            handed_over = True
            return EventStream(stream, gone, headers)
        except ClientLeft:
            watch.leave()
            return Response(status_code=499)  # nobody reads it: the client is gone
        except TimeoutError:
            watch.leave()
            return _error(job_error("deadline_exceeded", "no answer within the timeout"), headers)
        finally:
            if not handed_over:
                gone.cancel()
                await events.aclose()
                watch.settle(None)  # unless settled with its usage already
    except BadRequest as exc:
        if isinstance(exc, Limited | _Answered):
            return _error(exc, exc.headers)
        headers = {"Retry-After": str(config.retry_after)} if exc.status == 429 else None
        return _error(exc, headers)
    except redis.ConnectionError as exc:
        error = BadRequest(f"Redis unavailable: {quote(str(exc))}", None, 503, "server_error")
        return _error(error)
    except redis.RedisError as exc:  # answering but refusing: full, read-only, ...
        error = BadRequest(f"Redis refused: {quote(str(exc))}", None, 503, "server_error")
        return _error(error)


class _Answered(BadRequest):
    """A refusal after the job was found: its answer keeps the job's headers."""

    def __init__(self, exc: BadRequest, headers: dict[str, str]) -> None:
        super().__init__(exc.message, exc.param, exc.status, exc.type, exc.code)
        self.headers = headers


def _used(event: Event) -> int | None:
    """The tokens a job used, from its final event (an error: none counted)."""
    if isinstance(event, DoneEvent):
        return event.usage.total_tokens
    return 0 if isinstance(event, ErrorEvent) else None


class EventStream(Response):
    """Server-sent events, ended by the request's own disconnect watcher. Starlette's
    StreamingResponse starts a task group and a second watcher for every response; this
    request has one already (`_client_gone`, running since the wait for the first event),
    which cancels the stream when the client leaves: about a fifth less gateway CPU per
    short streamed request (docs/performance.md)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        gone: asyncio.Future[None],
        headers: dict[str, str],
    ) -> None:
        self.chunks = chunks
        self.gone = gone
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        streaming = True

        def client_left(_: asyncio.Future[None]) -> None:
            if streaming:  # a callback scheduled as the stream ended must not cancel later work
                task.cancel()

        self.gone.add_done_callback(client_left)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if self.gone.cancelled() or not self.gone.done():
                raise  # not the client leaving: the server is stopping
            task.uncancel()
        finally:
            streaming = False
            self.gone.cancel()
            await self.chunks.aclose()  # its `finally` hands the job to Attachment.leave


async def _next(events: AsyncIterator[Event], gone: asyncio.Future[None]) -> Event:
    """The next event, unless the client leaves first."""
    step = asyncio.ensure_future(anext(events))
    await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
    if step.done():
        return step.result()
    step.cancel()
    await asyncio.wait({step})  # its generator must have stopped before anyone closes it
    raise ClientLeft


async def _resume_point(request: Request, client: AsyncClient, job: AsyncJob) -> str:
    last = request.headers.get("last-event-id")
    if last is not None:
        if not EVENT_ID_RE.fullmatch(last):
            raise BadRequest("Last-Event-ID must be a reply event id (n-m)", "Last-Event-ID")
        return last
    bookmark = await client.redis.get(_sent_key(client, job.id))
    return bookmark.decode() if bookmark else "0-0"


async def _ended_at(client: AsyncClient, job: AsyncJob, after: str) -> bool:
    """Whether the client already saw the job's final event (nothing more will come)."""
    last = await client.redis.xrevrange(client.keys_of(job.id).reply(job.id), count=1)
    if not last:
        return False
    entry_id, fields = last[0]
    final = fields.get(b"type") in (DONE.encode(), ERROR.encode())
    return final and reply_seq(entry_id) <= reply_seq(after)


async def _collect(
    kind: str,
    watch: Attachment,
    model: str,
    form: Rendering,
    events: AsyncIterator[Event],
    gone: asyncio.Future[None],
    headers: dict[str, str],
) -> Response:
    job = watch.job
    logprobs = ChoiceLogprobs() if form.logprobs is not None else None
    while True:
        event = await _next(events, gone)
        if isinstance(event, TokenEvent) and logprobs is not None:
            logprobs.add(event)
        elif isinstance(event, RestartEvent) and logprobs is not None:
            logprobs.restart(event)
        elif isinstance(event, DoneEvent | ErrorEvent):
            break
    watch.settle(_used(event))
    failure = _failure(event)
    if failure is not None:
        return _error(failure, headers)
    assert isinstance(event, DoneEvent)
    _log_answer(watch.app, job.id, event)
    body = response_body(kind, job.id, model, event, int(time.time()), logprobs, form)
    return JSONResponse(body, headers=headers)


def _log_answer(app: FastAPI, job_id: str, event: DoneEvent) -> None:
    if app.state.config.log_payloads:
        log.info("job %s: answer %s", job_id, clip(event.text))


def _sse_data(obj: Any, event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _sse(
    kind: str,
    job: AsyncJob,
    model: str,
    form: Rendering,
    events: AsyncIterator[Event],
    first: Event | None,
    ended: bool,
    watch: Attachment,
) -> AsyncGenerator[bytes, None]:
    """The stream in OpenAI's chunk format. Each chunk carries its reply event's id, so a
    client can resume with Last-Event-ID. `EventStream` cancels this generator when the
    client leaves: `finally` then hands the job to `Attachment.leave`."""
    created = int(time.time())
    usage = form.include_usage
    top = form.logprobs or 0
    sent_text = False
    try:
        if kind == "chat":
            for index in range(form.n):
                yield _sse_data(
                    chunk_body(
                        kind, job.id, model, created, role=True, include_usage=usage, index=index
                    )
                )
        pending = [first] if first is not None else []
        while not ended:
            if pending:
                event = pending.pop()
            else:
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    failure = job_error("deadline_exceeded", "no answer within the timeout")
                    yield _sse_data(failure.body())
                    break
                except redis.ConnectionError as exc:  # the job runs on: a retry resumes it
                    message = f"Redis unavailable: {quote(str(exc))}"
                    yield _sse_data(error_body(message, "server_error", None, "redis_unavailable"))
                    break
            if isinstance(event, TokenEvent):
                lp = None
                if form.logprobs is not None and event.logprobs is not None:
                    lp = Logprobs()
                    lp.add(event)
                if not event.text and lp is None:
                    watch.last_sent = event.event_id
                    continue
                chunk = chunk_body(
                    kind, job.id, model, created, text=event.text, logprobs=lp,
                    top_logprobs=top, include_usage=usage, index=event.output,
                )  # fmt: skip
                sent_text = sent_text or bool(event.text)
                yield _sse_data(chunk, event.event_id)
                watch.last_sent = event.event_id
            elif isinstance(event, RestartEvent):
                if sent_text:  # what the client holds cannot be taken back: say so
                    watch.finished = True
                    message = "the job was re-run after a worker failure and its text changed"
                    yield _sse_data(error_body(message, "server_error", None, "restarted"))
                    break
            else:
                watch.finished = True
                watch.settle(_used(event))
                failure = _failure(event)
                if failure is not None:
                    yield _sse_data(failure.body(), event.event_id)
                    break
                assert isinstance(event, DoneEvent)
                _log_answer(watch.app, job.id, event)
                for choice in choices_of(event):  # each choice's end, the last with its id
                    end = chunk_body(
                        kind, job.id, model, created, finish_reason=choice.finish_reason,
                        include_usage=usage, index=choice.index,
                    )  # fmt: skip
                    last = choice.index == form.n - 1 or event.outputs is None
                    yield _sse_data(end, event.event_id if last else None)
                if usage:
                    yield _sse_data(usage_chunk(kind, job.id, model, created, event))
                break
        watch.finished = True
        yield b"data: [DONE]\n\n"
    finally:
        watch.leave()
        await events.aclose()


async def model_cards(request: Request) -> list[dict[str, Any]]:
    """OpenAI's model objects, one per name the live workers serve (aliases included)."""
    client: AsyncClient = request.app.state.client
    data = []
    for m in await client.models():
        created = int(m.heartbeat_at)
        for name in (m.id, *m.aliases):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "tokenq",
                    "root": m.id,
                    "parent": None,
                    "max_model_len": m.max_model_len,
                }
            )
    return data


def openai_router() -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            return JSONResponse({"object": "list", "data": await model_cards(request)})
        except redis.RedisError as exc:
            return _error(BadRequest(f"Redis unavailable: {quote(str(exc))}", None, 503))

    @router.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        try:
            cards = await model_cards(request)
        except redis.RedisError as exc:
            return _error(BadRequest(f"Redis unavailable: {quote(str(exc))}", None, 503))
        card = next((c for c in cards if c["id"] == model), None)
        if card is None:
            missing = f"no live worker serves model {quote(model)}"
            kind = "invalid_request_error"
            return _error(BadRequest(missing, "model", 404, kind, "model_not_found"))
        return JSONResponse(card)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @router.get("/health")
    async def health(request: Request) -> Response:
        try:
            await request.app.state.redis.ping()
        except redis.RedisError as exc:
            return _error(BadRequest(f"Redis unavailable: {quote(str(exc))}", None, 503))
        return Response(status_code=200)

    return router


def _fleet_connection(config: GatewayConfig) -> redis.Redis | Cluster:
    """The fleet's readers are blocking (prometheus_client collects synchronously): their
    own connection (on a Redis Cluster, to every shard), run in the thread pool, with
    timeouts so a scrape never hangs."""
    return connect(
        config.redis_url, socket_timeout=FLEET_TIMEOUT_S, socket_connect_timeout=FLEET_TIMEOUT_S
    )


def _openai_errors(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers
        )


def create_app(config: GatewayConfig | None = None, batches: BatchConfig | None = None) -> FastAPI:
    """The gateway's app: OpenAI's routes, the Files and Batches API (tokenq/server/batch_api.py),
    the fleet's /metrics and the /dashboard page (tokenq/server/dashboard.py) unless
    `config.admin_port` serves them (`create_admin_app`), behind `Guard`; and
    `app.state.client` (an AsyncClient), `app.state.redis` (its connection; on a Redis
    Cluster, redis-py's asyncio `RedisCluster`, which routes each key to its node),
    `app.state.config` and `app.state.keys` (the KeyRing) for routers added later. Raises
    KeyFileError when the key file cannot be read."""
    config = config or GatewayConfig()
    batches = batches or BatchConfig()
    ring = key_ring(config)
    fleet = None if config.admin_port is not None else _fleet_connection(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = await AsyncClient.connect(
            config.redis_url,
            namespace=config.namespace,
            block_ms=config.block_ms,
            max_connections=config.max_connections,
            retry_for=config.retry_for,
            durable_submit=config.durable_submit,
            **({} if config.max_backlog is None else {"max_backlog": config.max_backlog}),
        )
        app.state.client = client
        app.state.redis = client.redis
        sharded = client.cluster is not None
        limiter = RateLimiter(client.redis, config.namespace, client.config.job_ttl, sharded)
        app.state.limiter = limiter
        app.state.endpoint_owners = EndpointOwners(client.redis, client.keys)
        app.state.leaving = set()
        hangup = _reload_on_hangup(ring)
        await _say_where(app, client)
        try:
            yield
        finally:
            if hangup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            # Clients that left just before the shutdown still get their jobs cancelled.
            await asyncio.gather(*app.state.leaving, return_exceptions=True)
            await client.aclose()
            if fleet is not None:
                fleet.close()

    app = FastAPI(title="tokenq", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.keys = ring
    app.state.listen = "an ASGI server"  # `serve` names its address
    _openai_errors(app)
    app.include_router(openai_router())
    if fleet is not None:
        app.include_router(dashboard_router(fleet, config.namespace))
    app.include_router(batch_router(batches))  # /v1/files, /v1/batches and their runner
    app.include_router(webhooks_router())  # /v1/webhooks: a key's own endpoints
    app.add_middleware(
        Guard,
        ring=ring,
        body=BodyLimits(upload=batches.max_file_bytes + (1 << 20), other=config.max_body_bytes),
        admin_key=config.admin_key if fleet is not None else None,
        admin_closed=fleet is not None and config.admin_key is None and not ring.open,
    )
    return app


def create_admin_app(config: GatewayConfig) -> FastAPI:
    """/metrics, /dashboard and its data alone, for `config.admin_port`: open to whoever
    reaches that address unless `config.admin_key` is set."""
    fleet = _fleet_connection(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            fleet.close()

    app = FastAPI(title="tokenq admin", lifespan=lifespan, docs_url=None, redoc_url=None)
    _openai_errors(app)
    app.include_router(dashboard_router(fleet, config.namespace))
    app.add_middleware(
        Guard,
        ring=KeyRing(),
        body=BodyLimits(upload=1 << 10, other=1 << 10),
        admin_key=config.admin_key,
        admin_closed=False,
    )
    return app


def _reload_on_hangup(ring: KeyRing) -> bool:
    """SIGHUP rereads the key file, where there is one and this is the main thread."""
    if ring.file is None:
        return False
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, ring.reload)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
        return False
    return True


async def _say_where(app: FastAPI, client: AsyncClient) -> None:
    """At start: where the gateway listens, which Redis and namespace it serves and the
    models live workers serve there now; then one warning line if it is open to anyone,
    one if it logs payloads."""
    config: GatewayConfig = app.state.config
    where = f"Redis {redacted(config.redis_url)}, namespace {config.namespace}"
    try:
        names = [m.id for m in await client.models()]
    except redis.RedisError as exc:
        log.warning("listening on %s; %s does not answer yet: %s", app.state.listen, where, exc)
    else:
        models = ", ".join(names) if names else "none yet (no live worker)"
        log.info("listening on %s; %s; models: %s", app.state.listen, where, models)
    ring: KeyRing = app.state.keys
    if ring.open:
        log.warning(
            "no API key configured: anyone who reaches %s can submit jobs and read their "
            "answers, files and batches (--api-key, --api-keys-file; docs/security.md)",
            app.state.listen,
        )
    else:
        log.info("API keys: %d", len(ring.table))
    if config.log_payloads:
        log.warning("--log-payloads: prompts and outputs are written to this log")


def _quiet_server(app: FastAPI, host: str, port: int, log_level: str) -> Any:
    """A uvicorn server that installs no signal handlers: the admin address's, stopped
    with the main one (whose handlers stop the process)."""
    import uvicorn

    class Quiet(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Quiet(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False))


def serve(
    config: GatewayConfig,
    host: str,
    port: int,
    log_level: str = "info",
    batches: BatchConfig | None = None,
) -> None:
    """Run the gateway (and its admin address, if `config.admin_port`). `log_level` is
    uvicorn's and the gateway's own (`tokenq.*` loggers: the start lines, clients that
    leave); requests themselves are not logged, nor payloads unless `log_payloads`."""
    import uvicorn

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    own = logging.getLogger("tokenq")
    own.addHandler(handler)
    own.setLevel(log_level.upper())
    app = create_app(config, batches)
    app.state.listen = f"http://{host}:{port}"
    main = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    )
    if config.admin_port is None:
        main.run()
        return
    admin = _quiet_server(create_admin_app(config), config.admin_host, config.admin_port, log_level)

    async def both() -> None:
        side = asyncio.create_task(admin.serve())
        try:
            await main.serve()
        finally:
            admin.should_exit = True
            await side

    asyncio.run(both())
