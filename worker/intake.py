"""The intake thread: takes as many jobs as the engine admits (TAKE, blocking on the
doorbells while idle), starts them (START), takes over dead workers' entries (RECLAIM)
and, after a Redis failure, its own entries it never heard of (OWN)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
import structlog

from tokenq.engine.prompts import Prompts
from tokenq.protocol import DONE, LANES, JobRequest, Keys, reply_seq
from tokenq.protocol.params import SamplingParams
from tokenq.worker.config import WorkerConfig
from tokenq.worker.driver import ENGINE, Add
from tokenq.worker.entries import (
    Rejection,
    check_model,
    engine_params,
    enqueue_time,
    lost_payload,
    parse_entry,
    to_monotonic,
)
from tokenq.worker.hooks import completed_hook
from tokenq.worker.inflight import InFlight, InFlightTable
from tokenq.worker.logs import job_log
from tokenq.worker.metrics import WorkerMetrics
from tokenq.worker.replies import Continuation, ReplyHistory, cancelled_before_start
from tokenq.worker.retry import Retrying
from tokenq.worker.scripts import Scripts, Taken, event_arg

if TYPE_CHECKING:
    from tokenq.worker.shards import ShardedScripts

if TYPE_CHECKING:
    from tokenq.worker.driver import EngineDriver
    from tokenq.worker.remote import RemoteEngine

# Entries of one delivery are started this many at a time: the engine's first step starts
# with the first of them, and the rest join it between two layers as they are made ready.
START_CHUNK = 16
# A TAKE that emptied the lanes is believed for this many blocks (1 s by default) unless a
# doorbell rings: an idle worker asks its queues once a second, and an entry added without
# a ring (against the protocol) is still found within that.
EMPTIED_FOR_BLOCKS = 10


class Intake:
    """Takes jobs from the queues into the in-flight table and the engine."""

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
        prompts: Prompts,
        stopping: Callable[[], bool],
        heartbeat_soon: Callable[[], None],
    ) -> None:
        self.scripts = scripts
        self.keys: Keys = scripts.keys
        self.config = config
        self.driver = driver
        self.prompts = prompts
        self.table = table
        self.metrics = metrics
        self.fence = fence
        self.log = log
        self._stopping = stopping
        self._heartbeat_soon = heartbeat_soon
        self.retrying = Retrying(conn, config.max_backoff_s, self.resync, log)
        self._replay = True  # first, own pending entries a previous process left
        self._taking = True  # until a pass sees the stop: then it logs that it takes no more
        self._resync = False  # look for entries whose delivery answer was lost
        self._turn = 0  # rotates which tenant a TAKE serves first
        # The last ring seen per doorbell (each served model's, on a cluster in each shard).
        self._bells = dict.fromkeys(scripts.bell_keys(config.served_names), b"0-0")
        # The lanes the last TAKE drained, and until when that is believed without a ring.
        self._emptied: tuple[bool, ...] = (False, False, False)
        self._emptied_until = 0.0
        self._next_claim = 0.0

    def resync(self) -> None:
        """After a Redis failure on any thread: look for entries never heard of."""
        self._resync = True

    def run_pass(self, block: float) -> None:
        backoff = self.retrying.backoff
        if not backoff.ready():
            time.sleep(min(block, backoff.until - time.monotonic()))
            return
        self.retrying(lambda: self._take_jobs(block))

    def _take_jobs(self, block: float) -> None:
        names = self.config.served_names
        if self._replay:
            # A previous process with our consumer name died holding these: XREADGROUP
            # counts a delivery, as it should.
            replayed = self.scripts.own(names, replay=True)
            self._take(replayed)
            self._replay = False
            if replayed:
                self._heartbeat_soon()  # idle since that process died
        if self._resync:
            self._resync = False
            self._emptied_until = 0.0
            # The publisher heartbeats (finding jobs lost while Redis was away): here it
            # could see an entry the publisher has just settled as gone.
            self._heartbeat_soon()
            self._take_own_pending()
        if self._stopping():
            if self._taking:
                self._taking = False
                self.log.info("taking no more jobs")
            time.sleep(block)
            return
        now = time.monotonic()
        if now >= self._next_claim:
            self._next_claim = now + self.config.claim_interval
            self._reclaim()
        self.admit(block)

    def slots(self) -> list[int]:
        """Entries to take now per lane: what the engine admits, counting the work it would
        preempt; none while the events owed to Redis pile up."""
        owed = self.table.outbox_size() + self.driver.owed
        if owed >= self.config.max_outbox_events // 2:
            return [0, 0, 0]
        return list(self.driver.free_slots)

    def admit(self, block: float) -> None:
        """Take only what the engine admits now (the rest stays for other workers); with
        nothing to take, wait on the served models' doorbells."""
        c = self.config
        slots = self.slots()
        taken: list[Taken] = []
        if max(slots) > 0 and not self._all_emptied(slots):
            self._turn += 1
            waits = [int(c.lane_max_wait_s.get(lane, 0) * 1000) for lane in LANES]
            result = self.scripts.take(
                c.served_names, slots, waits, self._turn, self.fence, c.running_reply_ttl_s
            )
            taken = result.taken
            self._bells.update(result.rings)  # answered: the wait below is for newer ones
            self._emptied = result.drained
            self._emptied_until = time.monotonic() + EMPTIED_FOR_BLOCKS * block
        if taken:
            self._take(taken)
        elif block and max(slots) > 0:
            started = time.monotonic()
            resp = self.scripts.wait_bells(dict(self._bells), max(1, int(block * 1000)))
            if resp:
                self._emptied_until = 0.0  # a doorbell rang: take again
            for key, entries in resp:
                self._bells[key.decode()] = entries[-1][0]
            if not resp:
                # fakeredis (the demo) answers BLOCK at once: never spin when idle.
                time.sleep(max(0.0, block - (time.monotonic() - started)))
        elif block:
            self.driver.freed.wait(block)  # full: wait for the engine to free a slot
            self.driver.freed.clear()

    def _all_emptied(self, slots: list[int]) -> bool:
        """Whether the last TAKE, not long ago, drained every lane with free slots and no
        ring came since: a slot freed at the end of a step then costs no empty TAKE."""
        if time.monotonic() >= self._emptied_until:
            return False
        return all(empty or n == 0 for n, empty in zip(slots, self._emptied, strict=True))

    def _reclaim(self) -> None:
        most = max(self.slots())
        if most <= 0:
            return
        c = self.config
        taken = self.scripts.reclaim(c.served_names, c.claim_idle_ms, most)
        for t in taken:
            if t.fields is None:
                # Redis >= 7 drops trimmed entries from the PEL itself and only reports them.
                self.table.reject(t, lost_payload(), mode="orphan")
        taken = [t for t in taken if t.fields is not None]
        if taken:
            self.log.info("reclaimed jobs", count=len(taken))
            self._take(taken)

    def _take_own_pending(self) -> None:
        """Entries pending for this consumer that it does not know, read without counting
        a delivery."""
        known = self.table.known_entries()
        own = self.scripts.own(self.config.served_names, replay=False)
        unknown = [t for t in own if t.entry_id not in known]
        if unknown:
            self.log.info("took back own pending entries", count=len(unknown))
            self._take(unknown)

    def _take(self, taken: list[Taken]) -> None:
        """Start the good entries, then reject the bad: a bad entry naming the job of a good
        one then finds that job held and leaves its reply alone."""
        running = self.table.running_entries()
        jobs = self.table.jobs
        starting: set[str | None] = set()  # the job ids of the entries to start
        rejected: list[tuple[Taken, Rejection]] = []
        c = self.config
        served = frozenset(c.served_names)
        for i in range(0, len(taken), START_CHUNK):
            candidates: list[tuple[Taken, JobRequest]] = []
            for delivery in taken[i : i + START_CHUNK]:
                if delivery.entry_id in running:
                    continue
                if delivery.fields is None:
                    rejected.append((delivery, lost_payload()))
                    continue
                parsed = parse_entry(delivery.fields, delivery.count, c.max_deliveries, c.limits)
                if isinstance(parsed, JobRequest):
                    parsed = self._check_shard(delivery, parsed) or parsed
                if isinstance(parsed, JobRequest):
                    jid = parsed.job_id
                    if jid in jobs or jid in starting:
                        self.table.settle(delivery, jid)  # a second entry
                        job_log(self.log, jid).info("second entry for a running job acknowledged")
                        continue
                    parsed = check_model(parsed, served) or parsed
                if isinstance(parsed, Rejection):
                    rejected.append((delivery, parsed))
                else:
                    candidates.append((delivery, parsed))
                    starting.add(parsed.job_id)
            if candidates:
                self._start(candidates)
        for delivery, rejection in rejected:
            # TAKE took its job's owner key for it, and no other entry holds the job here.
            release = (
                delivery.started is not None
                and delivery.started.verdict == "start"
                and rejection.job_id not in starting
                and rejection.job_id not in jobs
            )
            self.table.reject(delivery, rejection, release=release)
        self.driver.prepare_texts()

    def _check_shard(self, delivery: Taken, job: JobRequest) -> Rejection | None:
        """On a cluster a job's keys are in the shard its id names: an entry queued in
        another shard (a producer that placed it by hand) could not be answered where its
        client reads."""
        layout = self.scripts.layout
        want = layout.index(job.job_id)  # type: ignore[arg-type]
        if layout.index_of_key(delivery.stream) == want:
            return None
        message = (
            f"job id {job.job_id!r} belongs in shard {want} "
            f"(CRC-32 of the id modulo {layout.count})"
        )
        return Rejection("invalid_request", message, job.job_id, metadata=job.metadata)

    def _start(self, candidates: list[tuple[Taken, JobRequest]]) -> None:
        """Take the owner key and read the reply stream (TAKE did for fresh entries, START
        does for the others): a worker that ran the job before wrote before this read, or
        finds our fence and writes nothing more. Then hand the jobs to the engine."""
        unstarted = [(job.job_id, d.count == 1) for d, job in candidates if d.started is None]
        answers = iter(
            self.scripts.start(self.fence, self.config.running_reply_ttl_s, unstarted)  # type: ignore[arg-type]
            if unstarted
            else []
        )
        results = [d.started or next(answers) for d, _ in candidates]
        adds: list[Add] = []
        for (delivery, job), res in zip(candidates, results, strict=True):
            jid = job.job_id
            assert jid is not None
            history = ReplyHistory.from_entries(res.reply)
            if res.verdict == "finished" or history.terminal is not None:
                job_log(self.log, jid).info("duplicate delivery of a finished job")
                self.table.settle(delivery, jid, release=res.verdict == "start")
            elif res.verdict == "elsewhere":
                job_log(self.log, jid).info("a second entry for a job running on another worker")
                self.table.settle(delivery, jid)
            elif res.cancelled:
                self._cancelled_before_start(delivery, job, history)
            elif job.deadline is not None and job.deadline <= time.time():
                late = Rejection(
                    "deadline_exceeded",
                    "the job's deadline passed before a worker could start it",
                    jid,
                    dead_letter=False,
                    metadata=job.metadata,
                )
                self.table.reject(delivery, late, release=True, job=job)
            else:
                next_seq = reply_seq(res.reply[-1][0]) + 1 if res.reply else 1
                add = self._prepare(delivery, job, history, next_seq)
                if add is not None:
                    adds.append(add)
        self.driver.add(adds)

    def _prepare(
        self, delivery: Taken, job: JobRequest, history: ReplyHistory, next_seq: int
    ) -> Add | None:
        """Tokenize the prompt and build the parameters here, off the engine's thread, and
        book the job in flight."""
        jid = job.job_id
        assert jid is not None
        try:
            params = SamplingParams.from_dict(engine_params(job))
            if job.prompt_token_ids is not None:
                ids = self.prompts.encode(prompt_token_ids=job.prompt_token_ids)
            else:  # the tokenizer's own logs (a chat template's warning) name the job
                with structlog.contextvars.bound_contextvars(job_id=jid):
                    ids = self.prompts.encode(job.prompt, messages=job.messages)
        except Exception as exc:  # InvalidRequest: the job is bad; else: a bug, isolated
            code = getattr(exc, "code", "internal_error")
            message = getattr(exc, "message", f"{type(exc).__name__}: {exc}")
            rejection = Rejection(code, message, jid, metadata=job.metadata)
            self.table.reject(delivery, rejection, release=True, job=job)
            return None
        text_by = self.driver.text_by(params)
        if text_by != ENGINE:
            params.detokenize = False  # the engine makes none: `text_by` does
        logprobs = job.params.get("logprobs") is not None
        continuation = Continuation(history, logprobs, params.n)
        inf = InFlight(job, delivery, continuation, next_seq, self.table.backlog(delivery))
        inf.hooks = self.table.job_hooks(delivery, job)
        self.table.add(inf)
        job_log(self.log, jid).info(
            "job started",
            entry_id=delivery.entry_id.decode(),
            deliveries=delivery.count,
            resumed_tokens=history.num_tokens,
        )
        return Add(
            jid,
            ids,
            params,
            job.priority,
            to_monotonic(enqueue_time(delivery.entry_id)),
            None if job.deadline is None else to_monotonic(job.deadline),
            text_by,
        )

    def _cancelled_before_start(
        self, delivery: Taken, job: JobRequest, history: ReplyHistory
    ) -> None:
        waited = max(0.0, time.time() - enqueue_time(delivery.entry_id))
        done = cancelled_before_start(history, waited, job.metadata)
        self.metrics.cancelled(job.lane)
        job_log(self.log, job.job_id).info("job cancelled before it started")
        events = [event_arg(done)]
        stream = self.table.hook_stream(delivery)
        hooks = [] if stream is None else completed_hook(job, stream, done)
        self.table.settle(
            delivery, job.job_id, status=DONE, events=events, release=True, hooks=hooks
        )
