"""The worker: moves jobs between Redis and the engine without ever making the engine wait.

Three threads, each with one job (docs/design.md, "The worker"); under `tokenq worker`
the two Redis threads run in a process of their own, the engine across a pipe
(worker/split.py), and the same code drives it:

- the engine thread (the caller of `run()`) only steps the engine, through
  `worker/driver.py`: new requests and aborts are applied between steps, each step's
  outputs go on a queue;
- the intake thread takes jobs: it reads as many entries as the engine can admit
  (XREADGROUP, blocking while idle), claims them (START), tokenizes their prompts and
  hands them to the engine; it also resyncs after Redis failures and takes over the
  entries of dead workers (XAUTOCLAIM);
- the publisher thread turns the engine's outputs into reply events and writes them,
  settles finished and rejected entries (PUBLISH, one script call for everything owed),
  keeps this worker's entries alive (heartbeats) and publishes metrics.

Every Redis call is in this file, where it happens. Redis faults are ordinary: a call that
fails leaves the state as it was (events stay in their job's outbox, and the scripts in
worker/scripts.py make a re-sent call harmless); in-flight jobs keep running through a
short outage, and the engine pauses only when the events it owes pass a bound. After any
failure the worker re-reads its own pending entries (XPENDING + XRANGE, which count no
delivery) to find an entry whose delivery it never heard of.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
import structlog

from tokenq.engine.prompts import Prompts
from tokenq.protocol import (
    DONE,
    ERROR,
    LANES,
    RUNNING,
    ErrorEvent,
    Event,
    JobRequest,
    Keys,
    TokenEvent,
    lane_of,
    pack,
    reply_seq,
)
from tokenq.protocol.connection import version_tuple
from tokenq.protocol.params import SamplingParams
from tokenq.worker.config import WorkerConfig
from tokenq.worker.driver import Add, EngineDriver, Failed, Refused, weight
from tokenq.worker.heap import frozen_heap
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
from tokenq.worker.scripts import Item, Scripts, Taken, event_arg

if TYPE_CHECKING:
    from tokenq.engine.llm_engine import LLMEngine
    from tokenq.engine.outputs import RequestDelta
    from tokenq.worker.split import RemoteEngine

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
# Redis answering but refusing for a while, waited out as an unreachable server is: full
# under noeviction (OOM), a replica since a failover (READONLY), writes stopped after a
# failed save (MISCONF), a long script (BUSY). A script refused at its first write has
# written nothing, so the work is simply tried again.
# redis-py raises OOM and READONLY as classes of their own, the others as ResponseError.
REFUSALS = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)
REFUSAL_CODES = ("MISCONF ", "BUSY ")  # (not BUSYGROUP, a bug)


def passing(exc: redis.RedisError) -> bool:
    """Whether a Redis error is one to wait out rather than a bug or a broken setup."""
    if isinstance(exc, REDIS_ERRORS + REFUSALS):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(REFUSAL_CODES)


WAKE = "wake"  # put on the engine's output queue: the publisher has settlements to send
# While no job in flight has new events, how often the publisher still asks Redis whether
# one was cancelled or taken over (a job with tokens coming asks with every publish).
QUIET_PUBLISH_S = 0.25
# Entries of one delivery are started (parsed, claimed, tokenized, handed to the engine)
# this many at a time: the engine's first step starts with the first of them while the
# rest are made ready, and they join it between two layers, instead of all waiting for
# the slowest.
START_CHUNK = 16
# A TAKE that emptied the lanes is believed for this many blocks (1 s by default) unless a
# doorbell rings: an idle worker asks its queues once a second instead of after every
# doorbell wait, and an entry a producer added without ringing (against the protocol) is
# still found within that.
EMPTIED_FOR_BLOCKS = 10
# The oldest Redis the scripts run on: XAUTOCLAIM, exclusive XRANGE bounds and XTRIM MINID
# came in 6.2. On an older server a worker's scripts would fail or, worse, quietly skip
# what they cannot run (reclaiming a dead worker's jobs among it).
MIN_REDIS = (6, 2)


class UnsupportedRedis(RuntimeError):
    """The server is older than MIN_REDIS, or a cluster node: the worker does not start."""


@dataclass
class InFlight:
    """A job this worker owns, from its start until its final event is published."""

    job: JobRequest
    delivery: Taken  # the entry as delivered: settled with the job, its dead letter if fails
    continuation: Continuation
    next_seq: int  # the reply stream sequence id of outbox[0]
    backlog: str | None  # its lane's backlog counter (named in every publish: parsed once)
    outbox: list[Event] = field(default_factory=list)  # events not yet published
    sent: int = 0  # how many of them a publish call has carried (answer pending or lost)
    status: str = ""  # the job key's next value, sent with the outbox
    # Until when the job key says running and the reply stream's running TTL is fresh:
    # `running` goes out with the first events, then only to renew that TTL, sparing the
    # publish script two calls a job on every other publish.
    running_until: float = 0.0
    started: float = field(default_factory=time.monotonic)  # START asked if it was cancelled
    dead: dict[str, Any] | None = None  # a dead letter, sent with a final error
    output: RequestDelta | None = None  # the engine's final output, once finished


@dataclass
class Backoff:
    """Retry timing for one thread's Redis work while Redis does not answer."""

    cap: float
    delay: float = 0.0
    until: float = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.until

    def failed(self) -> float:
        self.delay = min(max(2 * self.delay, 0.1), self.cap)
        self.until = time.monotonic() + self.delay
        return self.delay

    def succeeded(self) -> None:
        self.delay = 0.0


def _append(outbox: list[Event], event: Event, sent: int) -> None:
    """Queue an event; tokens that follow unpublished tokens join their event. While Redis
    keeps up every step is published on its own; when it falls behind, each job's pending
    tokens go out as one event, so publishing costs less per token exactly when it must.
    The first `sent` events went out in a call whose answer never came: they may be in
    Redis already under their sequence ids, so nothing joins them."""
    last = outbox[-1] if len(outbox) > sent else None
    if isinstance(event, TokenEvent) and isinstance(last, TokenEvent):
        last.token_ids = last.token_ids + event.token_ids
        last.text += event.text
        if last.logprobs is not None and event.logprobs is not None:
            last.logprobs = last.logprobs + event.logprobs
    else:
        outbox.append(event)


class Worker:
    """Drives one engine from the queues of the models it serves.

    `run()` serves until `stop()` (which any thread or a signal handler may call). Tests
    may call `run_once()` instead: one pass of intake, engine and publisher, in turn on
    the calling thread.
    """

    def __init__(
        self,
        engine: LLMEngine | Prompts,
        conn: redis.Redis,
        config: WorkerConfig | None = None,
        driver: RemoteEngine | None = None,
    ) -> None:
        # `driver`: the engine is in another process (worker/split.py), `engine` is then
        # only its prompts' rules: the intake tokenizes here, off the engine's process.
        self.prompts = engine if isinstance(engine, Prompts) else engine.prompts
        self.driver: EngineDriver | RemoteEngine
        if driver is None:
            assert not isinstance(engine, Prompts), "a worker on threads needs the engine"
            self.driver = EngineDriver(engine)
        else:
            self.driver = driver
        self.redis = conn
        self.config = c = config or WorkerConfig()
        if not c.served_names:
            raise ValueError("a worker serves at least one model name (served_names)")
        self.keys = Keys(c.namespace)
        self.scripts = Scripts(conn, self.keys, c.group, c.consumer)
        self.metrics = WorkerMetrics(c.served_names[0], lambda: self.driver.stats)
        # The value this process writes into the owner key of each job it runs: a worker
        # that finds another value there has lost the job and must stop writing to it.
        self.fence = f"{c.consumer}:{uuid.uuid4().hex[:12]}".encode()
        # Shared by the intake and publisher threads, always under the lock.
        self._lock = threading.Lock()
        self.in_flight: dict[str, InFlight] = {}
        self._settling: list[Item] = []  # entries that end without running, to publish
        # Intake thread only.
        self._replay = True  # first, own pending entries a previous process left
        self._taking = True  # until a pass sees the stop: then it logs that it takes no more
        self._turn = 0  # rotates which tenant a TAKE serves first
        self._bells = dict.fromkeys(c.served_names, b"0-0")  # last doorbell seen per model
        # The lanes the last TAKE drained, and until when that is believed without a
        # doorbell (EMPTIED_FOR_BLOCKS).
        self._emptied: tuple[bool, ...] = (False, False, False)
        self._emptied_until = 0.0
        self._next_claim = 0.0
        self._intake_backoff = Backoff(c.max_backoff_s)
        # Publisher thread only.
        self._next_heartbeat = self._next_metrics = self._next_register = 0.0
        # Set by the intake (a resync, entries read back): heartbeat before the timer says.
        self._heartbeat_at_once = False
        self._last_publish = 0.0
        self._urgent = False  # a first token or an end waits for no stream interval
        self._fresh = False  # events wait in the outboxes
        self._publish_backoff = Backoff(c.max_backoff_s)
        self._step_failures = 0
        # Either thread.
        self._resync = False  # after a Redis failure: look for entries we never heard of
        self._stop_at: float | None = None
        self._halt = threading.Event()  # the Redis threads end
        self._crash: BaseException | None = None
        self._started_at = round(time.time(), 3)
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

    def register(self) -> None:
        """Tell the fleet what this worker serves (`Client.models()`, UnknownModel) and its
        load now (the gateway's /dashboard rates its counters between heartbeats); kept
        fresh on every heartbeat, removed when the worker stops."""
        c, k = self.config, self.keys
        now = time.time()
        info = {
            "names": json.dumps(list(c.served_names)),
            "max_model_len": self.prompts.max_model_len,
            "host": socket.gethostname(),
            "pid": self.driver.pid,
            "started_at": self._started_at,
            "heartbeat_at": round(now, 3),
            **self.metrics.live(),
        }
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(k.worker(c.consumer), mapping=info)
            pipe.expire(k.worker(c.consumer), max(60, int(3 * c.registry_interval_s)))
            pipe.zadd(k.workers, {c.consumer: int(now * 1000)})
            pipe.execute()

    def _check_redis(self) -> None:
        """Refuse a server older than MIN_REDIS, or a cluster node (the scripts reach keys
        of many hash slots, named by their arguments: a cluster refuses them); warn once
        about one that evicts keys at maxmemory, which may drop a queued job, its reply, or
        the owner key that fences it, with nothing to say so (as Sidekiq and BullMQ warn).
        A server that answers neither INFO nor CONFIG (a managed one, the demo's fakeredis,
        or Redis down just now) is taken on trust."""
        try:
            info = self.redis.info()  # the default sections: server and cluster among them
        except redis.RedisError:
            info = {}
        version = str(info.get("redis_version", ""))
        found = version_tuple(version)
        message = None
        if found and found < MIN_REDIS:
            need = ".".join(map(str, MIN_REDIS))
            message = f"Redis {version} is too old: tokenq needs Redis {need} or newer"
        elif info.get("cluster_enabled"):
            message = "Redis Cluster is not supported: use a server not in cluster mode"
        if message is not None:
            self.log.error("worker not started", error=message)
            raise UnsupportedRedis(message)
        try:
            config = self.redis.config_get("maxmemory*")
        except redis.RedisError:
            return
        policy = config.get("maxmemory-policy", "noeviction")
        if policy != "noeviction" and config.get("maxmemory", "0") != "0":
            self.log.warning(
                "redis evicts keys at maxmemory: jobs can be lost",
                maxmemory=config.get("maxmemory"),
                maxmemory_policy=policy,
                fix="maxmemory-policy noeviction",
            )

    def _deregister(self) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self.keys.workers, self.config.consumer)
            pipe.delete(self.keys.worker(self.config.consumer))
            pipe.execute()

    def run(self) -> None:
        """Serve until `stop()`, then drain and hand back what did not finish. Raises
        UnsupportedRedis, before it registers, on a server it cannot run on."""
        self._check_redis()
        self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
        self._redis(self.register, self._publish_backoff)
        structlog.contextvars.bind_contextvars(consumer=self.config.consumer)
        self.log.info("worker started", models=list(self.config.served_names))
        threads = [
            threading.Thread(target=self._serve, args=(self._intake_pass,), name="tokenq-intake"),
            threading.Thread(target=self._serve, args=(self._publish_pass,), name="tokenq-publish"),
        ]
        with frozen_heap():
            for thread in threads:
                thread.start()
            try:
                while not self._drained():
                    self.driver.pump(wait=0.05)
                    if self._crash is not None:
                        raise self._crash
            finally:
                self._halt.set()
                self.driver.outputs.put(WAKE)
                for thread in threads:
                    thread.join()
                self._shutdown()
                self.metrics.close()
                self.log.info("worker stopped")

    def _serve(self, one_pass: Callable[[float], None]) -> None:
        """A Redis thread's loop. A bug must not leave the engine serving without it."""
        structlog.contextvars.bind_contextvars(consumer=self.config.consumer)
        try:
            while not self._halt.is_set():
                one_pass(self.config.block_ms / 1000)
        except BaseException as exc:
            self._crash = exc
            self._halt.set()

    def run_once(self) -> None:
        """One pass of intake, engine and publisher, on the calling thread."""
        self._intake_pass(0.0)
        self.driver.pump()
        self._publish_pass(0.0)

    def _drained(self) -> bool:
        return self._stop_at is not None and (
            not self.in_flight or time.monotonic() >= self._stop_at
        )

    def _redis(self, work: Callable[[], Any], backoff: Backoff) -> bool:
        """Run one piece of Redis work; a failure that passes (`passing`) schedules a retry
        with backoff and a resync instead of unwinding the thread. True if it ran."""
        try:
            work()
        except redis.RedisError as exc:
            if not passing(exc):
                raise
            self._resync = True
            delay = backoff.failed()
            if isinstance(exc, REDIS_ERRORS):
                self.log.warning("redis unavailable", error=str(exc), retry_in=delay)
                return False
            self.log.warning("redis refused a command", error=str(exc), retry_in=delay)
            if isinstance(exc, redis.exceptions.ReadOnlyError):
                # A failover made this server a replica: connect again, maybe to the new
                # primary (a name that moved with it).
                self.redis.connection_pool.disconnect(inuse_connections=False)
            return False
        backoff.succeeded()
        return True

    # -- intake thread ---------------------------------------------------------------------

    def _intake_pass(self, block: float) -> None:
        if not self._intake_backoff.ready():
            time.sleep(min(block, self._intake_backoff.until - time.monotonic()))
            return
        self._redis(lambda: self._intake(block), self._intake_backoff)

    def _intake(self, block: float) -> None:
        """Resync after a failure, take over orphaned entries, then take new ones."""
        names = self.config.served_names
        if self._replay:
            # A previous process with our consumer name died holding these: reading them
            # with XREADGROUP counts a delivery, as it should.
            replayed = self.scripts.own(names, replay=True)
            self._take(replayed)
            self._replay = False
            self._heartbeat_at_once |= bool(replayed)  # idle since that process died
        if self._resync:
            self._resync = False
            self._emptied_until = 0.0
            # The heartbeat that finds jobs lost while Redis was away runs on the publisher
            # thread: here it could see an entry the publisher has just settled as gone.
            self._heartbeat_at_once = True
            self._take_own_pending()
        if self.stopping:
            if self._taking:
                self._taking = False
                self.log.info("taking no more jobs")
            time.sleep(block)
            return
        now = time.monotonic()
        if now >= self._next_claim:
            self._next_claim = now + self.config.claim_interval
            self._reclaim()
        self._admit(block)

    def _slots(self) -> list[int]:
        """Entries to take now, per lane (interactive, default, batch): what the engine
        admits of each, counting lower-priority work it would preempt; none while the
        events owed to Redis pile up (Redis is slower than the engine)."""
        if self._outbox_size() + self.driver.owed >= self.config.max_outbox_events // 2:
            return [0, 0, 0]
        return list(self.driver.free_slots)

    def _admit(self, block: float) -> None:
        """Pull only what the engine admits now, in lane and priority order: the rest of
        the backlog stays in the queues for other workers. With nothing to take, wait on
        the served models' doorbells (producers ring one on every submit)."""
        c = self.config
        slots = self._slots()
        taken: list[Taken] = []
        if max(slots) > 0 and not self._all_emptied(slots):
            self._turn += 1
            waits = [int(c.lane_max_wait_s.get(lane, 0) * 1000) for lane in LANES]
            result = self.scripts.take(
                c.served_names, slots, waits, self._turn, self.fence, c.running_reply_ttl_s
            )
            taken = result.taken
            # The doorbell rings it saw are answered: the wait below is for newer ones.
            self._bells.update(result.rings)
            self._emptied = result.drained
            self._emptied_until = time.monotonic() + EMPTIED_FOR_BLOCKS * block
        if taken:
            self._take(taken)
        elif block and max(slots) > 0:
            bells = {self.keys.bell(name): last for name, last in self._bells.items()}
            started = time.monotonic()
            resp = self.redis.xread(bells, count=1, block=max(1, int(block * 1000)))
            if resp:
                self._emptied_until = 0.0  # a doorbell rang: take again
            for key, entries in resp or []:
                name = key.decode().removeprefix(self.keys.bell(""))
                self._bells[name] = entries[-1][0]
            if not resp:
                # fakeredis (the demo) answers BLOCK at once: never spin when idle.
                time.sleep(max(0.0, block - (time.monotonic() - started)))
        elif block:
            self.driver.freed.wait(block)  # full: wait for the engine to free a slot
            self.driver.freed.clear()

    def _all_emptied(self, slots: list[int]) -> bool:
        """Whether every lane with free slots was drained by the last TAKE, not long ago,
        and no doorbell has rung since (TAKE says which rings it saw): a slot freed at the
        end of a step then takes nothing (that TAKE collided with the publish of the
        step's tokens: a burst's first ones, when the burst filled the slots exactly), nor
        does a doorbell wait that ends without a ring."""
        if time.monotonic() >= self._emptied_until:
            return False
        return all(empty or n == 0 for n, empty in zip(slots, self._emptied, strict=True))

    def _reclaim(self) -> None:
        """Take over entries of workers that stopped heartbeating (this counts a delivery:
        the worker that held them is presumed dead)."""
        most = max(self._slots())
        if most <= 0:
            return
        c = self.config
        taken = self.scripts.reclaim(c.served_names, c.claim_idle_ms, most)
        for t in taken:
            if t.fields is None:
                # Redis >= 7 drops trimmed entries from the PEL itself and only reports them.
                self._reject(t, lost_payload(), mode="orphan")
        taken = [t for t in taken if t.fields is not None]
        if taken:
            self.log.info("reclaimed jobs", count=len(taken))
            self._take(taken)

    def _take_own_pending(self) -> None:
        """After a Redis failure: entries pending for this consumer that it does not know
        (their XREADGROUP or XAUTOCLAIM answer was lost), read without counting a delivery."""
        with self._lock:
            known = {inf.delivery.entry_id for inf in self.in_flight.values()}
            known |= {it.entry_id for it in self._settling}
        unknown = [
            t
            for t in self.scripts.own(self.config.served_names, replay=False)
            if t.entry_id not in known
        ]
        if unknown:
            self.log.info("took back own pending entries", count=len(unknown))
            self._take(unknown)

    def _take(self, taken: list[Taken]) -> None:
        """Parse delivered entries and start the good (START_CHUNK at a time: the first
        reach the engine before the last are parsed), then reject the bad. In that order: a
        bad entry naming the job of a good one in the same delivery then finds that job
        held (START took its owner key) and leaves its reply alone, instead of ending it
        with an error before its own entry starts it."""
        with self._lock:
            running = {inf.delivery.entry_id for inf in self.in_flight.values()}
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
                    jid = parsed.job_id
                    if jid in self.in_flight or jid in starting:
                        self._settle(self._item("settle", delivery, jid))  # a second entry
                        self._job_log(jid).info("second entry for a running job acknowledged")
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
                and rejection.job_id not in self.in_flight
            )
            self._reject(delivery, rejection, release=release)
        self.driver.prepare_texts()

    def _item(self, mode: str, delivery: Taken, job_id: str | None, **fields: Any) -> Item:
        """A PUBLISH item for an entry, with the backlog counter of its lane."""
        backlog = self._backlog(delivery)
        return Item(mode, delivery.stream, delivery.entry_id, job_id, backlog=backlog, **fields)

    def _backlog(self, delivery: Taken) -> str | None:
        """The backlog counter of the lane an entry came from (None: protocol 1's stream)."""
        queue = self.keys.parse_queue(delivery.stream.decode())
        return None if queue is None else self.keys.backlog(queue[0], lane_of(queue[1]))

    def _start(self, candidates: list[tuple[Taken, JobRequest]]) -> None:
        """Take the owner key and read what the reply stream already holds (one script):
        a worker that ran the job before either wrote before this read (and we see its
        tokens) or finds our fence in the owner key and writes nothing more. Then
        tokenize each prompt here, off the engine's thread, and hand the job over."""
        # TAKE started fresh entries' jobs itself; reclaimed and read-back ones start here.
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
                self._job_log(jid).info("duplicate delivery of a finished job")
                item = self._item("settle", delivery, jid, release=res.verdict == "start")
                self._settle(item)
            elif res.verdict == "elsewhere":
                self._job_log(jid).info("a second entry for a job running on another worker")
                self._settle(self._item("settle", delivery, jid))
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
                self._reject(delivery, late, release=True)
            else:
                next_seq = reply_seq(res.reply[-1][0]) + 1 if res.reply else 1
                add = self._prepare(delivery, job, history, next_seq)
                if add is not None:
                    adds.append(add)
        self.driver.add(adds)

    def _prepare(
        self, delivery: Taken, job: JobRequest, history: ReplyHistory, next_seq: int
    ) -> Add | None:
        """Tokenize the prompt and build the sampling parameters here, off the engine's
        thread, and book the job in flight."""
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
            self._reject(delivery, rejection, release=True)
            return None
        inf = InFlight(
            job,
            delivery,
            Continuation(history, job.params.get("logprobs") is not None),
            next_seq,
            self._backlog(delivery),
        )
        with self._lock:
            self.in_flight[jid] = inf
        self._job_log(jid).info(
            "job started",
            entry_id=delivery.entry_id.decode(),
            deliveries=delivery.count,
            resumed_tokens=len(history.token_ids),
        )
        return Add(
            jid,
            ids,
            params,
            job.priority,
            to_monotonic(enqueue_time(delivery.entry_id)),
            None if job.deadline is None else to_monotonic(job.deadline),
        )

    def _cancelled_before_start(
        self, delivery: Taken, job: JobRequest, history: ReplyHistory
    ) -> None:
        waited = max(0.0, time.time() - enqueue_time(delivery.entry_id))
        done = cancelled_before_start(history, waited, job.metadata)
        self.metrics.cancelled(job.lane)
        self._job_log(job.job_id).info("job cancelled before it started")
        events = [event_arg(done)]
        item = self._item("settle", delivery, job.job_id, status=DONE, events=events, release=True)
        self._settle(item)

    def _reject(
        self, delivery: Taken, rejection: Rejection, mode: str = "settle", release: bool = False
    ) -> None:
        """End an entry with an error, and a dead letter for poison input. `release`: this
        worker took the job for this entry (else the entry's id may belong to a job that
        runs or ended elsewhere, whose reply the PUBLISH script leaves alone)."""
        jid, eid = rejection.job_id, delivery.entry_id
        queue = self.keys.parse_queue(delivery.stream.decode())
        self.metrics.failed(rejection.code, None if queue is None else lane_of(queue[1]))
        self._job_log(jid).warning(
            "job rejected", code=rejection.code, message=rejection.message, entry_id=eid.decode()
        )
        dead = self._dead_letter(delivery, rejection) if rejection.dead_letter else None
        events = []
        if jid is not None:
            error = ErrorEvent(rejection.code, rejection.message, rejection.metadata)
            events = [event_arg(error)]
        item = self._item(
            mode, delivery, jid, status=ERROR, events=events, dead=dead, release=release
        )
        self._settle(item)

    def _dead_letter(self, delivery: Taken, rejection: Rejection) -> dict[str, Any]:
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
            "stream": delivery.stream,
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
        with self._lock:
            self._settling.append(item)
        self.driver.outputs.put(WAKE)

    # -- publisher thread ------------------------------------------------------------------

    def _publish_pass(self, wait: float) -> None:
        """Wait for engine outputs (or a settlement to send), turn them into events, and
        publish everything owed; heartbeats and metrics on their timers. Whatever happened,
        tell the engine how much more the outbox may take (`EngineView.set_room`)."""
        now = time.monotonic()
        due = min(self._next_metrics, self._next_register)
        if self.in_flight:
            heartbeat = 0.0 if self._heartbeat_at_once else self._next_heartbeat
            due = min(due, heartbeat, self._publish_due())
        self._collect_outputs(max(0.0, min(wait, due - now)))
        if self._publish_backoff.ready():
            self._publish_owed()
        else:
            time.sleep(min(wait, max(0.0, self._publish_backoff.until - time.monotonic())))
        self.driver.set_room(self.config.max_outbox_events - self._outbox_size())

    def _publish_owed(self) -> None:
        """The events owed, then heartbeats, metrics and the registry on their timers. The
        first call that fails ends the pass: each of the others would wait out the same
        silent server for a socket timeout before this thread saw a stop or new outputs."""
        now = time.monotonic()
        on_time = now >= self._publish_due()
        if self._settling or (self.in_flight and (self._urgent or on_time)):
            self._urgent = False
            self._last_publish = now
            if not self._redis(self._publish, self._publish_backoff):
                return
        now = time.monotonic()
        interval: float = self.config.heartbeat_interval_s  # type: ignore[assignment]
        if not self.in_flight:
            # A job that comes in was delivered then: its entry's first heartbeat is due an
            # interval later (one at once would cost the first step of a burst the Redis
            # side's time beside it, for entries that have been idle for a millisecond).
            self._next_heartbeat = now + interval
        elif self._heartbeat_at_once or now >= self._next_heartbeat:
            self._heartbeat_at_once = False  # before the heartbeat reads what is in flight
            self._next_heartbeat = now + interval
            if not self._redis(self._heartbeat, self._publish_backoff):
                return
        if now >= self._next_metrics:
            self._next_metrics = now + self.config.metrics_interval_s
            if not self._redis(self._publish_metrics, self._publish_backoff):
                return
        if now >= self._next_register:
            self._next_register = now + self.config.registry_interval_s
            self._redis(self.register, self._publish_backoff)

    def _publish_due(self) -> float:
        """When the next publish is due: a stream interval after the last one when events
        wait; else (the jobs in flight are between tokens: a slow step, or waiting for the
        engine) a longer one, which only asks after cancellations and ownership, counted
        from when each job was last asked that: the last publish, or its START if later
        (a publish right after START would ask again while the job's first step runs).
        Each call wakes this thread and Redis, and on a host whose cores the engine's
        threads fill, every wake-up delays a step."""
        last = self._last_publish
        if self._fresh:
            return last + self.config.stream_interval_s
        with self._lock:
            oldest = min((inf.started for inf in self.in_flight.values()), default=last)
        return max(last, oldest) + QUIET_PUBLISH_S

    def _collect_outputs(self, wait: float) -> None:
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
        inf = self.in_flight.get(out.request_id)
        if inf is None:
            return  # dropped here (taken over, handed back): nothing more to say
        events = inf.continuation.translate(out, inf.job.metadata)
        self._fresh |= bool(events)
        with self._lock:
            for event in events:
                _append(inf.outbox, event, inf.sent)
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
            inf.dead = self._dead_letter(inf.delivery, rejection)
            inf.status = ERROR
            self.metrics.failed(error.code, inf.job.lane)
            self._job_log(out.request_id).warning("job failed in the engine", message=error.message)

    def _refused(self, refused: Refused) -> None:
        with self._lock:
            inf = self.in_flight.pop(refused.job_id, None)
        if inf is None:
            return
        rejection = Rejection(
            refused.code, refused.message, refused.job_id, metadata=inf.job.metadata
        )
        self._reject(inf.delivery, rejection, release=True)

    def _failed(self, failed: Failed) -> None:
        """Every job of a step failed even alone: the device, not a job, is broken. What
        the step finished before failing still goes out; the rest is handed back."""
        self._step_failures += 1
        self.log.error("engine step failed", error=failed.error, consecutive=self._step_failures)
        for out in failed.outputs:
            self._collect(out)
        self._redis(self._publish, self._publish_backoff)
        self._redis(self._hand_back, self._publish_backoff)
        if self._step_failures >= self.config.max_step_failures:
            raise RuntimeError(
                f"{self._step_failures} engine steps failed in a row: {failed.error}"
            )

    def _outbox_size(self) -> int:
        with self._lock:
            return sum(len(inf.outbox) for inf in self.in_flight.values())

    def _publish(self) -> None:
        """Write every job's outbox and settle every finished entry in one script call,
        fenced by the owner keys; the answer also says which jobs were cancelled."""
        with self._lock:
            jobs = [(inf, list(inf.outbox), inf.status) for inf in self.in_flight.values()]
            settling = list(self._settling)
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
            )
            for inf, outbox, status in jobs
        ]
        c = self.config
        sent_at = time.monotonic()  # the TTLs the script sets count from about here
        results = self.scripts.publish(
            self.fence, items + settling, c.running_reply_ttl_s, c.reply_ttl_s, c.dead_letter_maxlen
        )
        self._fresh = False  # all that was collected went out (outputs are collected here)
        self._step_failures = 0 if jobs else self._step_failures
        finished: list[InFlight] = []
        with self._lock:
            del self._settling[: len(settling)]
            for (inf, outbox, status), (outcome, cancelled) in zip(jobs, results, strict=False):
                jid = inf.job.job_id
                assert jid is not None
                if outcome == "lost":
                    self._lose(inf)
                    continue
                inf.next_seq += len(outbox)
                del inf.outbox[: len(outbox)]
                inf.sent = 0
                if status in (DONE, ERROR):
                    del self.in_flight[jid]
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
        for item, (outcome, _) in zip(settling, results[len(jobs) :], strict=True):
            if outcome == "gone":
                self._job_log(item.job_id).info(
                    "entry was settled or reclaimed elsewhere", entry_id=item.entry_id.decode()
                )

    def _account(self, inf: InFlight) -> None:
        out = inf.output
        if out is None or out.finish_reason == "error":
            return
        self.metrics.finished(out, inf.job.lane, skipped_tokens=inf.continuation.skipped)
        m = out.metrics
        self._job_log(out.request_id).info(
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
        """Another worker took this job over (we looked dead), or Redis lost its entry (a
        restart with no persistence): stop without a trace. Called with the lock held."""
        jid = inf.job.job_id
        assert jid is not None
        self.in_flight.pop(jid, None)
        self.driver.abort(jid)
        self._job_log(jid).warning(
            "job taken over by another worker, or its entry gone from redis; dropped here"
        )

    # -- ownership -------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Reset the idle time of our entries (no delivery counted) so that other workers'
        XAUTOCLAIM leaves long jobs alone; drop jobs whose entries were taken over."""
        with self._lock:
            by_entry = {inf.delivery.entry_id: inf for inf in self.in_flight.values()}
        gone = self.scripts.keep([(i.delivery.stream, e) for e, i in by_entry.items()])
        with self._lock:
            for eid in gone:
                if by_entry[eid].job.job_id in self.in_flight:
                    self._lose(by_entry[eid])

    def _hand_back(self) -> None:
        """Stop what is in flight without acknowledging it and mark it idle, so the next
        XAUTOCLAIM of any worker takes it at once instead of after claim_idle_ms."""
        with self._lock:
            jobs, self.in_flight = list(self.in_flight.values()), {}
        if not jobs:
            return
        self.log.info("handing back unfinished jobs", jobs=[inf.job.job_id for inf in jobs])
        for inf in jobs:
            self.driver.abort(inf.job.job_id)  # type: ignore[arg-type]
        entries = [(inf.delivery.stream, inf.delivery.entry_id) for inf in jobs]
        self.scripts.keep(entries, idle_ms=self.config.claim_idle_ms)

    def _shutdown(self) -> None:
        """On the engine's thread once the Redis threads have ended: take what the engine
        still had to say, publish what is owed, hand back what did not finish."""
        self.driver.pump()
        self._collect_outputs(0.0)
        try:
            if self.in_flight or self._settling:
                self._publish()
            self._hand_back()
            self._publish_metrics()
            self._deregister()
        except redis.RedisError as exc:
            self.log.warning("redis unavailable while stopping", error=str(exc))
        self.driver.pump()  # apply the aborts of what was handed back

    # -- observability ---------------------------------------------------------------------

    def _publish_metrics(self) -> None:
        summary = self.metrics.summary()
        key = self.keys.metrics(self.config.consumer)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping={**summary, "updated_at": round(time.time(), 3)})
            pipe.expire(key, max(60, int(3 * self.config.metrics_interval_s)))
            pipe.execute()
        self.log.info("metrics", **summary)

    def _job_log(self, job_id: str | None) -> Any:
        return self.log.bind(job_id=job_id) if job_id else self.log
