"""A worker in two processes: the engine in one, everything Redis in the other.

On threads (worker/loop.py) the Redis side never makes the engine wait for Redis, but it
still shares the engine's interpreter lock: building script arguments, translating outputs
into events and parsing replies is Python, and every millisecond of it is a millisecond
the engine's Python (scheduling, sampling, detokenizing) cannot run. With a fast step
(a tiny model, or a GPU) that is the loss that remains. Here the Redis side is the same
`Worker`, run in a process of its own (spawned, never forked: CUDA does not survive a
fork), and the engine's process only steps:

- the engine's process (`EngineHost.run`, the main thread of `tokenq worker`) applies
  the commands that came over the pipe (requests, aborts, pause), runs one step with the
  `EngineDriver`, and sends the step's outputs with a snapshot of the engine's capacity.
  It writes them itself, between two steps: a thread that wrote them while the next step
  ran took the interpreter lock from that step, and the steps ran longer by more than
  the write costs (docs/performance.md). A write costs about 0.14 ms (it wakes the
  queue process's reader), so running jobs' tokens go at most once a stream interval;
  first tokens, ends and a change in what the engine admits go at once (`_due`). A write
  waits only if the reader, a thread that does nothing else, is some 40 writes behind
  (the socket's buffer);
- the queue process runs `Worker.run` with a `RemoteEngine` where the driver would be:
  a thread of its own reads the pipe into the outputs queue the publisher reads, and
  intake and publisher send their commands back. It also turns token ids into text for
  every job without stop strings (`Detokenizing`), so the engine's steps do not.

Lifetimes are tied by the pipe: when the queue process ends (drained, or crashed) the
engine's process sees the pipe close and exits with its code; when the engine's process
dies, the queue process publishes what it had received, hands back the jobs in flight
(idle at once, for any worker's next XAUTOCLAIM) and exits. Signals go to the engine's
process only (the queue process ignores SIGINT and SIGTERM, so a terminal's ctrl-C,
which reaches both, counts once); it passes `stop` on.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import redis
import structlog

from tokenq.engine.output_processor import IncrementalDetokenizer
from tokenq.engine.outputs import RequestDelta
from tokenq.engine.sequence import RequestMetrics
from tokenq.protocol.connection import keepalive_for
from tokenq.protocol.errors import describe
from tokenq.worker.config import REDIS_SIDES, WorkerConfig
from tokenq.worker.driver import (
    Abort,
    Add,
    EngineDriver,
    EngineView,
    Failed,
    Output,
    Refused,
    Snapshot,
    weight,
)
from tokenq.worker.heap import frozen_heap
from tokenq.worker.logs import configure_logging

if TYPE_CHECKING:
    from tokenq.engine.llm_engine import LLMEngine
    from tokenq.engine.prompts import Prompts
    from tokenq.engine.tokenizer import Tokenizer
    from tokenq.worker.loop import Worker

START_TIMEOUT_S = 120.0  # spawning imports redis-py, structlog and the tokenizer


class EngineGone(Exception):
    """The engine's process ended: nothing more will come from it."""


@dataclass
class Pause:
    """The Redis side owes Redis too many events: no step until it says otherwise."""

    paused: bool


@dataclass
class Stop:
    """Stop taking jobs; give in-flight ones `grace` seconds (None: the configured)."""

    grace: float | None


READY = "ready"  # the queue process's first message: its worker is built


@dataclass
class LogSettings:
    json: bool = True
    level: str = "info"


class EngineHost:
    """The engine's process of a two-process worker. `start()` spawns the queue process
    and waits until it is ready; `run()` steps the engine until that process ends and
    returns its exit code; `stop()` may be called from a signal handler or any thread."""

    def __init__(
        self,
        engine: LLMEngine,
        redis_url: str,
        config: WorkerConfig,
        logs: LogSettings | None = None,
    ) -> None:
        self.engine = engine
        self.driver = EngineDriver(engine)
        self.driver.between_layers = self._between_layers
        self.driver.snapshot_each_step = False  # taken by `_send`
        self.redis_url = redis_url
        self.config = config
        self.logs = logs or LogSettings()
        self._stops: list[float | None] = []  # appended by stop(), sent by run()
        self._conn: Connection | None = None
        self._readable: _Readable | None = None  # while run() runs
        # Outputs not sent yet, the snapshot last sent and when (see `_due`).
        self._held: list[Any] = []
        self._last: Snapshot | None = None
        self._sent_at = 0.0
        self._process: multiprocessing.process.BaseProcess | None = None
        self.log = structlog.get_logger("tokenq.worker")

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        args = (
            theirs,
            self.engine.prompts,
            self.driver.state,
            os.getpid(),
            self.redis_url,
            self.config,
            self.logs,
        )
        self._process = ctx.Process(target=serve_queue, args=args, name="tokenq-queue")
        self._process.start()
        theirs.close()
        self._conn = ours
        try:
            if not ours.poll(START_TIMEOUT_S) or ours.recv() != READY:
                raise EOFError
        except (EOFError, OSError):
            self._process.kill()  # if it hangs rather than failed
            self._process.join(timeout=5)
            raise RuntimeError(
                f"the queue process did not start (exit code {self._process.exitcode})"
            ) from None

    def stop(self, grace: float | None = None) -> None:
        """As `Worker.stop`: sent to the queue process by the next pass of `run()`."""
        self._stops.append(grace)

    @property
    def stopping(self) -> bool:
        return bool(self._stops)

    @property
    def queue_pid(self) -> int | None:
        """The queue process's pid, once started."""
        return None if self._process is None else self._process.pid

    def run(self) -> int:
        """Step until the queue process ends; its exit code."""
        if self._conn is None:
            self.start()
        assert self._conn is not None and self._process is not None
        conn, driver = self._conn, self.driver
        self._readable = readable = _Readable(conn)
        sent_stops = 0
        with frozen_heap():
            try:
                while True:
                    while sent_stops < len(self._stops):
                        conn.send(Stop(self._stops[sent_stops]))
                        sent_stops += 1
                    idle = driver.paused or not self.engine.has_unfinished()
                    if readable(0.05 if idle else 0.0):
                        self._receive(conn)
                    driver.pump()
                    outputs = _drain(driver)
                    self._held += outputs
                    if self._due(outputs):
                        self._send(conn)
            except (EOFError, OSError):
                pass  # the queue process ended: it has published and handed back what it held
            finally:
                # Also when this process fails: the closed pipe ends the queue process, which
                # hands its jobs back (else the two would wait on each other at exit).
                conn.close()
                self._process.join()
        code = self._process.exitcode or 0
        if code:
            # Negative: killed by that signal. Its jobs wait for a worker's XAUTOCLAIM.
            self.log.error("the queue process failed", exit_code=code)
        return code if code >= 0 else 1

    def _between_layers(self) -> bool:
        """The driver's `take_in`, with what came over the pipe since the step began, and
        its step ahead's outputs sent at once: that first token is what it ran for."""
        conn, readable = self._conn, self._readable
        assert conn is not None and readable is not None
        try:
            if readable(0):
                self._receive(conn)
            ran = self.driver.take_in()
            if ran:
                self._held += _drain(self.driver)
                self._send(conn)
        except (EOFError, OSError):
            return False  # the queue process ended: run() sees it after this step
        return ran

    def _due(self, outputs: list[Any]) -> bool:
        """Whether to send what the steps since the last send produced (`outputs`: the
        latest step's, the only ones not looked at yet; the earlier ones were not urgent).
        Each write wakes the queue process's reader and costs this thread about 0.14 ms on
        a VM, more than a tiny model's step takes to decode one token for a few jobs, so
        running jobs' tokens are sent at most once a stream interval (the queue process
        publishes them no more often). At once: a first token, an end, a refusal or
        failure, requests applied (what the engine admits changed), and everything before
        the engine idles. Capacity that changes otherwise (blocks filling as replies grow,
        a preemption) goes with the next send: the queue process may then take a job the
        engine holds as waiting for a moment, never one it cannot hold."""
        last, applied = self._last, self.driver.applied
        if not self._held and last is not None and applied == last.applied:
            return False
        if (
            time.monotonic() - self._sent_at >= self.config.stream_interval_s
            or last is None
            or applied != last.applied
            or self.driver.paused
            or not self.engine.has_unfinished()
        ):
            return True
        return any(
            not isinstance(output, list)
            or any(d.finished or d.completion_tokens == len(d.new_token_ids) for d in output)
            for output in outputs
        )

    def _send(self, conn: Connection) -> None:
        """The outputs held, in the order the engine made them, and a snapshot."""
        self.driver.snapshot()
        self._last = state = self.driver.state
        conn.send((_wire(self._held), state))
        self._held = []
        self._sent_at = time.monotonic()

    def _receive(self, conn: Connection) -> None:
        """Take every command waiting in the pipe (the driver applies them before its
        next step)."""
        readable = self._readable
        assert readable is not None
        while True:
            command = conn.recv()
            if isinstance(command, Pause):
                self.driver.paused = command.paused
            elif isinstance(command, Abort):
                self.driver.abort(command.job_id)
            else:
                self.driver.add(command)
            if not readable(0):
                return


class _Readable:
    """Whether a message waits in the pipe, from one poll object registered once:
    `Connection.poll` builds and closes a selector on every call, which took 70 us of
    the gap between two steps (median, a queue run of the tiny model)."""

    def __init__(self, conn: Connection) -> None:
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLIN)

    def __call__(self, timeout: float) -> bool:
        """Also true once the pipe has closed: the `recv` that follows raises EOFError."""
        return bool(self._poll.poll(timeout * 1000))


def _drain(driver: EngineDriver) -> list[Any]:
    """The outputs the driver has queued (the engine no longer touches them)."""
    outputs: list[Any] = []
    while not driver.outputs.empty():
        outputs.append(driver.outputs.get_nowait())
    return outputs


def _wire(outputs: list[Any]) -> list[Any]:
    """Outputs as they cross the pipe: each step's deltas as tuples of their fields
    (pickled at C speed, where a dataclass costs a reduce call each), a running request's
    without its metrics (their token times grow by one each step: pickling them every
    step would cost the engine's process time quadratic in a reply's length). The final
    delta carries them, for the timings and latencies observed when a job ends."""
    return [
        [_delta_fields(d) for d in output] if isinstance(output, list) else output
        for output in outputs
    ]


def _delta_fields(d: RequestDelta) -> tuple[Any, ...]:
    metrics = d.metrics if d.finished else None
    return (
        d.request_id, d.new_token_ids, d.new_text, d.finished, d.finish_reason,
        d.prompt_tokens, d.completion_tokens, metrics, d.logprobs, d.text, d.token_ids,
        d.error,
    )  # fmt: skip


# A running request's delta in the queue process: its metrics stay in the engine's process.
NOT_SENT = RequestMetrics(arrival=0.0)


def _delta(fields: tuple[Any, ...]) -> RequestDelta:
    delta = RequestDelta(*fields)
    if delta.metrics is None:
        delta.metrics = NOT_SENT
    return delta


class Detokenizing:
    """The text of a queue process's jobs, made there from the token ids the engine sends
    (vLLM v1 splits its engine so too): a token's text cost the engine's thread about
    5 us, 9% of a tiny model's step for 64 jobs, which the queue process pays instead,
    beside the next step. A job with stop strings keeps its text in the engine, which
    must see a stop string to end the job there. The deltas come out as the engine would
    have made them: the same incremental detokenizer, and an end flushed unless it is an
    error (the engine's own rule)."""

    def __init__(self, tokenizer: Tokenizer, abort: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self._abort = abort  # ends in the engine a job whose text failed here
        # By job id; None: its text failed, and its outputs until its end are dropped.
        self._jobs: dict[str, IncrementalDetokenizer | None] = {}
        self._unprepared: list[IncrementalDetokenizer] = []  # taken, not prepared yet
        self._lock = threading.Lock()  # the intake prepares what the reader pushes

    def take(self, add: Add) -> None:
        """Before `add` is sent: decode its tokens here, unless it needs text in the engine
        (stop strings) or wants none."""
        params = add.params
        if params.detokenize and not params.stop:
            params.detokenize = False
            detokenizer = IncrementalDetokenizer(self.tokenizer, add.prompt_token_ids)
            self._jobs[add.job_id] = detokenizer
            self._unprepared.append(detokenizer)

    def prepare(self) -> None:
        """Decode the prompts' tails of the jobs taken since the last call, on the intake's
        thread once their delivery is all sent, while the engine runs their first step: the
        reader gets a burst's first tokens all at once, and each would wait for its job's."""
        unprepared, self._unprepared = self._unprepared, []
        for detokenizer in unprepared:
            with self._lock:  # one at a time: the reader may need the lock meanwhile
                try:
                    detokenizer.prepare()
                except Exception:  # noqa: S110 - its first push fails alike, and ends that job
                    pass

    def output(self, output: Output) -> Output:
        """An engine output with its text; a job's end forgets it."""
        with self._lock:
            return self._output(output)

    def _output(self, output: Output) -> Output:
        if isinstance(output, list):
            return [filled for d in output if (filled := self._fill(d)) is not None]
        if isinstance(output, Refused):
            self._jobs.pop(output.job_id, None)
        elif isinstance(output, Failed):
            output.outputs = self._output(output.outputs)  # type: ignore[assignment]
            for job_id in output.dropped:
                self._jobs.pop(job_id, None)
        return output

    def _fill(self, delta: RequestDelta) -> RequestDelta | None:
        jid = delta.request_id
        if jid not in self._jobs:
            return delta  # the engine made its text, or none was wanted
        detokenizer = self._jobs[jid]
        if delta.finished:
            del self._jobs[jid]
        if detokenizer is None:
            return None
        try:
            new_text = detokenizer.push(delta.new_token_ids)
            if delta.finished and delta.finish_reason != "error":
                new_text += detokenizer.flush()
        except Exception as exc:  # as in the engine: this job ends alone, with an error
            return self._failed(delta, detokenizer, exc)
        delta.new_text = new_text
        if delta.finished:
            delta.text = detokenizer.text
        return delta

    def _failed(
        self, delta: RequestDelta, detokenizer: IncrementalDetokenizer, exc: Exception
    ) -> RequestDelta:
        jid = delta.request_id
        if not delta.finished:
            self._jobs[jid] = None
            self._abort(jid)
        error = describe(exc)  # the message the engine gives a job that fails alone
        structlog.get_logger("tokenq.worker").warning(
            "decoding a job's tokens failed", job_id=jid, error=error
        )
        return replace(
            delta,
            new_text="",
            finished=True,
            finish_reason="error",
            logprobs=None,
            text=detokenizer.text,
            token_ids=None,
            error=error,
        )


class RemoteEngine(EngineView):
    """The queue process's stand-in for the `EngineDriver`: what `Worker` calls on its
    driver, over the pipe to the engine's process.

    A thread of its own reads the pipe all the time, whatever the worker's threads are
    doing (shutting down included): were both ends ever writing into full pipes with
    neither reading, the two processes would wait on each other for good."""

    def __init__(self, conn: Connection, state: Snapshot, pid: int, tokenizer: Tokenizer) -> None:
        super().__init__(state)
        self.pid = pid
        self._conn = conn
        # Its aborts go from a thread of their own: the reader must never write (above).
        self.texts = Detokenizing(
            tokenizer, lambda jid: threading.Thread(target=self.abort, args=(jid,)).start()
        )
        self._send_lock = threading.Lock()  # intake, publisher and shutdown all send
        self.outputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pause_lock = threading.Lock()
        self._paused = False  # what backed_up said last
        self._told_paused = False  # what the engine was told last
        self.on_stop: Callable[[float | None], None] = lambda grace: None  # Worker.stop
        self._gone = threading.Event()  # the pipe closed: the engine's process ended
        self._told = False  # EngineGone raised
        self._reader = threading.Thread(target=self._read, name="tokenq-pipe", daemon=True)
        self._reader.start()

    def add(self, commands: list[Add]) -> None:
        if commands:
            for add in commands:
                self.texts.take(add)
            self._sent += len(commands)
            self._send(commands)

    def abort(self, job_id: str) -> None:
        self._send(Abort(job_id))

    def prepare_texts(self) -> None:
        self.texts.prepare()

    def set_room(self, room: float) -> None:
        super().set_room(room)
        self._pause_if_backed_up()

    def _pause_if_backed_up(self, reader: bool = False) -> None:
        """Pause the engine while what is owed fills the room, resume it once not; from
        the publisher, as it sets the room, and from the reader, as outputs come in."""
        with self._pause_lock:  # each thread decides on the other's latest counts
            backed_up = self.backed_up
            if backed_up == self._paused:
                return
            self._paused = backed_up
        if reader:
            threading.Thread(target=self._send_pause).start()  # the reader never writes
        else:
            self._send_pause()

    def _send_pause(self) -> None:
        """The latest pause state, unless the engine has it: sent from two threads, the
        last send is never an older state."""
        with self._send_lock:
            if self._paused != self._told_paused:
                self._told_paused = self._paused
                self._send_locked(Pause(self._paused))

    def _send(self, command: Any) -> None:
        """A command for the engine; dropped once its process is gone (the jobs it was
        about are handed back then)."""
        with self._send_lock:
            self._send_locked(command)

    def _send_locked(self, command: Any) -> None:
        if self._gone.is_set():
            return
        try:
            self._conn.send(command)
        except OSError:
            self._gone.set()

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, Stop):
                    self.on_stop(message.grace)
                    continue
                outputs, state = message
                for output in outputs:
                    if isinstance(output, list):
                        output = [_delta(f) for f in output]
                    output = self.texts.output(output)
                    self.queued += weight(output)
                    self.outputs.put(output)
                self._update(state)
                self._pause_if_backed_up(reader=True)
        except (EOFError, OSError):
            self._gone.set()
            self.freed.set()  # an intake waiting for a slot sees the end at once

    def pump(self, wait: float = 0.0) -> bool:
        """The engine's process steps on its own: this only waits up to `wait` for it to
        end, and raises `EngineGone` (once) when it has."""
        if self._told or not self._gone.wait(wait):
            return False
        self._told = True
        raise EngineGone("the engine's process ended")


def own_process_pays(engine: LLMEngine) -> bool:
    """Whether the Redis side runs faster beside the engine in a process of its own than
    on threads of the engine's process: yes where the engine computes on a device, or on
    CPU cores it leaves free. Where torch's threads fill every core the process adds one
    more thing to schedule on them, and the threads measured better (docs/performance.md:
    the default model on 2 cores at 2 threads, 0.97-1.00 on threads against 0.95-0.96)."""
    if engine.device.type != "cpu":
        return True
    import torch

    return torch.get_num_threads() < len(os.sched_getaffinity(0))


def make_worker(
    engine: LLMEngine,
    redis_url: str,
    config: WorkerConfig,
    side: str = "auto",
    logs: LogSettings | None = None,
) -> Worker | EngineHost:
    """The worker `tokenq worker --redis-side` runs: an `EngineHost` whose queue process
    is started ("process"), or a `Worker` on threads ("threads"); "auto" asks
    `own_process_pays`. Either has `run()` (to call on the main thread), `stop()` and
    `stopping`."""
    from tokenq.worker.loop import Worker

    if side not in REDIS_SIDES:
        raise ValueError(f"the Redis side runs in one of {REDIS_SIDES}, not {side!r}")
    if side == "process" or (side == "auto" and own_process_pays(engine)):
        host = EngineHost(engine, redis_url, config, logs)
        host.start()
        return host
    return Worker(engine, connect(redis_url, config), config)


def connect(redis_url: str, config: WorkerConfig) -> redis.Redis:
    """The worker's connection, in whichever process its Redis side runs. Every read has
    a timeout, past its longest block, so that a Redis that stops answering is waited
    out with backoff like one that refuses (redis-py before 8 waits forever by default)."""
    return redis.Redis.from_url(
        redis_url,
        socket_connect_timeout=5,
        socket_timeout=5 + config.block_ms / 1000,
        **keepalive_for(redis_url),
    )


def serve_queue(
    conn: Connection,
    prompts: Prompts,
    state: Snapshot,
    engine_pid: int,
    redis_url: str,
    config: WorkerConfig,
    logs: LogSettings,
) -> None:
    """The queue process: a `Worker` whose engine is across the pipe."""
    from tokenq.worker.loop import UnsupportedRedis, Worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(json=logs.json, level=logs.level)
    engine = RemoteEngine(conn, state, engine_pid, prompts.tokenizer)
    worker = Worker(prompts, connect(redis_url, config), config, driver=engine)
    engine.on_stop = worker.stop
    conn.send(READY)
    try:
        worker.run()
    except EngineGone:
        worker.log.error("the engine's process ended; its jobs were handed back")
        raise SystemExit(1) from None
    except UnsupportedRedis:
        raise SystemExit(1) from None  # logged
