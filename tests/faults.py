"""Fault injection for the durability tests (this module holds no tests).

- `RedisServer`: a private `redis-server` on a free port, with AOF, that a test may restart,
  kill or freeze (SIGSTOP) without touching any other server.
- `TcpProxy`: sits between a client and Redis and can cut the connection right after Redis
  answered a chosen command (the command was applied, the client never hears so), or hold
  every reply for a while (a stall past the client's socket timeout).
- `WorkerProcess`: `tokenq worker` as a subprocess, for faults that kill or stop a process.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis

from tokenq.producer.client import Client


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A throwaway redis-server with `appendfsync always`, so a restart or a kill -9 loses
    no acknowledged write (what a production AOF setup promises within a second)."""

    def __init__(
        self, workdir: Path, aof: bool = True, unix_socket: bool = False, cluster: bool = False
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.binary = binary
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.aof = aof
        # Also listening on a socket file (its path must fit a sun_path: 107 bytes).
        self.socket = self.workdir / "redis.sock" if unix_socket else None
        self.cluster = cluster  # a cluster node (holding no slots yet)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.socket is not None, "started without unix_socket"
        return f"unix://{self.socket}?db=0"

    def start(self) -> None:
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.aof else "no",
            "--appendfsync", "always",
            "--enable-debug-command", "yes",  # DEBUG SLEEP: Redis stalls on request
        ]  # fmt: skip
        if self.socket is not None:
            cmd += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        if self.cluster:
            # Its bus port: port + 10000 by default, past 65535 for a high free port.
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            cmd += ["--cluster-port", str(free_port())]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)

    def answers(self) -> bool:
        try:
            conn = redis.Redis(port=self.port, socket_connect_timeout=0.3, socket_timeout=0.3)
            try:
                return bool(conn.ping())
            finally:
                conn.close()
        except redis.RedisError:
            return False

    def stop(self, kill: bool = False) -> None:
        """Stop the server (SIGTERM: a clean shutdown; `kill`: SIGKILL)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        self.proc.wait(timeout=20)
        self.proc = None

    def restart(self, down_for: float = 1.0, kill: bool = False) -> None:
        self.stop(kill=kill)
        time.sleep(down_for)
        self.start()

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(port=self.port, **kwargs)

    def close(self) -> None:
        if self.proc is not None:
            self.thaw()
            self.stop(kill=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resp_command(name: bytes) -> bytes:
    """How a command name travels inside a RESP request: a bulk string."""
    return b"$%d\r\n%s\r\n" % (len(name), name)


def _ping_through(upstream: socket.socket) -> None:
    """PING, then read up to its answer: Redis answers in order, so it has run all that
    came before it on this connection."""
    upstream.sendall(b"*1\r\n" + _resp_command(b"PING"))
    upstream.settimeout(10)
    tail = b""
    while not tail.endswith(b"+PONG\r\n"):
        chunk = upstream.recv(1 << 16)
        if not chunk:
            return
        tail = (tail + chunk)[-16:]


class TcpProxy:
    """A TCP proxy in front of a Redis server, with two faults to inject:

    - `cut_reply(command, times)`: the next `times` requests that contain `command` (e.g.
      b"EXEC", b"EVALSHA") reach Redis and run, and the connection is closed before the
      client reads the answer; `cut_reply_containing(data, times, hold_resend_s)` the same
      for requests holding those bytes anywhere (an argument of a script call, say), and
      holds the next such requests (the client's re-sends) until `hold_resend_s` after;
    - `stall(seconds)`: replies are held for `seconds` before they go on;
    - `report_version(version)`: INFO answers name that version, as an older server would.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._cut: dict[bytes, int] = {}
        self._cut_raw: dict[bytes, int] = {}
        self._hold_for: dict[bytes, float] = {}  # after a cut on these bytes, hold them
        self._held_until: dict[bytes, float] = {}
        self._stall_until = 0.0
        self.cuts_done = 0
        self._closed = False
        self._version: bytes | None = None
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut_reply(self, command: bytes, times: int = 1) -> None:
        with self._lock:
            self._cut[_resp_command(command.upper())] = times

    def cut_reply_containing(self, data: bytes, times: int = 1, hold_resend_s: float = 0) -> None:
        with self._lock:
            self._cut_raw[data] = times
            self._hold_for[data] = hold_resend_s

    def stall(self, seconds: float) -> None:
        with self._lock:
            self._stall_until = time.monotonic() + seconds

    def report_version(self, version: str) -> None:
        """As long as the server's own (the INFO reply's length header stays right)."""
        self._version = version.encode()

    def _rewrite(self, data: bytes) -> bytes:
        found = re.search(rb"redis_version:([0-9.]+)", data)
        if self._version is None or found is None:
            return data
        assert len(found.group(1)) == len(self._version), (found.group(1), self._version)
        return data[: found.start(1)] + self._version + data[found.end(1) :]

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        armed = False  # a request to cut went up: drop the connection on its answer
        try:
            while True:
                ready, _, _ = select.select([client, upstream], [], [], 0.5)
                if self._closed:
                    return
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    if sock is client:
                        hold = self._hold(data)
                        if hold > 0:
                            time.sleep(hold)
                        armed = armed or self._arm(data)
                        upstream.sendall(data)
                        continue
                    if armed:
                        # Redis has answered, so it ran the request; it has run the rest
                        # of a pipeline longer than one of its reads once it answers a
                        # PING sent after it. Then vanish.
                        _ping_through(upstream)
                        with self._lock:
                            self.cuts_done += 1
                        return
                    wait = self._stall_until - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    client.sendall(self._rewrite(data))
        except OSError:
            return
        finally:
            for sock in (client, upstream):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def _arm(self, data: bytes) -> bool:
        upper = data.upper()
        with self._lock:
            for cuts, seen in ((self._cut, upper), (self._cut_raw, data)):
                for marker, left in cuts.items():
                    if left > 0 and marker in seen:
                        cuts[marker] = left - 1
                        if marker in self._hold_for:
                            self._held_until[marker] = time.monotonic() + self._hold_for[marker]
                        return True
        return False

    def _hold(self, data: bytes) -> float:
        """How long to hold a request carrying bytes a cut was made on."""
        with self._lock:
            until = max((t for m, t in self._held_until.items() if m in data), default=0.0)
        return until - time.monotonic()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for sock in conns:
            try:
                sock.close()
            except OSError:
                pass

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerProcess:
    """`tokenq worker` in a subprocess; its log goes to a file (a pipe nobody reads could
    fill up and block the worker)."""

    def __init__(
        self,
        model: Path,
        url: str,
        namespace: str,
        log: Path,
        *,
        consumer: str = "proc",
        extra: list[str] | None = None,
    ) -> None:
        cmd = [
            sys.executable, "-m", "tokenq.cli", "worker",
            "--model", str(model), "--device", "cpu", "--dtype", "float32",
            "--num-kv-blocks", "512", "--max-num-seqs", "8", "--num-threads", "1",
            "--redis-url", url, "--namespace", namespace, "--consumer", consumer,
            "--metrics-interval", "0.5", "--served-model-name", "tiny",
            "--redis-side", "process", *(extra or []),
        ]  # fmt: skip
        self.log = log
        self.url, self.namespace = url, namespace
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with log.open("w") as out:
            # A session of its own: signal_all reaches both of its processes (the engine's
            # and the queue process it spawns), as a terminal or a container runtime would.
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_registered(self, timeout: float = 120) -> None:
        """Until the registry lists the model it serves ("tiny"), so that clients that
        require a live worker accept jobs for it; fails with the log if it died first."""
        with Client(self.url, namespace=self.namespace) as client:
            deadline = time.monotonic() + timeout
            while not any(m.id == "tiny" for m in client.models()):
                assert self.alive() and time.monotonic() < deadline, self.log.read_text()[-3000:]
                time.sleep(0.2)

    def wait_clean_exit(self, timeout: float) -> None:
        assert self.proc.wait(timeout=timeout) == 0, self.log.read_text()[-3000:]

    def queue_pid(self) -> int:
        """The queue process `tokenq worker` spawned (its Redis side)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and b"spawn_main" in cmdline:
                return int(stat.parent.name)
        raise AssertionError("the worker has no queue process")

    def signal_all(self, sig: int) -> None:
        """Both processes of the worker at once."""
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """kill -9 of the whole worker, as an OOM kill of its container."""
        self.signal_all(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.signal_all(signal.SIGCONT)
            self.signal_all(signal.SIGKILL)
        except ProcessLookupError:
            pass  # the whole session has ended
        self.proc.wait(timeout=30)
