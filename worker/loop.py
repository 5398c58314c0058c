"""The worker: one loop that moves jobs between Redis and the engine.

Every Redis call is in this file, where it happens: read jobs (as many as the engine can
admit), run one engine step, publish the step's tokens in one transaction, acknowledge
what finished. Delivery is at-least-once; see docs/protocol.md for how duplicates, crashes,
cancellation and poison jobs are handled.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
import structlog

from engine.errors import InvalidRequest
from producer.protocol import (
    DoneEvent,
    ErrorEvent,
    Event,
    JobRequest,
    Keys,
    Timings,
    Usage,
    encode_event,
    pack,
)
from worker.config import WorkerConfig
from worker.intake import (
    Rejection,
    check_model,
    engine_params,
    enqueue_time,
    lost_payload,
    parse_entry,
    to_monotonic,
)
from worker.metrics import WorkerMetrics
from worker.resume import Continuation, Logprobs, ReplyHistory

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput

STATUS_RUNNING, STATUS_DONE, STATUS_ERROR = b"running", b"done", b"error"
Entry = tuple[bytes, dict[bytes, bytes]]


@dataclass
class InFlight:
    job: JobRequest
    entry_id: bytes
    deliveries: int
    continuation: Continuation
    streaming: bool = False  # its first events are written (reply TTL and status set)


@dataclass
class Delivery:
    """One job stream entry as this worker received it."""

    entry_id: bytes
    fields: dict[bytes, bytes] | None
    count: int  # times delivered, this one included


@dataclass
class Settlement:
    """The end of one job stream entry, written with its XACK in one transaction."""

    entry_id: bytes
    job_id: str | None = None
    event: Event | None = None  # the client's final event
    status: bytes | None = None  # the job key's final value
    release_owner: bool = False
    dead: dict[str, Any] | None = None  # the dead-letter entry


def _id_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


def _wire_logprobs(logprobs: list[dict[int, float]] | None) -> Logprobs | None:
    if logprobs is None:
        return None
    return [sorted(top.items(), key=lambda kv: -kv[1]) for top in logprobs]


class Worker:
    """Drives one engine from one job stream.

    One thread calls `run()` (or `run_once()` in tests); `stop()` may be called from any
    thread or a signal handler.
    """

    def __init__(
        self, engine: LLMEngine, conn: redis.Redis, config: WorkerConfig | None = None
    ) -> None:
        self.engine = engine
        self.redis = conn
        self.config = config or WorkerConfig()
        self.keys = Keys(self.config.namespace)
        self.metrics = WorkerMetrics()
        # The value this process writes into the owner key of each job it runs: a worker
        # that finds another value there has lost the job and must stop writing to it.
        self.token = f"{self.config.consumer}:{uuid.uuid4().hex[:12]}".encode()
        self.in_flight: dict[str, InFlight] = {}
        self._replay_from: bytes | None = b"0-0"  # own pending entries first, then ">"
        self._claim_cursor: bytes = b"0-0"
        self._next_claim = self._next_heartbeat = self._next_metrics = 0.0
        self._stop_at: float | None = None
        self._step_failures = 0
        self.log = structlog.get_logger("tokenq.worker")

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self, grace: float | None = None) -> None:
        """Stop taking jobs; give in-flight ones `grace` seconds. Safe in a signal handler;
        a second call can only shorten the grace."""
        at = time.monotonic() + (self.config.grace_period_s if grace is None else grace)
        self._stop_at = at if self._stop_at is None else min(self._stop_at, at)

    @property
    def stopping(self) -> bool:
        return self._stop_at is not None

    def ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.keys.jobs, self.config.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def run(self) -> None:
        """Serve until `stop()`, then drain and hand back what did not finish."""
        structlog.contextvars.bind_contextvars(consumer=self.config.consumer)
        self.ensure_group()
        self.log.info("worker started", stream=self.keys.jobs, group=self.config.group)
        backoff = 0.5
        try:
            while not self._drained():
                try:
                    self.run_once()
                    backoff = 0.5
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    # Whatever this worker had in flight stays pending in Redis; it replays
                    # its own pending entries once Redis is back, and resume.py makes the
                    # re-runs continue their reply streams without duplicates.
                    self.log.warning("redis unavailable", error=str(exc), retry_in=backoff)
                    self._forget_in_flight()
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
        finally:
            self._hand_back()
            try:
                self._publish_metrics()
            except redis.RedisError:
                pass
            self.log.info("worker stopped")

    def _drained(self) -> bool:
        return self._stop_at is not None and (
            not self.in_flight or time.monotonic() >= self._stop_at
        )

    def run_once(self) -> None:
        """One iteration: admit, keep claims alive, one engine step, publish."""
        now = time.monotonic()
        if not self.stopping:
            self._admit()
            if now >= self._next_claim:
                self._next_claim = now + self.config.claim_interval_s
                self._reclaim()
        if self.in_flight and now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            self._heartbeat()
        if self.engine.has_unfinished():
            self._step()
        elif self.stopping or self.engine.free_capacity() == 0:
            time.sleep(self.config.block_ms / 1000)
        if now >= self._next_metrics:
            self._next_metrics = now + self.config.metrics_interval_s
            self._publish_metrics()

    # -- intake ----------------------------------------------------------------------------

    def _admit(self) -> None:
        """Pull only what the engine admits now: the rest of the backlog stays in the
        stream for other workers."""
        capacity = self.engine.free_capacity()
        if capacity <= 0:
            return
        c = self.config
        if self._replay_from is not None:
            resp = self.redis.xreadgroup(
                c.group, c.consumer, {self.keys.jobs: self._replay_from}, count=capacity
            )
            entries = resp[0][1] if resp else []
            if not entries:
                self._replay_from = None
                return
            self._replay_from = entries[-1][0]
            self._take(entries, redelivered=True)
            return
        block = None if self.engine.has_unfinished() else c.block_ms
        started = time.monotonic()
        resp = self.redis.xreadgroup(
            c.group, c.consumer, {self.keys.jobs: ">"}, count=capacity, block=block
        )
        entries = resp[0][1] if resp else []
        if entries:
            self._take(entries, redelivered=False)
        elif block is not None:
            # fakeredis (the demo) answers BLOCK with COUNT at once: never spin when idle.
            time.sleep(max(0.0, block / 1000 - (time.monotonic() - started)))

    def _reclaim(self) -> None:
        """Take over jobs of workers that stopped heartbeating."""
        capacity = self.engine.free_capacity()
        if capacity <= 0:
            return
        c = self.config
        resp = self.redis.xautoclaim(
            self.keys.jobs,
            c.group,
            c.consumer,
            c.claim_idle_ms,
            start_id=self._claim_cursor,
            count=capacity,
        )
        self._claim_cursor = resp[0]
        entries = resp[1]
        deleted = resp[2] if len(resp) > 2 else []
        if deleted:
            # Redis >= 7 drops trimmed entries from the PEL itself and only reports them.
            self._settle([self._reject(Delivery(eid, None, 0), lost_payload()) for eid in deleted])
        if entries:
            self.log.info("reclaimed jobs", count=len(entries))
            self._take(entries, redelivered=True)

    def _delivery_counts(self, entry_ids: list[bytes]) -> dict[bytes, int]:
        lo, hi = min(entry_ids, key=_id_key), max(entry_ids, key=_id_key)
        rows = self.redis.xpending_range(
            self.keys.jobs,
            self.config.group,
            min=lo,
            max=hi,
            count=len(entry_ids) + len(self.in_flight) + 16,
            consumername=self.config.consumer,
        )
        return {row["message_id"]: row["times_delivered"] for row in rows}

    def _take(self, entries: list[Entry], redelivered: bool) -> None:
        running = {inf.entry_id for inf in self.in_flight.values()}
        entries = [(eid, fields) for eid, fields in entries if eid not in running]
        if not entries:
            return
        counts = self._delivery_counts([eid for eid, _ in entries]) if redelivered else {}
        settle: list[Settlement] = []
        candidates: list[tuple[Delivery, JobRequest]] = []
        for eid, fields in entries:
            delivery = Delivery(eid, fields, counts.get(eid, 1))
            parsed = parse_entry(fields, delivery.count, self.config.max_deliveries)
            if isinstance(parsed, JobRequest):
                if parsed.job_id in self.in_flight or any(
                    parsed.job_id == job.job_id for _, job in candidates
                ):
                    settle.append(Settlement(eid))  # a second entry for a job running here
                    continue
                parsed = check_model(parsed, self.config.model_names) or parsed
            if isinstance(parsed, Rejection):
                settle.append(self._reject(delivery, parsed))
            else:
                candidates.append((delivery, parsed))
        if candidates:
            settle += self._start(candidates)
        if settle:
            self._settle(settle)

    def _start(self, candidates: list[tuple[Delivery, JobRequest]]) -> list[Settlement]:
        """Claim ownership, read what the reply stream already holds, start the rest.

        The owner key is set before the reply stream is read, in one transaction: a worker
        that ran the job before either wrote before this read (and we see its tokens) or
        finds our token in the owner key and writes nothing more.
        """
        k = self.keys
        with self.redis.pipeline(transaction=True) as pipe:
            for _, job in candidates:
                jid = job.job_id
                pipe.get(k.job(jid))
                pipe.exists(k.cancel(jid))
                pipe.set(k.owner(jid), self.token, ex=self.config.running_reply_ttl_s)
                pipe.xrange(k.reply(jid))
            results = pipe.execute()
        settle: list[Settlement] = []
        for i, (delivery, job) in enumerate(candidates):
            status, cancelled, _, reply = results[4 * i : 4 * i + 4]
            history = ReplyHistory.from_entries(reply)
            eid, jid = delivery.entry_id, job.job_id
            assert jid is not None
            if status in (STATUS_DONE, STATUS_ERROR) or history.terminal is not None:
                self._job_log(jid).info(
                    "duplicate delivery of a finished job", entry_id=eid.decode()
                )
                settle.append(Settlement(eid, jid, release_owner=True))
                continue
            if cancelled:
                settle.append(self._cancelled_before_start(eid, job, history))
                continue
            if job.deadline is not None and job.deadline <= time.time():
                late = Rejection(
                    "deadline_exceeded",
                    "the job's deadline passed before a worker could start it",
                    jid,
                    dead_letter=False,
                    metadata=job.metadata,
                )
                settle.append(self._reject(delivery, late, release_owner=True))
                continue
            rejection = self._add_to_engine(eid, job)
            if rejection is not None:
                settle.append(self._reject(delivery, rejection, release_owner=True))
                continue
            with_logprobs = job.params.get("logprobs") is not None
            self.in_flight[jid] = InFlight(
                job, eid, delivery.count, Continuation(history, with_logprobs)
            )
            self._job_log(jid).info(
                "job started",
                entry_id=eid.decode(),
                deliveries=delivery.count,
                resumed_tokens=len(history.token_ids),
            )
        return settle

    def _add_to_engine(self, entry_id: bytes, job: JobRequest) -> Rejection | None:
        jid = job.job_id
        assert jid is not None
        try:
            with structlog.contextvars.bound_contextvars(job_id=jid):
                self.engine.add_request(
                    jid,
                    job.prompt,
                    prompt_token_ids=job.prompt_token_ids,
                    messages=job.messages,
                    params=engine_params(job),
                    priority=job.priority,
                    arrival_time=to_monotonic(enqueue_time(entry_id)),
                    deadline=None if job.deadline is None else to_monotonic(job.deadline),
                )
        except InvalidRequest as exc:
            return Rejection(exc.code, exc.message, jid, metadata=job.metadata)
        except Exception as exc:  # the engine must not take the worker down for one job
            self._job_log(jid).exception("engine refused the job unexpectedly")
            message = f"{type(exc).__name__}: {exc}"
            return Rejection("internal_error", message, jid, metadata=job.metadata)
        return None

    def _cancelled_before_start(
        self, entry_id: bytes, job: JobRequest, history: ReplyHistory
    ) -> Settlement:
        waited = max(0.0, time.time() - enqueue_time(entry_id))
        done = DoneEvent(
            text=history.text,
            finish_reason="cancelled",
            token_ids=history.token_ids,
            usage=Usage(0, len(history.token_ids)),
            timings=Timings(queue_time=waited, total=waited),
            metadata=job.metadata,
        )
        self.metrics.request_success_total["cancelled"] += 1
        self._job_log(job.job_id).info("job cancelled before it started")
        return Settlement(entry_id, job.job_id, done, STATUS_DONE, release_owner=True)

    def _reject(
        self, delivery: Delivery, rejection: Rejection, release_owner: bool = False
    ) -> Settlement:
        jid, eid = rejection.job_id, delivery.entry_id
        self.metrics.failed(rejection.code)
        self._job_log(jid).warning(
            "job rejected", code=rejection.code, message=rejection.message, entry_id=eid.decode()
        )
        dead = None
        if rejection.dead_letter:
            dead = {
                "entry_id": eid,
                "job_id": jid or "",
                "code": rejection.code,
                "message": rejection.message,
                "deliveries": delivery.count,
                "consumer": self.config.consumer,
                "failed_at": time.time(),
                "fields": pack(delivery.fields or {}),
            }
        event = None
        if jid is not None:
            event = ErrorEvent(rejection.code, rejection.message, rejection.metadata)
        return Settlement(eid, jid, event, STATUS_ERROR, release_owner, dead)

    def _settle(self, items: list[Settlement]) -> None:
        """Final events, dead letters, and the XACK that must come after them, atomically."""
        k, c = self.keys, self.config
        with self.redis.pipeline(transaction=True) as pipe:
            for s in items:
                if s.job_id is not None and s.event is not None:
                    reply = k.reply(s.job_id)
                    pipe.xadd(reply, encode_event(s.event))
                    pipe.expire(reply, c.reply_ttl_s)
                if s.job_id is not None and s.status is not None:
                    pipe.set(k.job(s.job_id), s.status, xx=True, keepttl=True)
                if s.job_id is not None and s.release_owner:
                    pipe.delete(k.owner(s.job_id))
                if s.dead is not None:
                    pipe.xadd(k.dead, s.dead, maxlen=c.dead_letter_maxlen, approximate=True)
                pipe.xack(k.jobs, c.group, s.entry_id)
                pipe.xdel(k.jobs, s.entry_id)
            pipe.execute()

    # -- the step --------------------------------------------------------------------------

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            self._step_failures += 1
            self.log.exception("engine step failed", consecutive=self._step_failures)
            # Leave every job pending for a retry (here or elsewhere); the delivery count
            # dead-letters a job that keeps failing.
            self.engine.fail_all()
            self._hand_back()
            if self._step_failures >= self.config.max_step_failures:
                raise
            return
        self._step_failures = 0
        if self.in_flight:
            self._publish(outputs)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Write the step's tokens of every job in one transaction, fenced by the owner
        keys, and check the cancel keys of every job in flight on the way."""
        events: dict[str, list[Event]] = defaultdict(list)
        finished: dict[str, RequestOutput] = {}
        for out in outputs:
            self._collect(out, events, finished)
        k = self.keys
        ids = list(self.in_flight)
        owner_keys = [k.owner(j) for j in ids]
        cancel_keys = [k.cancel(j) for j in ids]
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(*owner_keys)
                    values = pipe.mget(owner_keys + cancel_keys)
                    for jid, owner, cancel in zip(
                        ids, values[: len(ids)], values[len(ids) :], strict=True
                    ):
                        if jid not in self.in_flight:
                            continue
                        if owner != self.token:
                            self._lose(jid)
                            events.pop(jid, None)
                            finished.pop(jid, None)
                        elif cancel is not None and jid not in finished:
                            out = self.engine.abort(jid)
                            if out is not None:
                                self._collect(out, events, finished)
                    pipe.multi()
                    self._queue_events(pipe, events)
                    self._queue_finished(pipe, finished)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue  # an owner key changed under us: look again
        for jid, evs in events.items():
            if evs and jid in self.in_flight:
                self.in_flight[jid].streaming = True
        for jid, out in finished.items():
            self._account(self.in_flight.pop(jid), out)

    def _collect(
        self,
        out: RequestOutput,
        events: dict[str, list[Event]],
        finished: dict[str, RequestOutput],
    ) -> None:
        inf = self.in_flight.get(out.request_id)
        if inf is None:
            return
        events[out.request_id] += inf.continuation.feed(
            out.new_token_ids, out.new_text, _wire_logprobs(out.logprobs), out.finished
        )
        if out.finished:
            finished[out.request_id] = out
            m = out.metrics
            events[out.request_id].append(
                DoneEvent(
                    text=out.text if out.text is not None else inf.continuation.text,
                    finish_reason=out.finish_reason or "stop",
                    token_ids=inf.continuation.token_ids,
                    usage=Usage(out.prompt_tokens, out.completion_tokens),
                    timings=Timings(m.queue_time, m.ttft, m.e2e),
                    metadata=inf.job.metadata,
                )
            )

    def _queue_events(self, pipe: Any, events: dict[str, list[Event]]) -> None:
        for jid, evs in events.items():
            inf = self.in_flight.get(jid)
            if inf is None or not evs:
                continue
            reply = self.keys.reply(jid)
            for ev in evs:
                pipe.xadd(reply, encode_event(ev))
            if not inf.streaming:
                pipe.expire(reply, self.config.running_reply_ttl_s)
                pipe.set(self.keys.job(jid), STATUS_RUNNING, xx=True, keepttl=True)

    def _queue_finished(self, pipe: Any, finished: dict[str, RequestOutput]) -> None:
        k, c = self.keys, self.config
        for jid in finished:
            inf = self.in_flight[jid]
            pipe.expire(k.reply(jid), c.reply_ttl_s)
            pipe.set(k.job(jid), STATUS_DONE, xx=True, keepttl=True)
            pipe.delete(k.owner(jid), k.cancel(jid))
            pipe.xack(k.jobs, c.group, inf.entry_id)
            pipe.xdel(k.jobs, inf.entry_id)

    def _account(self, inf: InFlight, out: RequestOutput) -> None:
        self.metrics.finished(out, skipped_tokens=inf.continuation.skipped)
        m = out.metrics
        self._job_log(out.request_id).info(
            "job finished",
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            queue_time=m.queue_time,
            ttft=m.ttft,
            e2e=m.e2e,
            deliveries=inf.deliveries,
            entry_id=inf.entry_id.decode(),
        )

    def _lose(self, jid: str) -> None:
        """Another worker took this job over (we looked dead): stop without a trace."""
        self.engine.abort(jid)
        self.in_flight.pop(jid, None)
        self._job_log(jid).warning("job taken over by another worker; dropped here")

    # -- ownership -------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Reset the idle time of our entries (JUSTID: the delivery count stays) so that
        other workers' XAUTOCLAIM leaves long jobs alone."""
        ids = [inf.entry_id for inf in self.in_flight.values()]
        self.redis.xclaim(
            self.keys.jobs, self.config.group, self.config.consumer, 0, ids, justid=True
        )

    def _hand_back(self) -> None:
        """Stop what is in flight without acknowledging it and mark it idle, so the next
        XAUTOCLAIM of any worker takes it at once instead of after claim_idle_ms."""
        if not self.in_flight:
            return
        ids = [inf.entry_id for inf in self.in_flight.values()]
        self.log.info("handing back unfinished jobs", jobs=list(self.in_flight))
        self._forget_in_flight()
        try:
            self.redis.xclaim(
                self.keys.jobs,
                self.config.group,
                self.config.consumer,
                0,
                ids,
                idle=self.config.claim_idle_ms,
                justid=True,
            )
        except redis.RedisError as exc:
            self.log.warning("could not mark handed-back jobs idle", error=str(exc))

    def _forget_in_flight(self) -> None:
        for jid in self.in_flight:
            self.engine.abort(jid)
        self.in_flight.clear()
        self._replay_from = b"0-0"

    # -- observability ---------------------------------------------------------------------

    def _publish_metrics(self) -> None:
        stats = self.engine.stats()
        snapshot: dict[str, float] = {
            **self.metrics.snapshot(stats),
            "updated_at": round(time.time(), 3),
        }
        key = self.keys.metrics(self.config.consumer)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=snapshot)
            pipe.expire(key, max(60, int(3 * self.config.metrics_interval_s)))
            pipe.execute()
        self.log.info("metrics", **self.metrics.summary(stats))

    def _job_log(self, job_id: str | None) -> Any:
        return self.log.bind(job_id=job_id) if job_id else self.log
