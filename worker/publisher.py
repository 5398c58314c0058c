"""The publisher thread: turns the engine's outputs into reply events and writes them,
settling finished and rejected entries (PUBLISH: one call for everything owed); keeps this
worker's entries alive (KEEP), and publishes its metrics and registry entry."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from tokenq.protocol import DONE, ERROR, RUNNING, ErrorEvent
from tokenq.worker.config import WorkerConfig
from tokenq.worker.driver import Failed, Refused, weight
from tokenq.worker.entries import Rejection
from tokenq.worker.inflight import InFlight, InFlightTable
from tokenq.worker.logs import job_log
from tokenq.worker.metrics import WorkerMetrics
from tokenq.worker.retry import Retrying
from tokenq.worker.scripts import Item, Scripts, event_arg

if TYPE_CHECKING:
    from tokenq.engine.outputs import RequestDelta
    from tokenq.worker.driver import EngineDriver
    from tokenq.worker.remote import RemoteEngine
    from tokenq.worker.shards import ShardedScripts

WAKE = "wake"  # put on the engine's output queue: the publisher has settlements to send
# While no job in flight has new events, how often the publisher still asks Redis whether
# one was cancelled or taken over (a job with tokens coming asks with every publish).
QUIET_PUBLISH_S = 0.25


class Publisher:
    """Publishes what the in-flight table owes Redis, on the timers of its config."""

    def __init__(
        self,
        conn: redis.Redis,
        scripts: Scripts | ShardedScripts,
        config: WorkerConfig,
        driver: EngineDriver | RemoteEngine,
        table: InFlightTable,
        metrics: WorkerMetrics,
        fence: bytes,
        log: Any,
        register: Callable[[], None],
        resync: Callable[[], None],
    ) -> None:
        self.redis = conn
        self.scripts = scripts
        self.keys = scripts.keys
        self.config = config
        self.driver = driver
        self.table = table
        self.metrics = metrics
        self.fence = fence
        self.log = log
        self._register = register
        self.retrying = Retrying(conn, config.max_backoff_s, resync, log)
        self._next_heartbeat = self._next_metrics = self._next_register = 0.0
        self._heartbeat_at_once = False  # the intake resynced or read entries back
        self._last_publish = 0.0
        self._urgent = False  # a first token or an end waits for no stream interval
        self._fresh = False  # events wait in the outboxes
        self._step_failures = 0

    def heartbeat_soon(self) -> None:
        """Heartbeat on the next pass, not when the timer says."""
        self._heartbeat_at_once = True

    def run_pass(self, wait: float) -> None:
        """Collect outputs (waiting up to `wait`), publish what is owed, and tell the engine
        how much more the outboxes may take."""
        now = time.monotonic()
        due = min(self._next_metrics, self._next_register)
        if self.table.jobs:
            heartbeat = 0.0 if self._heartbeat_at_once else self._next_heartbeat
            due = min(due, heartbeat, self._publish_due())
        self.collect(max(0.0, min(wait, due - now)))
        backoff = self.retrying.backoff
        if backoff.ready():
            self._publish_owed()
        else:
            time.sleep(min(wait, max(0.0, backoff.until - time.monotonic())))
        self.driver.set_room(self.config.max_outbox_events - self.table.outbox_size())

    def _publish_owed(self) -> None:
        """The events owed, then heartbeats, metrics and the registry on their timers. The
        first call that fails ends the pass: the others would wait out the same server."""
        now = time.monotonic()
        jobs = self.table.jobs
        on_time = now >= self._publish_due()
        if self.table.settling or (jobs and (self._urgent or on_time)):
            self._urgent = False
            self._last_publish = now
            if not self.retrying(self.publish):
                return
        now = time.monotonic()
        interval: float = self.config.heartbeat_interval_s  # type: ignore[assignment]
        if not jobs:
            # A job that comes in was just delivered: its first heartbeat is due an interval
            # later (one at once would only take time from a burst's first step).
            self._next_heartbeat = now + interval
        elif self._heartbeat_at_once or now >= self._next_heartbeat:
            self._heartbeat_at_once = False  # before the heartbeat reads what is in flight
            self._next_heartbeat = now + interval
            if not self.retrying(self._heartbeat):
                return
        if now >= self._next_metrics:
            self._next_metrics = now + self.config.metrics_interval_s
            if not self.retrying(self.publish_metrics):
                return
        if now >= self._next_register:
            self._next_register = now + self.config.registry_interval_s
            self.retrying(self._register)

    def _publish_due(self) -> float:
        """A stream interval after the last publish while events wait; else QUIET_PUBLISH_S
        after each job was last asked about cancellation (each wake-up costs the engine)."""
        last = self._last_publish
        if self._fresh:
            return last + self.config.stream_interval_s
        return max(last, self.table.oldest_start(last)) + QUIET_PUBLISH_S

    def collect(self, wait: float) -> None:
        """Take every output the engine has queued, waiting up to `wait` for the first."""
        try:
            first = self.driver.outputs.get(timeout=wait) if wait > 0 else None
        except queue.Empty:
            return
        items = [first] if first is not None else []
        while True:
            try:
                items.append(self.driver.outputs.get_nowait())
            except queue.Empty:
                break
        for item in items:
            self.driver.collected += weight(item)
            if isinstance(item, list):
                for out in item:
                    self._collect(out)
            elif isinstance(item, Refused):
                self._refused(item)
            elif isinstance(item, Failed):
                self._failed(item)

    def _collect(self, out: RequestDelta) -> None:
        """Queue one engine output's events in its job's outbox."""
        inf = self.table.jobs.get(out.request_id)
        if inf is None:
            return  # dropped here (taken over, handed back): nothing more to say
        events = inf.continuation.translate(out, inf.job.metadata)
        self._fresh |= bool(events)
        with self.table.lock:
            for event in events:
                inf.queue(event)
            if not out.finished:
                if not inf.status and inf.outbox and time.monotonic() >= inf.running_until:
                    inf.status = RUNNING
                    self._urgent |= inf.next_seq == 1  # a first token goes out at once
                return
            self._urgent = True  # and so does an end
            inf.output = out
            inf.status = DONE
        if out.finish_reason == "error":
            # The engine isolated this job as the one that breaks its steps: poison.
            error = events[-1]
            assert isinstance(error, ErrorEvent)
            rejection = Rejection(error.code, error.message, out.request_id)
            inf.dead = self.table.dead_letter(inf.delivery, rejection)
            inf.status = ERROR
            self.metrics.failed(error.code, inf.job.lane)
            job_log(self.log, out.request_id).warning(
                "job failed in the engine", message=error.message
            )

    def _refused(self, refused: Refused) -> None:
        with self.table.lock:
            inf = self.table.jobs.pop(refused.job_id, None)
        if inf is None:
            return
        rejection = Rejection(
            refused.code, refused.message, refused.job_id, metadata=inf.job.metadata
        )
        self.table.reject(inf.delivery, rejection, release=True, job=inf.job)

    def _failed(self, failed: Failed) -> None:
        """Every job of a step failed even alone: the device is broken. What the step
        finished still goes out; the rest is handed back."""
        self._step_failures += 1
        self.log.error("engine step failed", error=failed.error, consecutive=self._step_failures)
        for out in failed.outputs:
            self._collect(out)
        self.retrying(self.publish)
        self.retrying(self.hand_back)
        if self._step_failures >= self.config.max_step_failures:
            raise RuntimeError(
                f"{self._step_failures} engine steps failed in a row: {failed.error}"
            )

    def publish(self) -> None:
        """Write every job's outbox and settle every finished entry in one PUBLISH, fenced
        by the owner keys; its answer also says which jobs were cancelled."""
        table = self.table
        with table.lock:
            jobs = [(inf, list(inf.outbox), inf.status) for inf in table.jobs.values()]
            settling = list(table.settling)
            for inf, outbox, _ in jobs:
                inf.sent = len(outbox)
        items = [
            Item(
                "run",
                inf.delivery.stream,
                inf.delivery.entry_id,
                inf.job.job_id,
                first_seq=inf.next_seq,
                status=status,
                events=[event_arg(ev) for ev in outbox],
                dead=inf.dead,
                backlog=inf.backlog,
                weight=inf.delivery.weight,
                hooks=inf.hooks.owed(inf.next_seq, outbox, status) if inf.hooks else [],
            )
            for inf, outbox, status in jobs
        ]
        c = self.config
        sent_at = time.monotonic()  # the TTLs the script sets count from about here
        results = self.scripts.publish(
            self.fence,
            items + settling,
            c.running_reply_ttl_s,
            c.reply_ttl_s,
            c.dead_letter_maxlen,
            c.hook_ttl_s,
        )
        self._fresh = False  # all that was collected went out (outputs are collected here)
        self._step_failures = 0 if jobs else self._step_failures
        finished: list[InFlight] = []
        rerun: list[tuple[bytes, bytes]] = []
        with table.lock:
            del table.settling[: len(settling)]
            for (inf, outbox, status), item, (outcome, cancelled) in zip(
                jobs, items, results, strict=False
            ):
                jid = inf.job.job_id
                assert jid is not None
                if outcome == "lost":
                    self._lose(inf)
                    continue
                if outcome == "rerun":  # a failover lost some of its events
                    self._lose(inf)
                    rerun.append((inf.delivery.stream, inf.delivery.entry_id))
                    continue
                if inf.hooks is not None:
                    inf.hooks.sent(item.hooks)
                inf.next_seq += len(outbox)
                del inf.outbox[: len(outbox)]
                inf.sent = 0
                if status in (DONE, ERROR):
                    del table.jobs[jid]
                    finished.append(inf)
                    continue
                if status == RUNNING:
                    inf.running_until = sent_at + c.running_reply_ttl_s / 4
                if inf.status == status:
                    inf.status = ""
                if cancelled and inf.output is None:
                    self.driver.abort(jid)
        for inf in finished:
            self._account(inf)
        if rerun:  # handed back: the next XAUTOCLAIM runs them again from their streams
            self.log.warning("reply events lost in a failover: jobs handed back", count=len(rerun))
            self.scripts.keep(rerun, idle_ms=c.claim_idle_ms)
        for item, (outcome, _) in zip(settling, results[len(jobs) :], strict=True):
            if outcome == "gone":
                job_log(self.log, item.job_id).info(
                    "entry was settled or reclaimed elsewhere", entry_id=item.entry_id.decode()
                )

    def _account(self, inf: InFlight) -> None:
        out = inf.output
        if out is None or out.finish_reason == "error":
            return
        self.metrics.finished(out, inf.job.lane, skipped_tokens=inf.continuation.skipped)
        m = out.metrics
        job_log(self.log, out.request_id).info(
            "job finished",
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            queue_time=m.queue_time,
            ttft=m.ttft,
            e2e=m.e2e,
            deliveries=inf.delivery.count,
            entry_id=inf.delivery.entry_id.decode(),
        )

    def _lose(self, inf: InFlight) -> None:
        """Another worker took this job over (we looked dead), or Redis lost its entry:
        stop without a trace. With the table's lock held."""
        jid = inf.job.job_id
        assert jid is not None
        self.table.jobs.pop(jid, None)
        self.driver.abort(jid)
        job_log(self.log, jid).warning(
            "job taken over by another worker, or its entry gone from redis; dropped here"
        )

    def _heartbeat(self) -> None:
        """Reset our entries' idle time so that other workers' XAUTOCLAIM leaves long jobs
        alone; drop the jobs whose entries were taken over."""
        table = self.table
        with table.lock:
            by_entry = {inf.delivery.entry_id: inf for inf in table.jobs.values()}
        gone = self.scripts.keep([(i.delivery.stream, e) for e, i in by_entry.items()])
        with table.lock:
            for eid in gone:
                if by_entry[eid].job.job_id in table.jobs:
                    self._lose(by_entry[eid])

    def hand_back(self) -> None:
        """Stop what is in flight without acknowledging it, marked idle so that the next
        XAUTOCLAIM of any worker takes it at once."""
        jobs = self.table.take_all()
        if not jobs:
            return
        self.log.info("handing back unfinished jobs", jobs=[inf.job.job_id for inf in jobs])
        for inf in jobs:
            self.driver.abort(inf.job.job_id)  # type: ignore[arg-type]
        entries = [(inf.delivery.stream, inf.delivery.entry_id) for inf in jobs]
        self.scripts.keep(entries, idle_ms=self.config.claim_idle_ms)

    def publish_metrics(self) -> None:
        summary = self.metrics.summary()
        key = self.keys.metrics(self.config.consumer)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping={**summary, "updated_at": round(time.time(), 3)})
            pipe.expire(key, max(60, int(3 * self.config.metrics_interval_s)))
            pipe.execute()
        self.log.info("metrics", **summary)
