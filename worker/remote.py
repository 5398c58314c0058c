"""The queue process of a two-process worker: a `Worker` whose engine is across a pipe.

`RemoteEngine` stands where the `EngineDriver` would: a thread of its own reads the pipe
into the outputs queue the publisher reads, filling in the text of the jobs whose text is
made here (worker/detokenizer.py); intake and publisher send their commands back. When the
engine's process dies, the worker publishes what it had, hands back its jobs and exits.
Signals go to the engine's process only, which passes `stop` on (worker/host.py).
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tokenq.protocol.params import SamplingParams
from tokenq.worker.config import WorkerConfig, connect
from tokenq.worker.detokenizer import Detokenizing, text_side
from tokenq.worker.driver import Abort, Add, EngineView, Snapshot, weight
from tokenq.worker.logs import LogSettings, configure_logging
from tokenq.worker.pipe import READY, Pause, Stop, from_wire
from tokenq.worker.worker import UnsupportedRedis, Worker

if TYPE_CHECKING:
    from tokenq.engine.prompts import Prompts
    from tokenq.engine.tokenizer import Tokenizer


class EngineGone(Exception):
    """The engine's process ended: nothing more will come from it."""


class RemoteEngine(EngineView):
    """What `Worker` calls on its driver, over the pipe. The reader thread reads the pipe
    all the time and never writes: were both ends writing into full pipes with neither
    reading, the two processes would wait on each other for good."""

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

    def text_by(self, params: SamplingParams) -> str:
        return text_side(params)

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
        """The latest pause state, unless the engine has it (two threads send it)."""
        with self._send_lock:
            if self._paused != self._told_paused:
                self._told_paused = self._paused
                self._send_locked(Pause(self._paused))

    def _send(self, command: Any) -> None:
        """Dropped once the engine's process is gone (its jobs are handed back then)."""
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
                        output = [from_wire(f) for f in output]
                    output = self.texts.output(output)
                    self.queued += weight(output)
                    self.outputs.put(output)
                self._update(state)
                self._pause_if_backed_up(reader=True)
        except (EOFError, OSError):
            self._gone.set()
            self.freed.set()  # an intake waiting for a slot sees the end at once

    def pump(self, wait: float = 0.0) -> bool:
        """The engine's process steps on its own: wait up to `wait` for it to end, and
        raise `EngineGone` (once) when it has."""
        if self._told or not self._gone.wait(wait):
            return False
        self._told = True
        raise EngineGone("the engine's process ended")


def serve_queue(
    conn: Connection,
    prompts: Prompts,
    state: Snapshot,
    engine_pid: int,
    redis_url: str,
    config: WorkerConfig,
    logs: LogSettings,
) -> None:
    """The queue process's main (spawned by `EngineHost.start`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ctrl-C counts once
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
