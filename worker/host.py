"""A worker in two processes: the engine in one, everything Redis in the other.

On threads (worker/worker.py) the Redis side still shares the engine's interpreter lock:
every millisecond of its Python is one the engine's Python cannot run, the loss that
remains with a fast step (a tiny model, a GPU). Here the same `Worker` runs in a queue
process of its own (worker/remote.py; spawned, never forked: CUDA does not survive a
fork), and the engine's process only steps.

`EngineHost.run` (the main thread of `tokenq worker`) applies what came over the pipe,
steps with the `EngineDriver`, and writes the outputs itself between two steps: a writer
thread took the interpreter lock from the next step, which ran longer by more than the
write costs (docs/performance.md). Lifetimes are tied by the pipe: when either process
ends, the other sees it close; the queue process then hands its jobs back.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import structlog

from tokenq.worker.config import REDIS_SIDES, WorkerConfig, connect
from tokenq.worker.driver import Abort, EngineDriver, Snapshot
from tokenq.worker.heap import frozen_heap
from tokenq.worker.logs import LogSettings
from tokenq.worker.pipe import READY, Pause, Stop, to_wire
from tokenq.worker.remote import serve_queue
from tokenq.worker.worker import Worker

if TYPE_CHECKING:
    from tokenq.engine.llm_engine import LLMEngine

START_TIMEOUT_S = 120.0  # spawning imports redis-py, structlog and the tokenizer


class EngineHost:
    """The engine's process. `start()` spawns the queue process and waits until it is
    ready; `run()` steps until that process ends and returns its exit code; `stop()` may
    be called from a signal handler or any thread."""

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
        """Whether to send what the steps since the last send made (`outputs`: the latest
        step's). A write costs about 0.14 ms, more than a tiny model's step: running jobs'
        tokens go once a stream interval; first tokens, ends, refusals, failures, a change
        in what the engine admits and all before it idles go at once."""
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
        conn.send((to_wire(self._held), state))
        self._held = []
        self._sent_at = time.monotonic()

    def _receive(self, conn: Connection) -> None:
        """Every command waiting in the pipe, for the driver to apply before its next step."""
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
    `Connection.poll` builds a selector per call, 70 us of the gap between two steps."""

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


def own_process_pays(engine: LLMEngine) -> bool:
    """Whether the Redis side runs faster in a process of its own: where the engine
    computes on a device or leaves CPU cores free. Where torch's threads fill every core,
    threads measured better (docs/performance.md: the default model on 2 cores)."""
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
    """What `tokenq worker --redis-side` runs: an `EngineHost` with its queue process
    started ("process"), or a `Worker` on threads ("threads"); "auto" asks
    `own_process_pays`. Either has `run()` (on the main thread), `stop()` and `stopping`."""
    if side not in REDIS_SIDES:
        raise ValueError(f"the Redis side runs in one of {REDIS_SIDES}, not {side!r}")
    if side == "process" or (side == "auto" and own_process_pays(engine)):
        host = EngineHost(engine, redis_url, config, logs)
        host.start()
        return host
    return Worker(engine, connect(redis_url, config), config)
