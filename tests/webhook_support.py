"""Helpers of the webhook tests (this module holds no tests): a receiver on loopback
that verifies every delivery with the `standardwebhooks` package, and `tokenq webhooks
run` in a process of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook


class Receiver:
    """A webhook receiver on loopback. `answer(webhook_id, attempt)` picks each status;
    every delivery is verified with standardwebhooks, then kept once per webhook-id."""

    def __init__(self, secret: str, answer: Callable[[str, int], int] | None = None) -> None:
        self.verifier = Webhook(secret)
        self.answer = answer or (lambda _id, _n: 200)
        self.attempts: Counter[str] = Counter()
        self.events: dict[str, dict[str, Any]] = {}  # by webhook-id, first delivery kept
        self.order: list[str] = []  # webhook-ids in the order first received
        self.bad: list[str] = []
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.port = 0

    def start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["content-length"])
                body = self.rfile.read(length)
                if len(body) < length:  # its sender died mid-request (a dispatcher killed)
                    return
                wid = self.headers.get("webhook-id", "")
                with outer.lock:
                    outer.attempts[wid] += 1
                    status = outer.answer(wid, outer.attempts[wid])
                    if 200 <= status < 300:
                        try:
                            event = outer.verifier.verify(body, dict(self.headers))
                        except Exception as exc:  # a bad signature fails the test
                            outer.bad.append(f"{wid}: {exc}")
                            status = 400
                        else:
                            if wid not in outer.events:
                                outer.events[wid] = event
                                outer.order.append(wid)
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("location", "http://10.0.0.1/hook")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def completed(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {
                e["data"]["id"]: e for e in self.events.values() if e["type"] == "job.completed"
            }


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(secret: str, answer: Callable[[str, int], int] | None = None) -> Receiver:
        r = Receiver(secret, answer)
        r.start()
        made.append(r)
        return r

    yield make
    for r in made:
        if r.server is not None:
            r.stop()


class Dispatcher:
    """`tokenq webhooks run` in a process of its own, so that it can be SIGKILLed."""

    def __init__(self, redis_url: str, namespace: str, secret: str, log: Path, *extra: str):
        self.argv = [
            sys.executable,
            "-m",
            "tokenq.cli",
            "webhooks",
            "run",
            "--redis-url",
            redis_url,
            "--namespace",
            namespace,
            *extra,
        ]
        self.env = {**os.environ, "TOKENQ_WEBHOOK_SECRET": secret}
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Dispatcher:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=out)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=15)
