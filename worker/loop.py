"""The worker: one loop that moves jobs between Redis and the engine.

Every Redis call is in this file, where it happens: take jobs (as many as the engine can
admit), run one engine step, publish the step's events and settle finished entries in one
script call, keep the entries it holds alive. Delivery is at-least-once; docs/protocol.md
says how duplicates, crashes, cancellation and poison jobs are handled.

Redis faults are ordinary here. A call that fails leaves the worker's state as it was: the
events it meant to publish stay in each job's outbox and go out with the next call (the
scripts in worker/scripts.py make a re-sent call harmless), in-flight jobs keep running in
the engine through a short outage, and after any failure the worker re-reads its own
pending entries (XPENDING + XRANGE, which count no delivery) to find an entry whose
delivery it never heard of.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
import structlog

from tokenq.engine.errors import InvalidRequest, StepFailed
from tokenq.producer.protocol import (
    DONE,
    ERROR,
    RUNNING,
    ErrorEvent,
    Event,
    JobRequest,
    Keys,
    clip,
    encode_event,
    pack,
    reply_seq,
)
from tokenq.worker.config import WorkerConfig
from tokenq.worker.intake import (
    Rejection,
    check_model,
    engine_params,
    enqueue_time,
    lost_payload,
    parse_entry,
    to_monotonic,
)
from tokenq.worker.metrics import WorkerMetrics
from tokenq.worker.replies import Continuation, ReplyHistory, cancelled_before_start
from tokenq.worker.scripts import Item, Scripts

if TYPE_CHECKING:
    from tokenq.engine.llm_engine import LLMEngine
    from tokenq.engine.outputs import RequestDelta

Entry = tuple[bytes, dict[bytes, bytes]]
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


@dataclass
class InFlight:
    """A job this worker owns, from its start until its final event is published."""

    job: JobRequest
    entry_id: bytes
    fields: dict[bytes, bytes]  # the entry as delivered: the dead letter if the job fails
    deliveries: int
    continuation: Continuation
    next_seq: int  # the reply stream sequence id of outbox[0]
    prompt: Future[list[int]] | None = None  # tokenizing off the loop thread
    in_engine: bool = False
    outbox: list[Event] = field(default_factory=list)  # events not yet published
    status: str = ""  # the job key's next value, sent with the outbox
    dead: dict[str, Any] | None = None  # a dead letter, sent with a final error
    output: RequestDelta | None = None  # the engine's final output, once finished


@dataclass
class Delivery:
    """One job stream entry as this worker received it."""

    entry_id: bytes
    fields: dict[bytes, bytes] | None
    count: int  # times delivered, this one included


def _id_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


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
        self.config = c = config or WorkerConfig()
        self.keys = Keys(c.namespace)
        self.scripts = Scripts(conn, self.keys, c.group, c.consumer)
        self.metrics = WorkerMetrics()
        # The value this process writes into the owner key of each job it runs: a worker
        # that finds another value there has lost the job and must stop writing to it.
        self.fence = f"{c.consumer}:{uuid.uuid4().hex[:12]}".encode()
        self.in_flight: dict[str, InFlight] = {}
        self._settling: list[Item] = []  # entries that end without running, to publish
        self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="tokenq-prompt")
        self._replay_from: bytes | None = b"0-0"  # own pending entries first, then ">"
        self._resync = False  # after a Redis failure: look for entries we never heard of
        self._group_ready = False
        self._redis_back_at = 0.0  # while Redis fails: when to try it again
        self._backoff = 0.0
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

    def _ensure_group(self) -> None:
        self.ensure_group()
        self._group_ready = True

    def run(self) -> None:
        """Serve until `stop()`, then drain and hand back what did not finish."""
        self._redis(self._ensure_group)
        structlog.contextvars.bind_contextvars(consumer=self.config.consumer)
        self.log.info("worker started", stream=self.keys.jobs, group=self.config.group)
        try:
            while not self._drained():
                self.run_once()
        finally:
            self._shutdown()
            self.log.info("worker stopped")

    def _drained(self) -> bool:
        return self._stop_at is not None and (
            not self.in_flight or time.monotonic() >= self._stop_at
        )

    def run_once(self) -> None:
        """One iteration: Redis work (while Redis answers), then one engine step, then
        publish. An engine step never waits for a Redis outage to end."""
        now = time.monotonic()
        if now >= self._redis_back_at:
            self._redis(self._intake)
        self._admit_prepared()
        stepped = False
        if self.engine.has_unfinished() and self._outbox_size() < self.config.max_outbox_events:
            stepped = self._step()
        if (self.in_flight or self._settling) and time.monotonic() >= self._redis_back_at:
            self._redis(self._publish)
        if not stepped and not self._settling:
            self._idle()
        if now >= self._next_metrics and now >= self._redis_back_at:
            self._next_metrics = now + self.config.metrics_interval_s
            self._redis(self._publish_metrics)

    def _redis(self, work: Any) -> None:
        """Run one piece of Redis work; a failure schedules a retry with backoff and a
        resync instead of unwinding the loop."""
        try:
            work()
        except (*REDIS_ERRORS, redis.ResponseError) as exc:
            if isinstance(exc, redis.ResponseError):
                if "NOGROUP" not in str(exc):
                    raise
                self._group_ready = False  # Redis came back without our group: make it again
            self._backoff = min(max(2 * self._backoff, 0.1), self.config.max_backoff_s)
            self._redis_back_at = time.monotonic() + self._backoff
            self._resync = True
            self.log.warning("redis unavailable", error=str(exc), retry_in=self._backoff)
        else:
            self._backoff = 0.0

    def _idle(self) -> None:
        """Nothing was stepped: wait a little instead of spinning. (When Redis answers and
        the worker can take jobs, XREADGROUP BLOCK has done the waiting already.)"""
        now = time.monotonic()
        if now < self._redis_back_at:
            time.sleep(min(self._redis_back_at - now, self.config.block_ms / 1000))
        elif self._preparing():
            time.sleep(0.002)
        elif self.stopping or self._capacity() <= 0:
            time.sleep(self.config.block_ms / 1000)

    def _outbox_size(self) -> int:
        return sum(len(inf.outbox) for inf in self.in_flight.values())

    def _preparing(self) -> bool:
        return any(inf.prompt is not None for inf in self.in_flight.values())

    # -- intake ----------------------------------------------------------------------------

    def _intake(self) -> None:
        """Resync after a failure, keep our entries alive, take over orphaned entries,
        then take new ones."""
        now = time.monotonic()
        if not self._group_ready:
            self._ensure_group()
        if self._resync:
            self._heartbeat()
            self._take_own_pending()
            self._resync = False
        if self.in_flight and now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            self._heartbeat()
        if self.stopping:
            return
        if now >= self._next_claim:
            self._next_claim = now + self.config.claim_interval
            self._reclaim()
        self._admit()

    def _capacity(self) -> int:
        """Entries to take now: what the engine admits, less jobs still being tokenized;
        none while the outbox is backed up (Redis is slower than the engine)."""
        if self._outbox_size() >= self.config.max_outbox_events // 2:
            return 0
        preparing = sum(1 for inf in self.in_flight.values() if inf.prompt is not None)
        return self.engine.free_capacity() - preparing

    def _admit(self) -> None:
        """Pull only what the engine admits now: the rest of the backlog stays in the
        stream for other workers."""
        capacity = self._capacity()
        if capacity <= 0:
            return
        c = self.config
        if self._replay_from is not None:
            # A previous process with our consumer name died holding these: reading them
            # with XREADGROUP counts a delivery, as it should.
            resp = self.redis.xreadgroup(
                c.group, c.consumer, {self.keys.jobs: self._replay_from}, count=capacity
            )
            entries = resp[0][1] if resp else []
            if not entries:
                self._replay_from = None
                return
            self._replay_from = entries[-1][0]
            self._take(entries, self._delivery_counts([eid for eid, _ in entries]))
            return
        busy = self.engine.has_unfinished() or bool(self.in_flight) or bool(self._settling)
        block = None if busy else c.block_ms
        started = time.monotonic()
        resp = self.redis.xreadgroup(
            c.group, c.consumer, {self.keys.jobs: ">"}, count=capacity, block=block
        )
        entries = resp[0][1] if resp else []
        if entries:
            self._take(entries, {})
        elif block is not None:
            # fakeredis (the demo) answers BLOCK with COUNT at once: never spin when idle.
            time.sleep(max(0.0, block / 1000 - (time.monotonic() - started)))

    def _reclaim(self) -> None:
        """Take over entries of workers that stopped heartbeating (this counts a delivery:
        the worker that held them is presumed dead)."""
        capacity = self._capacity()
        if capacity <= 0:
            return
        c = self.config
        cursor, entries, deleted = self.redis.xautoclaim(
            self.keys.jobs,
            c.group,
            c.consumer,
            c.claim_idle_ms,
            start_id=self._claim_cursor,
            count=capacity,
        )
        self._claim_cursor = cursor
        for eid in deleted:
            # Redis >= 7 drops trimmed entries from the PEL itself and only reports them.
            self._reject(Delivery(eid, None, 0), lost_payload(), mode="orphan")
        if entries:
            self.log.info("reclaimed jobs", count=len(entries))
            self._take(entries, self._delivery_counts([eid for eid, _ in entries]))

    def _take_own_pending(self) -> None:
        """After a Redis failure: entries pending for this consumer that it does not know
        (their XREADGROUP or XAUTOCLAIM reply was lost), read without counting a delivery."""
        c = self.config
        rows = self.redis.xpending_range(
            self.keys.jobs, c.group, min="-", max="+", count=10_000, consumername=c.consumer
        )
        known = {inf.entry_id for inf in self.in_flight.values()}
        known |= {it.entry_id for it in self._settling}
        unknown = {r["message_id"]: r["times_delivered"] for r in rows}
        unknown = {eid: n for eid, n in unknown.items() if eid not in known}
        if not unknown:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for eid in unknown:
                pipe.xrange(self.keys.jobs, eid, eid)
            found = pipe.execute()
        entries: list[Entry] = []
        for eid, rows_ in zip(unknown, found, strict=True):
            if rows_:
                entries.append(rows_[0])
            else:
                self._reject(Delivery(eid, None, unknown[eid]), lost_payload())
        self.log.info("took back own pending entries", count=len(unknown))
        self._take(entries, unknown)

    def _delivery_counts(self, entry_ids: list[bytes]) -> dict[bytes, int]:
        if not entry_ids:
            return {}
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

    def _take(self, entries: list[Entry], counts: dict[bytes, int]) -> None:
        """Parse delivered entries: reject the bad, start the good. `counts` holds the
        delivery count of redelivered entries (absent: a first delivery)."""
        running = {inf.entry_id for inf in self.in_flight.values()}
        candidates: list[tuple[Delivery, JobRequest]] = []
        for eid, fields in entries:
            if eid in running:
                continue
            delivery = Delivery(eid, fields, counts.get(eid, 1))
            parsed = parse_entry(
                fields, delivery.count, self.config.max_deliveries, self.config.limits
            )
            if isinstance(parsed, JobRequest):
                jid = parsed.job_id
                if jid in self.in_flight or any(jid == job.job_id for _, job in candidates):
                    self._settle(Item("settle", eid, jid))  # a second entry for a job here
                    self._job_log(jid).info("second entry for a running job acknowledged")
                    continue
                parsed = check_model(parsed, self.config.model_names) or parsed
            if isinstance(parsed, Rejection):
                self._reject(delivery, parsed)
            else:
                candidates.append((delivery, parsed))
        if candidates:
            self._start(candidates)

    def _start(self, candidates: list[tuple[Delivery, JobRequest]]) -> None:
        """Take the owner key and read what the reply stream already holds (one script):
        a worker that ran the job before either wrote before this read (and we see its
        tokens) or finds our fence in the owner key and writes nothing more."""
        results = self.scripts.start(
            self.fence,
            self.config.running_reply_ttl_s,
            [(job.job_id, d.count == 1) for d, job in candidates],  # type: ignore[misc]
        )
        for (delivery, job), res in zip(candidates, results, strict=True):
            eid, jid = delivery.entry_id, job.job_id
            assert jid is not None
            history = ReplyHistory.from_entries(res.reply)
            if res.verdict == "finished" or history.terminal is not None:
                self._job_log(jid).info("duplicate delivery of a finished job")
                self._settle(Item("settle", eid, jid, release=res.verdict == "start"))
            elif res.verdict == "elsewhere":
                self._job_log(jid).info("a second entry for a job running on another worker")
                self._settle(Item("settle", eid, jid))
            elif res.cancelled:
                self._cancelled_before_start(eid, job, history)
            elif job.deadline is not None and job.deadline <= time.time():
                late = Rejection(
                    "deadline_exceeded",
                    "the job's deadline passed before a worker could start it",
                    jid,
                    dead_letter=False,
                    metadata=job.metadata,
                )
                self._reject(delivery, late, release=True)
            else:
                next_seq = reply_seq(res.reply[-1][0]) + 1 if res.reply else 1
                inf = InFlight(
                    job,
                    eid,
                    delivery.fields or {},
                    delivery.count,
                    Continuation(history, job.params.get("logprobs") is not None),
                    next_seq,
                    prompt=self._tokenizer.submit(
                        self.engine.encode_prompt,
                        job.prompt,
                        prompt_token_ids=job.prompt_token_ids,
                        messages=job.messages,
                    ),
                )
                self.in_flight[jid] = inf
                self._job_log(jid).info(
                    "job started",
                    entry_id=eid.decode(),
                    deliveries=delivery.count,
                    resumed_tokens=len(history.token_ids),
                )

    def _admit_prepared(self) -> None:
        """Jobs whose prompt is tokenized go into the engine (or are rejected)."""
        for jid, inf in list(self.in_flight.items()):
            if inf.prompt is None or not inf.prompt.done():
                continue
            future, inf.prompt = inf.prompt, None
            rejection = self._add_to_engine(inf, future)
            if rejection is not None:
                del self.in_flight[jid]
                delivery = Delivery(inf.entry_id, inf.fields, inf.deliveries)
                self._reject(delivery, rejection, release=True)
            else:
                inf.in_engine = True

    def _add_to_engine(self, inf: InFlight, prompt: Future[list[int]]) -> Rejection | None:
        job = inf.job
        jid = job.job_id
        assert jid is not None
        try:
            with structlog.contextvars.bound_contextvars(job_id=jid):
                self.engine.add_request(
                    jid,
                    prompt_token_ids=prompt.result(),
                    params=engine_params(job),
                    priority=job.priority,
                    arrival_time=to_monotonic(enqueue_time(inf.entry_id)),
                    deadline=None if job.deadline is None else to_monotonic(job.deadline),
                )
        except InvalidRequest as exc:
            return Rejection(exc.code, exc.message, jid, metadata=job.metadata)
        except Exception as exc:  # the engine must not take the worker down for one job
            self._job_log(jid).exception("engine refused the job unexpectedly")
            message = clip(f"{type(exc).__name__}: {exc}", 300)
            return Rejection("internal_error", message, jid, metadata=job.metadata)
        return None

    def _cancelled_before_start(
        self, entry_id: bytes, job: JobRequest, history: ReplyHistory
    ) -> None:
        waited = max(0.0, time.time() - enqueue_time(entry_id))
        done = cancelled_before_start(history, waited, job.metadata)
        self.metrics.request_success_total["cancelled"] += 1
        self._job_log(job.job_id).info("job cancelled before it started")
        events = [encode_event(done)]
        self._settle(Item("settle", entry_id, job.job_id, status=DONE, events=events, release=True))

    def _reject(
        self, delivery: Delivery, rejection: Rejection, mode: str = "settle", release: bool = False
    ) -> None:
        """End an entry with an error, and a dead letter for poison input. `release`: this
        worker took the job for this entry (else the entry's id may belong to a job that
        runs or ended elsewhere, whose reply the PUBLISH script leaves alone)."""
        jid, eid = rejection.job_id, delivery.entry_id
        self.metrics.failed(rejection.code)
        self._job_log(jid).warning(
            "job rejected", code=rejection.code, message=rejection.message, entry_id=eid.decode()
        )
        dead = self._dead_letter(delivery, rejection) if rejection.dead_letter else None
        events = []
        if jid is not None:
            events = [
                encode_event(ErrorEvent(rejection.code, rejection.message, rejection.metadata))
            ]
        self._settle(Item(mode, eid, jid, status=ERROR, events=events, dead=dead, release=release))

    def _dead_letter(self, delivery: Delivery, rejection: Rejection) -> dict[str, Any]:
        """The dead-letter entry. The original fields are kept whole up to a size bound,
        so a fixed job can be re-submitted; beyond it only a prefix of each is kept, so a
        flood of huge poison entries cannot grow the dead-letter stream by gigabytes."""
        c = self.config
        fields = delivery.fields or {}
        size = sum(len(k) + len(v) for k, v in fields.items())
        truncated = size > c.dead_letter_fields_bytes
        if truncated:
            share = c.dead_letter_fields_bytes // max(1, len(fields))
            fields = {k[:64]: v[:share] for k, v in list(fields.items())[:16]}
        return {
            "entry_id": delivery.entry_id,
            "job_id": rejection.job_id or "",
            "code": rejection.code,
            "message": rejection.message,
            "deliveries": delivery.count,
            "consumer": c.consumer,
            "failed_at": time.time(),
            "fields": pack(fields),
            "truncated": int(truncated),
        }

    def _settle(self, item: Item) -> None:
        self._settling.append(item)

    # -- the step --------------------------------------------------------------------------

    def _step(self) -> bool:
        try:
            outputs = self.engine.step()
        except StepFailed as exc:
            # Every job of the step failed even alone: the device, not a job, is broken.
            # What the step finished before failing (deadlines) still goes out.
            self._step_failures += 1
            self.log.exception("engine step failed", consecutive=self._step_failures)
            for out in exc.outputs:
                self._collect(out)
            self._redis(self._publish)
            self._redis(self._hand_back)
            if self._step_failures >= self.config.max_step_failures:
                raise
            return True
        self._step_failures = 0
        for out in outputs:
            self._collect(out)
        return True

    def _collect(self, out: RequestDelta) -> None:
        """Queue one engine output's events in its job's outbox."""
        inf = self.in_flight.get(out.request_id)
        if inf is None:
            return
        inf.outbox += inf.continuation.translate(out, inf.job.metadata)
        if not out.finished:
            if not inf.status and inf.outbox:
                inf.status = RUNNING
            return
        inf.in_engine = False
        inf.output = out
        inf.status = DONE
        if out.finish_reason == "error":
            # The engine isolated this job as the one that breaks its steps: poison.
            error = inf.outbox[-1]
            assert isinstance(error, ErrorEvent)
            rejection = Rejection(error.code, error.message, out.request_id)
            inf.dead = self._dead_letter(
                Delivery(inf.entry_id, inf.fields, inf.deliveries), rejection
            )
            inf.status = ERROR
            self.metrics.failed(error.code)
            self._job_log(out.request_id).warning("job failed in the engine", message=error.message)

    # -- publishing ------------------------------------------------------------------------

    def _publish(self) -> None:
        """Write every job's outbox and settle every finished entry in one script call,
        fenced by the owner keys; the answer also says which jobs were cancelled."""
        jobs = list(self.in_flight.values())
        settling = list(self._settling)
        items = [
            Item(
                "run",
                inf.entry_id,
                inf.job.job_id,
                inf.next_seq,
                inf.status,
                [encode_event(ev) for ev in inf.outbox],
                inf.dead,
            )
            for inf in jobs
        ]
        c = self.config
        results = self.scripts.publish(
            self.fence, items + settling, c.running_reply_ttl_s, c.reply_ttl_s, c.dead_letter_maxlen
        )
        del self._settling[: len(settling)]
        for inf, (outcome, cancelled) in zip(jobs, results, strict=False):
            jid = inf.job.job_id
            assert jid is not None
            if outcome == "lost":
                self._lose(inf)
                continue
            inf.next_seq += len(inf.outbox)
            inf.outbox = []
            if inf.status in (DONE, ERROR):
                del self.in_flight[jid]
                self._account(inf)
                continue
            inf.status = ""
            if cancelled and inf.in_engine:
                out = self.engine.abort(jid)
                if out is not None:
                    self._collect(out)
        for item, (outcome, _) in zip(settling, results[len(jobs) :], strict=True):
            if outcome == "gone":
                self._job_log(item.job_id).info(
                    "entry was settled or reclaimed elsewhere", entry_id=item.entry_id.decode()
                )

    def _account(self, inf: InFlight) -> None:
        out = inf.output
        if out is None or out.finish_reason == "error":
            return
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

    def _lose(self, inf: InFlight) -> None:
        """Another worker took this job over (we looked dead): stop without a trace."""
        jid = inf.job.job_id
        assert jid is not None
        self._drop(inf)
        self._job_log(jid).warning("job taken over by another worker; dropped here")

    def _drop(self, inf: InFlight) -> None:
        jid = inf.job.job_id
        assert jid is not None
        if inf.prompt is not None:
            inf.prompt.cancel()
        if inf.in_engine:
            self.engine.abort(jid)
        self.in_flight.pop(jid, None)

    # -- ownership -------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Reset the idle time of our entries (no delivery counted) so that other workers'
        XAUTOCLAIM leaves long jobs alone; drop jobs whose entries were taken over."""
        by_entry = {inf.entry_id: inf for inf in self.in_flight.values()}
        for eid in self.scripts.keep(list(by_entry)):
            self._lose(by_entry[eid])

    def _hand_back(self) -> None:
        """Stop what is in flight without acknowledging it and mark it idle, so the next
        XAUTOCLAIM of any worker takes it at once instead of after claim_idle_ms."""
        if not self.in_flight:
            return
        entries = [inf.entry_id for inf in self.in_flight.values()]
        self.log.info("handing back unfinished jobs", jobs=list(self.in_flight))
        for inf in list(self.in_flight.values()):
            self._drop(inf)
        self.scripts.keep(entries, idle_ms=self.config.claim_idle_ms)

    def _shutdown(self) -> None:
        """Publish what is owed, hand back what did not finish, last metrics."""
        try:
            if self.in_flight or self._settling:
                self._publish()
            self._hand_back()
            self._publish_metrics()
        except redis.RedisError as exc:
            self.log.warning("redis unavailable while stopping", error=str(exc))
        for inf in list(self.in_flight.values()):
            self._drop(inf)
        self._tokenizer.shutdown(wait=False, cancel_futures=True)

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
