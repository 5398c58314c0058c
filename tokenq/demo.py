"""`tokenq demo`: the whole path in one process, without a Redis server.

A fakeredis server is shared by a producer (this thread) and a worker (another thread),
so the demo goes through exactly the code a deployment runs: submit -> job stream ->
worker -> engine -> reply streams -> client.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time

import fakeredis

from tokenq.engine.downloads import DEFAULT_MODEL
from tokenq.producer.client import Client, make_request
from tokenq.protocol import DoneEvent, ErrorEvent, RestartEvent, TokenEvent
from tokenq.worker.config import WorkerConfig
from tokenq.worker.logs import configure_logging

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about a message queue.",
    "Give me three tips for writing clear code.",
    "Explain what a GPU is to a ten-year-old.",
)


DEMO_NAME = "demo-model"  # the name the demo's worker serves and its client asks for


class LiveView:
    """One line per job, redrawn in place on a terminal; plain lines otherwise."""

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        self.texts = [""] * len(labels)
        self.tty = sys.stdout.isatty()
        self.drawn = False

    def update(self, i: int, text: str) -> None:
        self.texts[i] = text
        if self.tty:
            self._redraw()

    def finish(self, i: int, note: str) -> None:
        if self.tty:
            self.texts[i] += f"  [{note}]"
            self._redraw()
        else:
            print(f"[{self.labels[i]}] {self.texts[i].strip()}  [{note}]", flush=True)

    def _redraw(self) -> None:
        width = shutil.get_terminal_size().columns
        if self.drawn:
            sys.stdout.write(f"\x1b[{len(self.labels)}F")
        for label, text in zip(self.labels, self.texts, strict=True):
            line = f"[{label}] " + " ".join(text.split())
            sys.stdout.write("\x1b[2K" + line[: width - 1] + "\n")
        sys.stdout.flush()
        self.drawn = True


def run_demo(model: str = DEFAULT_MODEL, max_tokens: int = 48) -> int:
    from tokenq.engine import EngineConfig, LLMEngine
    from tokenq.worker.worker import Worker

    configure_logging(json=False, level="warning")
    print(f"loading {model} ...", flush=True)
    engine = LLMEngine(EngineConfig(model=model))
    server = fakeredis.FakeServer()
    worker = Worker(
        engine,
        fakeredis.FakeRedis(server=server),
        WorkerConfig(namespace="demo", block_ms=20, served_names=(DEMO_NAME,)),
    )
    thread = threading.Thread(target=worker.run, name="tokenq-worker", daemon=True)
    thread.start()

    client = Client(fakeredis.FakeRedis(server=server), namespace="demo", model=DEMO_NAME)
    start = time.monotonic()
    jobs = client.submit_many(
        (
            make_request(
                messages=[{"role": "user", "content": p}], max_tokens=max_tokens, temperature=0
            )
            for p in PROMPTS
        ),
        queue_anyway=True,  # the worker thread may not have registered yet
    )
    print(f"submitted {len(jobs)} jobs; one worker batches them together:")
    for i, prompt in enumerate(PROMPTS):
        print(f"  [{i + 1}] {prompt}")
    print(flush=True)
    index = {job.id: i for i, job in enumerate(jobs)}
    view = LiveView([str(i + 1) for i in range(len(jobs))])
    texts = [""] * len(jobs)
    tokens = 0
    status = 0
    for job, event in client.stream_many(jobs, timeout=600):
        i = index[job.id]
        if isinstance(event, TokenEvent):
            texts[i] += event.text
            view.update(i, texts[i])
        elif isinstance(event, RestartEvent):
            texts[i] = ""
        elif isinstance(event, DoneEvent):
            tokens += event.usage.completion_tokens
            ttft = event.timings.time_to_first_token or 0.0
            view.finish(i, f"{event.finish_reason}, {event.usage.completion_tokens} tokens, "
                        f"first token {ttft:.2f}s")  # fmt: skip
        elif isinstance(event, ErrorEvent):
            view.finish(i, f"error {event.code}: {event.message}")
            status = 1
    elapsed = time.monotonic() - start
    print(f"\n{len(jobs)} jobs, {tokens} tokens in {elapsed:.1f}s ({tokens / elapsed:.1f} tok/s)")
    worker.stop(grace=0)
    thread.join(timeout=10)
    return status
