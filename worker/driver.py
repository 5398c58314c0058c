"""The engine's side of a worker: one thread that only steps the engine.

The Redis threads (worker/intake.py, worker/publisher.py) reach the engine through this
driver only: requests and aborts go in as commands, applied between two steps (requests
also between two layers: `take_in`); each step's outputs come out on a queue. So the next
step never waits for Redis, and the engine is never touched by two threads at once.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenq.engine.errors import StepFailed
from tokenq.protocol.errors import InvalidRequest, describe
from tokenq.protocol.params import SamplingParams

if TYPE_CHECKING:
    from tokenq.engine.llm_engine import LLMEngine
    from tokenq.engine.outputs import EngineStats, RequestDelta


# Who turns a job's tokens into text (`Add.text_by`): the engine, or a queue process
# (worker/detokenizer.py), whose jobs' params then ask the engine for none.
ENGINE, QUEUE = "engine", "queue"


@dataclass
class Add:
    """Start a request: its prompt tokenized and its parameters validated already, off
    the engine's thread (64 requests' parameters took about 1.3 ms of it)."""

    job_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float  # time.monotonic()
    deadline: float | None  # time.monotonic()
    text_by: str = ENGINE


@dataclass
class Abort:
    job_id: str


@dataclass
class Refused:
    """The engine would not take a request (`add_request` raised)."""

    job_id: str
    code: str
    message: str


@dataclass
class Failed:
    """A step failed for every request in it (`StepFailed`): the engine, not a job, is
    broken. `outputs`: what the step had finished before (deadlines), still owed;
    `dropped`: the requests the engine then dropped, without an output (the Redis side
    hands their jobs back)."""

    outputs: list[RequestDelta]
    error: str
    dropped: list[str]


Output = list["RequestDelta"] | Refused | Failed


def weight(output: object) -> int:
    """What an item of the outputs queue counts towards the bound on what is owed: its
    deltas, or one for a refusal or a failure; the Redis side's own wake-ups nothing."""
    if isinstance(output, list):
        return len(output)
    return 1 if isinstance(output, (Refused, Failed)) else 0


@dataclass(frozen=True)
class Snapshot:
    """What the Redis side reads of the engine, taken between two steps."""

    free: int  # requests it could admit now
    free_by_lane: tuple[int, int, int]  # interactive, default, batch: see free_slots
    stats: EngineStats
    applied: int  # Add commands applied so far

    @classmethod
    def of(cls, engine: LLMEngine, applied: int) -> Snapshot:
        free, *lanes = engine.free_capacities((None, -1, 0, 1))
        return cls(free, tuple(lanes), engine.stats(), applied)  # type: ignore[arg-type]


class EngineView:
    """The engine as the Redis side sees it: the latest snapshot, requests sent to it and
    not applied yet, and an event for freed slots. Shared by the driver in the engine's
    process and its stand-in in a queue process (worker/remote.py)."""

    def __init__(self, state: Snapshot) -> None:
        self.state = state  # replaced whole, never mutated
        self._sent = 0  # Add commands sent; state.applied of them applied
        self.freed = threading.Event()  # set whenever a step or an abort frees a slot
        # The bound on what is owed to Redis (WorkerConfig.max_outbox_events), kept where
        # the outputs come out, so that it holds while the publisher waits on Redis: `room`
        # is the outbox's free space as of the publisher's last pass; `queued` and
        # `collected` count the deltas put on the outputs queue (by its one writer) and
        # taken off it (by the publisher). No step runs while they fill that room.
        self.room: float = math.inf
        self.queued = 0
        self.collected = 0

    @property
    def owed(self) -> int:
        """Deltas on the outputs queue that the publisher has not taken yet."""
        return self.queued - self.collected

    @property
    def backed_up(self) -> bool:
        return self.owed >= self.room

    def set_room(self, room: float) -> None:
        """From the publisher, after each pass."""
        self.room = room

    @property
    def stats(self) -> EngineStats:
        return self.state.stats

    @property
    def free_slots(self) -> tuple[int, int, int]:
        """Requests the engine could admit now, less those sent but not applied yet, per
        lane (interactive, default, batch): a lane may also use the slots of lower-priority
        work the engine would preempt for it."""
        pending = self._sent - self.state.applied
        return tuple(max(0, free - pending) for free in self.state.free_by_lane)  # type: ignore[return-value]

    def text_by(self, params: SamplingParams) -> str:
        """Who makes a job's text: here, the engine."""
        return ENGINE

    def prepare_texts(self) -> None:
        """Once a delivery is sent: a queue process prepares the text of those jobs' first
        tokens (worker/detokenizer.py). Here the engine makes the text."""

    def _update(self, state: Snapshot) -> None:
        before, self.state = self.state, state
        if state.free > before.free or state.free_by_lane[0] > 0:
            self.freed.set()


class EngineDriver(EngineView):
    """Owns the engine. `pump()` runs on one thread (the process's main thread under
    `tokenq worker`: torch is measurably slower in a secondary one); `add`, `abort`, the
    `outputs` queue and the snapshot attributes are for the other threads."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(Snapshot.of(engine, 0))
        self.engine = engine
        self.pid = os.getpid()  # the engine's process: what an operator signals
        self._commands: queue.SimpleQueue[list[Add] | Abort] = queue.SimpleQueue()
        self.outputs: queue.SimpleQueue[Output] = queue.SimpleQueue()
        self._applied = 0
        # Set by a queue process while it cannot publish fast enough (its own `room`: the
        # two-process host), as `backed_up` is here: no step runs.
        self.paused = False
        self._held: list[Abort] = []  # came during a pass: applied after it
        # What a step calls between two layers; the two-process host wraps it.
        self.between_layers: Callable[[], bool] = self.take_in
        # Snapshot after every step and every batch of commands, for Redis threads that
        # read `state` at any time. The two-process host turns this off and snapshots only
        # when it writes the pipe: a snapshot took 60 us of the engine's thread (a tiny
        # model's 64 jobs), every step, for a view the queue process sees only then.
        self.snapshot_each_step = True

    @property
    def applied(self) -> int:
        """Add commands applied so far (`state.applied` as of the latest snapshot)."""
        return self._applied

    def add(self, commands: list[Add]) -> None:
        """Start requests; those sent together are applied together, so one step can
        prefill them all (as a batch submitted straight to the engine would be)."""
        self._sent += len(commands)
        self._commands.put(commands)

    def abort(self, job_id: str) -> None:
        self._commands.put(Abort(job_id))

    def pump(self, wait: float = 0.0) -> bool:
        """Apply waiting commands, then run one step if the engine holds work. With no
        work, wait up to `wait` seconds for a command first. True if a step ran."""
        held = self.paused or self.backed_up
        idle = held or not self.engine.has_unfinished()
        if self._apply(wait if idle else 0.0) and self.snapshot_each_step:
            self.snapshot()  # else nothing changed since the last step's
        stepped = False
        if self.engine.has_unfinished() and not held:
            stepped = True
            try:
                outputs = self.engine.step(self.between_layers)
            except StepFailed as exc:
                error = describe(exc.__cause__ or exc)
                dropped = list(self.engine.requests)
                for job_id in dropped:
                    self.engine.abort(job_id)  # handed back by the Redis side
                self._put(Failed(list(exc.outputs), error, dropped))
            else:
                if outputs:
                    self._put(outputs)
            if self.snapshot_each_step:
                self.snapshot()
        return stepped

    def take_in(self) -> bool:
        """Between two layers: start the requests sent meanwhile, with a step ahead for those
        that outrank the step in flight (their first token waits a layer, not a step).
        Aborts wait for the pass, which writes its requests' blocks. True if one ran."""
        added = False
        while not self._commands.empty():
            command = self._commands.get_nowait()
            if isinstance(command, Abort):
                self._held.append(command)
            else:
                self._add(command)
                added = True
        if not added:
            return False
        outputs = self.engine.step_ahead()
        if outputs:
            self._put(outputs)
        if self.snapshot_each_step:
            self.snapshot()
        return bool(outputs)

    def _apply(self, wait: float) -> bool:
        """Apply the commands sent; True if there were any."""
        deadline = time.monotonic() + wait
        applied = bool(self._held)
        for command in self._held:
            self._abort(command)
        self._held.clear()
        while True:
            try:
                left = deadline - time.monotonic()
                if left > 0:
                    command = self._commands.get(timeout=left)
                else:
                    command = self._commands.get_nowait()
            except queue.Empty:
                return applied
            applied = True
            if isinstance(command, Abort):
                self._abort(command)
            else:
                self._add(command)
            wait = 0.0  # once something came, take only what is already there
            deadline = time.monotonic()

    def _add(self, command: list[Add]) -> None:
        for add in command:
            self._applied += 1
            self._start(add)

    def _abort(self, command: Abort) -> None:
        out = self.engine.abort(command.job_id)
        if out is not None:
            self._put([out])

    def _start(self, add: Add) -> None:
        try:
            self.engine.add_request(
                add.job_id,
                prompt_token_ids=add.prompt_token_ids,
                params=add.params,
                priority=add.priority,
                arrival_time=add.arrival_time,
                deadline=add.deadline,
            )
        except InvalidRequest as exc:
            self._put(Refused(add.job_id, exc.code, exc.message))
        except Exception as exc:  # the engine must not take the worker down for one job
            self._put(Refused(add.job_id, "internal_error", describe(exc)))

    def _put(self, output: Output) -> None:
        self.queued += weight(output)
        self.outputs.put(output)

    def snapshot(self) -> None:
        self._update(Snapshot.of(self.engine, self._applied))
