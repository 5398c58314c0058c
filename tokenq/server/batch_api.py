"""OpenAI's Files and Batches API in the gateway: upload a batch file, run it, fetch the
results (`POST /v1/files`, `/v1/batches`, cancel, `GET /v1/files/{id}/content`).

Everything lives in Redis, under the namespace, so that a gateway that restarts (or dies)
loses no batch: another gateway, or the same one back, takes it over and resumes it.

| key | type | what |
|---|---|---|
| `ns:file:<id>` | hash | a file's metadata: size, times, name, purpose, `owner` |
| `ns:file:<id>:data` | string | its content; output and error files grow by APPEND |
| `ns:files:<owner>` | sorted set | an owner's file ids by creation (listing) |
| `ns:files:<owner>:bytes` | hash | their sizes (the storage quota) |
| `ns:batch:<id>` | hash | a batch: status, timestamps, counts, its files, `owner`, `tenant` |
| `ns:batches:<owner>` | sorted set | an owner's batch ids by creation (listing, newest first) |
| `ns:batches:active` | set | batches not in a final state: the runners' work list |
| `ns:batch:<id>:lock` | string | the gateway running it (a token, expiring unless renewed) |

On a Redis Cluster each key above starts `ns:{ns:hooks:batches}:` instead of `ns:`
(`ns:{ns:hooks:batches}:file:<id>`): its hash tag is the name of the batch webhook stream,
so they and that stream share one slot, and every script and transaction over them (a
batch's end with its webhook event included) stays one atomic call, as on one server.
Their storage is one primary's; the batches' jobs spread over the shards as any job's.

Files and batches belong to the principal (tokenq/server/auth.py) that created them: any
other's id is answered 404, as an id that does not exist. Files expire (`expires_after`,
by default `DEFAULT_EXPIRY_S` after their creation, batch outputs as their batch's input)
and count against their owner's storage quota until then.

A batch runner task in every gateway scans the active set, takes a batch's lock (SET NX
with a TTL it renews while it runs: two gateways never run one batch, and a dead
gateway's batches are taken over once its lock expires) and drives it through OpenAI's
statuses: `validating` (every line parsed, custom_ids unique, one endpoint; a bad file
fails the batch with its errors by line) -> `in_progress` (the lines run as jobs through
tokenq/batch/runner.py's `BatchRun`, the same machinery as `tokenq batch run`, its answers
appended to the output and error files in one transaction with the request counts) ->
`finalizing` -> `completed`; `cancelling` -> `cancelled` (the running jobs cancelled, what
was answered kept); `expired` past the completion window. A resumed batch skips the lines
its files answer and follows jobs already queued (job ids come from the batch id and
custom_id), so nothing runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenq.batch.runner import (
    ENDPOINTS,
    BatchError,
    BatchRun,
    LineError,
    done_from,
    encode_record,
    job_id_for,
    parse_line,
)
from tokenq.producer.client import Client
from tokenq.protocol import Keys, pack
from tokenq.protocol.scripts import source
from tokenq.protocol.webhooks import HookEvent
from tokenq.server.auth import ANONYMOUS, KeyRing, Principal, apply_principal
from tokenq.server.openai_api import BadRequest, error_body
from tokenq.server.ratelimit import SyncMeter

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
)
FAILED, CANCELLING, CANCELLED, EXPIRED = "failed", "cancelling", "cancelled", "expired"
FINAL = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})
WINDOWS = {"24h": 24 * 3600}  # completion windows OpenAI offers
# Files expire, as OpenAI's batch files do: 30 days after creation unless `expires_after`
# says otherwise (from an hour to 30 days); a batch's outputs when its input does.
DEFAULT_EXPIRY_S = 30 * 24 * 3600
MIN_EXPIRY_S = 3600
MAX_ERRORS = 100  # validation errors kept on a failed batch
TIMESTAMPS = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


@dataclass(frozen=True)
class BatchConfig:
    """The batch runner's settings (`tokenq serve --batch-...`)."""

    max_file_bytes: int = 200 << 20  # OpenAI's bound on a batch input file
    poll_s: float = 1.0  # how often the runner looks for batches, and at a running one
    lock_ttl_s: float = 30.0  # a dead gateway's batches are taken over after this
    max_running: int = 4  # batches one gateway runs at once
    max_outstanding: int = 512  # jobs per batch queued and not yet answered


class BatchKeys:
    """The Files and Batches API's keys; `sharded` (a Redis Cluster): all in the slot of
    the batch webhook stream (see the module's docstring)."""

    def __init__(self, namespace: str, sharded: bool = False) -> None:
        self.ns = namespace
        self.prefix = f"{namespace}:{{{Keys(namespace).batch_hooks}}}" if sharded else namespace

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def data(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}:data"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def lock(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:lock"

    def files(self, owner: str) -> str:
        return f"{self.prefix}:files:{owner}"

    def sizes(self, owner: str) -> str:
        return f"{self.prefix}:files:{owner}:bytes"

    def batches(self, owner: str) -> str:
        return f"{self.prefix}:batches:{owner}"

    @property
    def active(self) -> str:
        return f"{self.prefix}:batches:active"


def batch_event(batch_id: str, status: str, obj: dict[str, Any], owner: str) -> bytes:
    """The webhook event of a batch's end: batch.completed, .failed, .cancelled, .expired,
    for its owner's endpoints and the namespace's."""
    kind = f"batch.{status}"
    event = HookEvent(batch_id, 0, kind, obj, time.time(), owner=owner)
    return pack(event.payload())


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def owner_of(h: dict[bytes, bytes]) -> str:
    """Whose a file or batch is (made before there were owners: everyone's, as then)."""
    return h.get(b"owner", ANONYMOUS.encode()).decode()


def file_object(file_id: str, meta: dict[bytes, bytes]) -> dict[str, Any]:
    """OpenAI's File object from its hash."""
    expires = int(meta.get(b"expires_at", 0))
    return {
        "id": file_id,
        "object": "file",
        "bytes": int(meta[b"bytes"]),
        "created_at": int(meta[b"created_at"]),
        "expires_at": expires or None,
        "filename": meta[b"filename"].decode(),
        "purpose": meta[b"purpose"].decode(),
        "status": "processed",
        "status_details": None,
    }


def batch_object(batch_id: str, h: dict[bytes, bytes]) -> dict[str, Any]:
    """OpenAI's Batch object from its hash. The output and error files are named once
    the batch has ended (as OpenAI's), and only if they hold anything."""
    status = h[b"status"].decode()
    ended = status in FINAL
    out: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "endpoint": h[b"endpoint"].decode(),
        "errors": json.loads(h[b"errors"]) if b"errors" in h else None,
        "input_file_id": h[b"input_file_id"].decode(),
        "completion_window": h[b"completion_window"].decode(),
        "status": status,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": int(h[b"created_at"]),
        "request_counts": {
            "total": int(h.get(b"total", 0)),
            "completed": int(h.get(b"completed", 0)),
            "failed": int(h.get(b"failed", 0)),
        },
        "metadata": json.loads(h[b"metadata"]) if b"metadata" in h else None,
    }
    for name in TIMESTAMPS:
        out[name] = int(h[name.encode()]) if name.encode() in h else None
    if ended:
        for name, count in (("output_file_id", "completed"), ("error_file_id", "failed")):
            if int(h.get(count.encode(), 0)) and name.encode() in h:
                out[name] = h[name.encode()].decode()
    return out


def _error(exc: BadRequest) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _expiry(form: Any, now: int) -> int:
    """When an upload expires: OpenAI's `expires_after[anchor]` (created_at) and
    `expires_after[seconds]`, else the default."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return now + DEFAULT_EXPIRY_S
    if anchor != "created_at":
        raise BadRequest("expires_after[anchor] must be 'created_at'", "expires_after")
    if not isinstance(seconds, str) or not seconds.isdigit():
        raise BadRequest("expires_after[seconds] must be a number of seconds", "expires_after")
    if not MIN_EXPIRY_S <= int(seconds) <= DEFAULT_EXPIRY_S:
        bounds = f"[{MIN_EXPIRY_S}, {DEFAULT_EXPIRY_S}]"
        raise BadRequest(f"expires_after[seconds] must be in {bounds}", "expires_after")
    return now + int(seconds)


def _over_quota(quota: int, used: int | None) -> BadRequest:
    held = "" if used is None else f" ({used} held now)"
    message = f"the file does not fit this key's storage quota of {quota} bytes{held}"
    return BadRequest(message, "file", 413, code="storage_quota_exceeded")


def _not_found(what: str, ident: str) -> JSONResponse:
    body = error_body(f"no {what} with id {ident!r}", "invalid_request_error", "id")
    return JSONResponse(body, status_code=404)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


async def store_meta(
    reserve: Any,
    keys: BatchKeys,
    owner: str,
    file_id: str,
    size: int,
    quota: int,
    now: int,
    expires: int,
    meta: dict[str, str],
) -> tuple[bool, int]:
    """List a new file as its owner's and write its metadata, if it fits the owner's quota
    (FILE_RESERVE); (whether it did, the bytes the owner held before)."""
    fields = {
        "bytes": size, "created_at": now, "expires_at": expires, "owner": owner, **meta
    }  # fmt: skip
    flat = [x for pair in fields.items() for x in pair]
    stored, used = await reserve(
        keys=[keys.files(owner), keys.sizes(owner), keys.file(file_id)],
        args=[keys.file(""), file_id, size, quota, now, expires, *flat],
    )
    return bool(stored), int(used)


def owner_rules(principal: Principal) -> Callable[[dict[str, Any]], None]:
    """A batch line's job as its owner may queue it: the owner's tenant, and a priority
    inside the batch lane and the key's range."""
    policy = principal.policy

    def adjust(kwargs: dict[str, Any]) -> None:
        apply_principal(kwargs, principal)
        priority = max(kwargs["priority"], policy.min_priority, 1)
        kwargs["priority"] = min(priority, policy.max_priority)

    return adjust


class RedisSink:
    """`BatchRun`'s answers into the batch's output and error files, each with its count,
    in one transaction: a gateway that dies between the two cannot leave them apart."""

    def __init__(self, conn: redis.Redis, keys: BatchKeys, batch_id: str, h: dict) -> None:
        self.conn = conn
        self.batch_key = keys.batch(batch_id)
        self.output = keys.data(h[b"output_file_id"].decode())
        self.errors = keys.data(h[b"error_file_id"].decode())

    def write(self, record: dict[str, Any], error: bool) -> None:
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.append(self.errors if error else self.output, encode_record(record))
            pipe.hincrby(self.batch_key, "failed" if error else "completed", 1)
            pipe.execute()


def input_lines(content: bytes) -> Iterator[tuple[int, bytes]]:
    for number, raw in enumerate(content.splitlines(), 1):
        if raw.strip():
            yield number, raw


def validate(content: bytes, endpoint: str) -> tuple[int, list[dict[str, Any]]]:
    """(the number of requests, the errors by line): OpenAI's checks before a batch runs."""
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    total = 0
    for number, raw in input_lines(content):
        total += 1
        try:
            item = parse_line(raw, number)
            if ENDPOINTS[endpoint] != item.kind:
                message = f"line {number}: url must be the batch's endpoint {endpoint}"
                raise LineError("mismatched_url", message, item.custom_id)
            if item.custom_id in seen:
                first = seen[item.custom_id]
                message = f"line {number}: custom_id {item.custom_id!r} repeats line {first}'s"
                raise LineError("duplicate_custom_id", message, item.custom_id)
            seen[item.custom_id] = number
        except LineError as exc:
            if len(errors) < MAX_ERRORS:
                errors.append(
                    {"code": exc.code, "message": exc.message, "param": None, "line": number}
                )
    if total == 0:
        errors.append({"code": "empty_file", "message": "the file holds no request", "line": None})
    return total, errors


class BatchRunner:
    """The gateway's batch runner: one task that finds batches to run, one task per batch
    it holds the lock of (at most `max_running`), each running the batch's jobs on a thread
    (`BatchRun` is synchronous) while watching for cancel, expiry and the lock."""

    def __init__(self, app: FastAPI, config: BatchConfig) -> None:
        gateway = app.state.config
        self.app = app
        self.config = config
        self.url = gateway.redis_url
        self.namespace = gateway.namespace
        cluster = app.state.client.cluster
        self.keys = BatchKeys(gateway.namespace, sharded=cluster is not None)
        # redis.asyncio; on a cluster, a connection to the one slot of the keys above
        self.redis = app.state.redis if cluster is None else cluster.bound(self.keys.prefix)
        self.token = secrets.token_hex(8)
        self.running: dict[str, asyncio.Task[None]] = {}
        self.wake = asyncio.Event()
        self.ring: KeyRing = app.state.keys
        self.reserve = self.redis.register_script(source("file_reserve"))
        self.transition = self.redis.register_script(source("batch_transition"))
        self.renew = self.redis.register_script(source("lock_renew"))
        self.release = self.redis.register_script(source("lock_release"))

    async def loop(self) -> None:
        while True:
            try:
                await self._scan()
            except redis.RedisError:
                pass  # Redis away: try again on the next round
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.poll_s):
                    await self.wake.wait()
            self.wake.clear()

    async def _scan(self) -> None:
        for raw in await self.redis.smembers(self.keys.active):
            batch_id = raw.decode()
            if batch_id in self.running or len(self.running) >= self.config.max_running:
                continue
            ttl = int(self.config.lock_ttl_s * 1000)
            if await self.redis.set(self.keys.lock(batch_id), self.token, nx=True, px=ttl):
                task = asyncio.create_task(self._own(batch_id))
                self.running[batch_id] = task

    async def _own(self, batch_id: str) -> None:
        try:
            await self._drive(batch_id)
        except redis.RedisError:
            pass  # Redis away: the next scan tries again
        except BatchError as exc:  # its output is not this batch's: it cannot go on
            error = {"code": "corrupt_output", "message": str(exc), "line": None}
            errors = json.dumps({"object": "list", "data": [error]})
            await self.redis.hset(self.keys.batch(batch_id), "errors", errors)
            await self.move(batch_id, FAILED, "failed_at", IN_PROGRESS, CANCELLING)
            await self.redis.srem(self.keys.active, batch_id)
        finally:
            self.running.pop(batch_id, None)
            with contextlib.suppress(redis.RedisError):
                await self.release(keys=[self.keys.lock(batch_id)], args=[self.token])

    async def move(self, batch_id: str, to: str, stamp: str, *sources: str) -> bool:
        """Move the batch if it is in one of `sources`; an end writes its webhook event
        (the batch object as it then is) in the same call."""
        now = int(time.time())
        event = b""
        if to in FINAL:
            h = await self.redis.hgetall(self.keys.batch(batch_id))
            if h:
                after = {**h, b"status": to.encode(), stamp.encode(): str(now).encode()}
                event = batch_event(batch_id, to, batch_object(batch_id, after), owner_of(h))
        hooks = Keys(self.namespace)
        keys = [self.keys.batch(batch_id), hooks.batch_hooks, hooks.webhook_endpoints]
        if self.app.state.client.cluster is not None:  # the endpoints lie in another slot
            if event and not await self.app.state.redis.exists(hooks.webhook_endpoints):
                event = b""
            keys.pop()
        return bool(await self.transition(keys=keys, args=[to, stamp, now, event, *sources]))

    async def _drive(self, batch_id: str) -> None:
        key = self.keys.batch(batch_id)
        h = await self.redis.hgetall(key)
        if not h:
            await self.redis.srem(self.keys.active, batch_id)
            return
        status = h[b"status"].decode()
        if status == VALIDATING:
            await self._validate(batch_id, h)
            h = await self.redis.hgetall(key)
            status = h[b"status"].decode()
        if status == IN_PROGRESS:
            status = await self._run(batch_id, h)
        elif status == CANCELLING:  # cancelled before it ran, or its runner died cancelling
            await self._cancel_all(batch_id, h)
            await self._seal(batch_id)
            await self.move(batch_id, CANCELLED, "cancelled_at", CANCELLING)
        if status == FINALIZING:
            await self._seal(batch_id)
            await self.move(batch_id, COMPLETED, "completed_at", FINALIZING)
        h = await self.redis.hgetall(key)
        if h and h[b"status"].decode() in FINAL:
            await self.redis.srem(self.keys.active, batch_id)

    async def _validate(self, batch_id: str, h: dict[bytes, bytes]) -> None:
        content = await self.redis.get(self.keys.data(h[b"input_file_id"].decode())) or b""
        total, errors = await asyncio.to_thread(validate, content, h[b"endpoint"].decode())
        key = self.keys.batch(batch_id)
        if errors:
            await self.redis.hset(
                key, mapping={"errors": json.dumps({"object": "list", "data": errors})}
            )
            await self.move(batch_id, FAILED, "failed_at", VALIDATING)
            return
        now = int(time.time())
        owner = owner_of(h)
        source_file = self.keys.file(h[b"input_file_id"].decode())
        expires = int(await self.redis.hget(source_file, "expires_at") or 0)
        expires = expires or now + DEFAULT_EXPIRY_S
        output, error = new_id("file"), new_id("file")
        for file_id, name in ((output, "output"), (error, "errors")):
            meta = {"filename": f"{batch_id}_{name}.jsonl", "purpose": "batch_output"}
            await store_meta(self.reserve, self.keys, owner, file_id, 0, 0, now, expires, meta)
            # APPEND keeps this TTL: the answers expire with their file.
            await self.redis.set(self.keys.data(file_id), b"", exat=expires)
        mapping = {"total": total, "output_file_id": output, "error_file_id": error}
        await self.redis.hset(key, mapping=mapping)
        await self.move(batch_id, IN_PROGRESS, "in_progress_at", VALIDATING)

    async def _run(self, batch_id: str, h: dict[bytes, bytes]) -> str:
        """Run the batch's lines; the status it leaves the batch in."""
        content = await self.redis.get(self.keys.data(h[b"input_file_id"].decode())) or b""
        client = Client(self.url, namespace=self.namespace, require_worker=False)
        if client.cluster is None:
            conn = metered = redis.Redis.from_url(self.url)
        else:  # the batch's keys' slot, and every slot for its key's limits
            conn, metered = client.cluster.bound(self.keys.prefix), client.redis
        owner = owner_of(h)
        tenant = h[b"tenant"].decode() if b"tenant" in h else None
        principal = Principal(owner, tenant, self.ring.policy_of(owner))
        meter = SyncMeter(metered, self.namespace, principal, client.layout)
        run = BatchRun(
            client,
            RedisSink(conn, self.keys, batch_id, h),
            batch_id,
            max_outstanding=self.config.max_outstanding,
            queue_anyway=True,  # a batch waits for its workers
            adjust=owner_rules(principal),
            meter=meter if meter.active else None,
        )
        try:
            done = await asyncio.to_thread(self._done, conn, batch_id, h)
            work = asyncio.create_task(asyncio.to_thread(run.run, input_lines(content), done))
            outcome = await self._watch(batch_id, h, run, work)
        finally:  # also when the gateway stops: its jobs go on, the next runner follows
            run.stop()
            run.close()
            await asyncio.to_thread(client.close)
            conn.close()
        if outcome == CANCELLING:
            await self._seal(batch_id)
            await self.move(batch_id, CANCELLED, "cancelled_at", CANCELLING)
            return CANCELLED
        if outcome == EXPIRED:
            await self._seal(batch_id)
            await self.move(batch_id, EXPIRED, "expired_at", IN_PROGRESS, CANCELLING)
            return EXPIRED
        if outcome == IN_PROGRESS:
            await self.move(batch_id, FINALIZING, "finalizing_at", IN_PROGRESS)
            return FINALIZING
        return outcome  # lost the lock: another runner has it

    def _done(self, conn: redis.Redis, batch_id: str, h: dict[bytes, bytes]) -> Any:
        sources = []
        for name in (b"output_file_id", b"error_file_id"):
            data = conn.get(self.keys.data(h[name].decode())) or b""
            sources.append((h[name].decode(), data.splitlines()))
        return done_from(sources, batch_id)

    async def _watch(
        self, batch_id: str, h: dict[bytes, bytes], run: BatchRun, work: asyncio.Task[Any]
    ) -> str:
        """Renew the lock and look at the batch every poll while it runs: a cancel or the
        end of its window stops it (cancelling the running jobs), a lost lock too (leaving
        them to the runner that took it)."""
        key, lock = self.keys.batch(batch_id), self.keys.lock(batch_id)
        outcome = IN_PROGRESS
        ttl = int(self.config.lock_ttl_s * 1000)
        while not work.done():
            await asyncio.wait([work], timeout=self.config.poll_s)
            if not await self.renew(keys=[lock], args=[self.token, ttl]):
                run.stop()
                outcome = "lost"
            elif outcome == IN_PROGRESS:
                status, expires_at = await self.redis.hmget(key, "status", "expires_at")
                if status == CANCELLING.encode():
                    run.stop(cancel=True)
                    outcome = CANCELLING
                elif time.time() > int(expires_at):
                    run.stop(cancel=True)
                    outcome = EXPIRED
        await work  # a failure of the run itself: raised, the lock released, tried again
        return outcome

    async def _cancel_all(self, batch_id: str, h: dict[bytes, bytes]) -> None:
        """Cancel every job the batch may have queued (its runner died while cancelling)."""
        content = await self.redis.get(self.keys.data(h[b"input_file_id"].decode())) or b""
        client = self.app.state.client  # its keys_of: on a cluster, each job's shard
        async with self.app.state.redis.pipeline(transaction=False) as pipe:
            for number, raw in input_lines(content):
                with contextlib.suppress(LineError):
                    job_id = job_id_for(batch_id, parse_line(raw, number).custom_id)
                    pipe.set(client.keys_of(job_id).cancel(job_id), b"1", ex=24 * 3600)
            await pipe.execute()

    async def _seal(self, batch_id: str) -> None:
        """Give the output and error files their final sizes, before the batch ends."""
        h = await self.redis.hgetall(self.keys.batch(batch_id))
        for name in (b"output_file_id", b"error_file_id"):
            if name in h:
                file_id = h[name].decode()
                size = await self.redis.strlen(self.keys.data(file_id))
                if await self.redis.exists(self.keys.file(file_id)):
                    await self.redis.hset(self.keys.file(file_id), "bytes", size)
                    await self.redis.hset(self.keys.sizes(owner_of(h)), file_id, size)


def batch_router(config: BatchConfig | None = None) -> APIRouter:
    """The Files and Batches routes, and the batch runner (started with the app)."""
    config = config or BatchConfig()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner = BatchRunner(app, config)
        app.state.batch_runner = runner
        task = asyncio.create_task(runner.loop())
        try:
            yield
        finally:
            task.cancel()
            for job in [task, *runner.running.values()]:
                job.cancel()
            await asyncio.gather(task, *runner.running.values(), return_exceptions=True)

    router = APIRouter(lifespan=lifespan)

    def keys_of(request: Request) -> BatchKeys:
        return request.app.state.batch_runner.keys

    def principal_of(request: Request) -> Principal:
        return request.state.principal

    async def own(request: Request, key: str) -> dict[bytes, bytes]:
        """A file's or batch's hash if it is the caller's; {} as for none."""
        h = await request.app.state.batch_runner.redis.hgetall(key)
        return h if h and owner_of(h) == principal_of(request).id else {}

    @router.post("/v1/files")
    async def create_file(request: Request) -> Response:
        quota = principal_of(request).policy.storage_bytes
        size = int(request.headers.get("content-length") or 0)
        if size > config.max_file_bytes + (1 << 20):
            bound = config.max_file_bytes
            return _error(BadRequest(f"the file is over {bound} bytes", "file", 413))
        if quota and size > quota + (1 << 20):
            return _error(_over_quota(quota, None))
        form = await request.form(max_part_size=config.max_file_bytes)
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            return _error(BadRequest("purpose must be 'batch'", "purpose"))
        if upload is None or isinstance(upload, str):
            return _error(BadRequest("a file is required (multipart field 'file')", "file"))
        now = int(time.time())
        try:
            expires = _expiry(form, now)
        except BadRequest as exc:
            return _error(exc)
        content = await upload.read()
        if len(content) > config.max_file_bytes:
            bound = config.max_file_bytes
            return _error(BadRequest(f"the file is over {bound} bytes", "file", 413))
        keys = keys_of(request)
        file_id = new_id("file")
        meta = {"filename": upload.filename or file_id, "purpose": "batch"}
        owner = principal_of(request).id
        reserve = request.app.state.batch_runner.reserve
        stored, used = await store_meta(
            reserve, keys, owner, file_id, len(content), quota, now, expires, meta
        )
        if not stored:
            return _error(_over_quota(quota, used))
        conn = request.app.state.batch_runner.redis
        await conn.set(keys.data(file_id), content, exat=expires)
        return JSONResponse(file_object(file_id, await conn.hgetall(keys.file(file_id))))

    @router.get("/v1/files")
    async def list_files(
        request: Request,
        purpose: str | None = None,
        limit: int = 10_000,
        order: str = "desc",
        after: str | None = None,
    ) -> Response:
        if not 1 <= limit <= 10_000:
            return _error(BadRequest("limit must be in [1, 10000]", "limit"))
        if order not in ("asc", "desc"):
            return _error(BadRequest("order must be 'asc' or 'desc'", "order"))
        keys = keys_of(request)
        conn = request.app.state.batch_runner.redis
        owned = keys.files(principal_of(request).id)
        ids = [
            i.decode()
            for i in await (conn.zrevrange if order == "desc" else conn.zrange)(owned, 0, -1)
        ]
        if after is not None:
            if after not in ids:
                return _not_found("file", after)
            ids = ids[ids.index(after) + 1 :]
        async with conn.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hgetall(keys.file(file_id))
            metas = await pipe.execute()
        files = [
            file_object(file_id, meta)
            for file_id, meta in zip(ids, metas, strict=True)
            if meta and (purpose is None or meta[b"purpose"].decode() == purpose)
        ]
        page = files[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(files) > limit,
            }
        )

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str) -> Response:
        meta = await own(request, keys_of(request).file(file_id))
        return JSONResponse(file_object(file_id, meta)) if meta else _not_found("file", file_id)

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        keys = keys_of(request)
        if not await own(request, keys.file(file_id)):
            return _not_found("file", file_id)
        content = await request.app.state.batch_runner.redis.get(keys.data(file_id)) or b""
        return Response(content, media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> Response:
        keys = keys_of(request)
        owner = principal_of(request).id
        if not await own(request, keys.file(file_id)):
            return _not_found("file", file_id)
        async with request.app.state.batch_runner.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.file(file_id), keys.data(file_id))
            pipe.zrem(keys.files(owner), file_id)
            pipe.hdel(keys.sizes(owner), file_id)
            await pipe.execute()
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        try:
            body = await request.json()  # bounded by the gateway's Guard
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return _error(BadRequest("the request body must be JSON"))
        if not isinstance(body, dict):
            return _error(BadRequest("the request body must be a JSON object"))
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        file_id, metadata = body.get("input_file_id"), body.get("metadata")
        if endpoint not in ENDPOINTS:
            names = ", ".join(ENDPOINTS)
            return _error(BadRequest(f"endpoint must be one of {names}", "endpoint"))
        if window not in WINDOWS:
            return _error(BadRequest("completion_window must be '24h'", "completion_window"))
        if metadata is not None and not isinstance(metadata, dict):
            return _error(BadRequest("metadata must be an object", "metadata"))
        principal = principal_of(request)
        try:
            principal.policy.check_priority(1)  # a batch's jobs run in the batch lane
        except BadRequest as exc:
            return _error(exc)
        keys = keys_of(request)
        conn = request.app.state.batch_runner.redis
        meta = await own(request, keys.file(file_id)) if isinstance(file_id, str) else {}
        if not meta:
            return _not_found("file", str(file_id))
        if meta.get(b"purpose") != b"batch":
            return _error(BadRequest("the input file's purpose must be 'batch'", "input_file_id"))
        batch_id = new_id("batch")
        now = int(time.time())
        fields = {
            "status": VALIDATING,
            "endpoint": endpoint,
            "input_file_id": file_id,
            "completion_window": window,
            "created_at": now,
            "expires_at": now + WINDOWS[window],
            "owner": principal.id,
        }
        if principal.tenant is not None:
            fields["tenant"] = principal.tenant
        if metadata is not None:
            fields["metadata"] = json.dumps(metadata)
        async with conn.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(batch_id), mapping=fields)
            pipe.zadd(keys.batches(principal.id), {batch_id: time.time()})  # finer than created_at
            pipe.sadd(keys.active, batch_id)
            await pipe.execute()
        request.app.state.batch_runner.wake.set()
        return JSONResponse(batch_object(batch_id, await conn.hgetall(keys.batch(batch_id))))

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str) -> Response:
        h = await own(request, keys_of(request).batch(batch_id))
        return JSONResponse(batch_object(batch_id, h)) if h else _not_found("batch", batch_id)

    @router.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> Response:
        if not 1 <= limit <= 100:
            return _error(BadRequest("limit must be in [1, 100]", "limit"))
        keys = keys_of(request)
        conn = request.app.state.batch_runner.redis
        owned = keys.batches(principal_of(request).id)
        start = 0
        if after is not None:
            rank = await conn.zrevrank(owned, after)
            if rank is None:
                return _not_found("batch", after)
            start = rank + 1
        ids = [i.decode() for i in await conn.zrevrange(owned, start, start + limit)]
        more = len(ids) > limit
        ids = ids[:limit]
        data = []
        for batch_id in ids:
            h = await conn.hgetall(keys.batch(batch_id))
            if h:
                data.append(batch_object(batch_id, h))
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": ids[0] if ids else None,
                "last_id": ids[-1] if ids else None,
                "has_more": more,
            }
        )

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        keys = keys_of(request)
        conn = request.app.state.batch_runner.redis
        runner: BatchRunner = request.app.state.batch_runner
        if not await own(request, keys.batch(batch_id)):
            return _not_found("batch", batch_id)
        if not await runner.move(batch_id, CANCELLING, "cancelling_at", VALIDATING, IN_PROGRESS):
            status = (await conn.hget(keys.batch(batch_id), "status") or b"").decode()
            if status not in (CANCELLING, CANCELLED):
                message = f"a batch that is {status} cannot be cancelled"
                return _error(BadRequest(message, None, 409))
        await conn.sadd(keys.active, batch_id)
        runner.wake.set()
        return JSONResponse(batch_object(batch_id, await conn.hgetall(keys.batch(batch_id))))

    return router
