"""Helpers shared by the worker tests (this module holds no tests).

Workers run in threads against the real Redis of `redis_url`, with a real engine on a tiny
random Llama (real tokenizer), so a whole job takes milliseconds.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from tests.helpers import make_tiny_llama_dir
from tests.redis_fixtures import CLIENT, TEST_MODEL  # noqa: F401  (re-exported for tests)
from tests.waits import wait_for, wait_still  # noqa: F401  (re-exported for tests)
from tokenq.engine import EngineConfig, LLMEngine, SamplingParams
from tokenq.protocol import GROUP, NO_TENANT, DoneEvent, Event, Keys, RestartEvent, TokenEvent
from tokenq.worker.config import WorkerConfig
from tokenq.worker.host import EngineHost
from tokenq.worker.worker import Worker


@pytest.fixture
def single_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the worker thread then leaves a core to
    the test's client; the setting is process-wide, so it is put back afterwards."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-worker"))


def make_engine(model: Path | str, **overrides: Any) -> LLMEngine:
    options: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "num_kv_blocks": 512,
        "max_num_seqs": 16,
        "num_threads": 1,
    }
    return LLMEngine(EngineConfig(model=str(model), **{**options, **overrides}))


def slow_steps(engine: LLMEngine, delay: float) -> None:
    """Every step of the engine takes `delay` seconds longer, so that a job outlasts what a
    test does meanwhile on any machine."""
    step = engine.step

    def slow_step(between_layers: Any = None) -> Any:
        time.sleep(delay)
        return step(between_layers)

    engine.step = slow_step  # type: ignore[method-assign]


def default_queue(keys: Keys) -> str:
    """The test model's default-lane queue of jobs that name no tenant."""
    return keys.queue(TEST_MODEL, 0, NO_TENANT)


def add_raw(conn: redis.Redis, keys: Keys, fields: dict[str, Any], priority: int = 0) -> bytes:
    """XADD an entry as a producer that skips the client would: into the test model's
    queue of that priority (no tenant), listed in the model's set of queues so workers look
    there. One transaction, as SUBMIT is one script: a worker's TAKE between the two
    commands would find the queue empty and drop it from the set, and the entry would
    never be seen."""
    with conn.pipeline(transaction=True) as pipe:
        pipe.zadd(keys.queues(TEST_MODEL), {f"{priority}:{NO_TENANT}": priority})
        pipe.xadd(keys.queue(TEST_MODEL, priority, NO_TENANT), fields)
        return pipe.execute()[1]


def queue_keys(conn: redis.Redis, keys: Keys) -> list[str]:
    members = conn.zrange(keys.queues(TEST_MODEL), 0, -1)
    return [keys.queue(TEST_MODEL, *_split(m.decode())) for m in members]


def _split(member: str) -> tuple[int, str]:
    priority, tenant = member.split(":", 1)
    return int(priority), tenant


def queued(conn: redis.Redis, keys: Keys) -> int:
    """Entries in the test model's queues (waiting, or running and not yet acknowledged)."""
    return sum(conn.xlen(q) for q in queue_keys(conn, keys))


def pending(conn: redis.Redis, keys: Keys, consumer: str | None = None) -> list[dict]:
    """Pending entries of the test model's queues (of one consumer, or all)."""
    rows: list[dict] = []
    for q in queue_keys(conn, keys):
        try:
            rows += conn.xpending_range(q, GROUP, "-", "+", 1000, consumername=consumer)
        except redis.ResponseError as e:
            # A queue the worker has emptied and deleted (or not yet grouped) holds nothing
            # pending; it can go between listing the queues and asking, so ask, don't check.
            if not str(e).startswith("NOGROUP"):
                raise
    return rows


def fast_config(namespace: str, **overrides: Any) -> WorkerConfig:
    """Timings shrunk so that reclaiming and heartbeats happen within a test."""
    options: dict[str, Any] = {
        "namespace": namespace,
        "served_names": (TEST_MODEL,),
        "block_ms": 20,
        "claim_idle_ms": 400,
        "claim_interval_s": 0.1,
        "heartbeat_interval_s": 0.1,
        "metrics_interval_s": 0.2,
        "grace_period_s": 5.0,
        "stream_interval_s": 0.0,  # every step's tokens as their own event
    }
    return WorkerConfig(**{**options, **overrides})


class WorkerThread:
    """Runs `worker.run()` in a thread; leaving the block stops it and re-raises whatever
    killed it, so a test cannot pass with a dead worker."""

    def __init__(self, worker: Worker | EngineHost) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            if self.worker.run():  # an EngineHost's queue process failed
                raise RuntimeError("the queue process failed")
        except BaseException as exc:  # reported in __exit__
            self.error = exc

    def alive(self) -> bool:
        return self.thread.is_alive()

    def __enter__(self) -> Worker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.worker.stop(grace=0)
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "worker did not stop"
        if self.error is not None:
            raise self.error


@dataclass
class Reply:
    """A reply stream as a client reconstructs it, after checking its invariants."""

    events: list[Event]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""

    @property
    def done(self) -> DoneEvent:
        last = self.events[-1]
        assert isinstance(last, DoneEvent), last
        return last


def check_reply(events: list[Event]) -> Reply:
    """Token events are contiguous (no gap, no duplicate) since the last restart, and what
    was streamed joins up to the final text and ids."""
    reply = Reply(events)
    for event in events:
        if isinstance(event, RestartEvent):
            reply.token_ids, reply.text = [], ""
        elif isinstance(event, TokenEvent):
            assert event.index == len(reply.token_ids), (event.index, len(reply.token_ids))
            reply.token_ids += event.token_ids
            reply.text += event.text
    assert sum(e.type in ("done", "error") for e in events) == 1
    if isinstance(events[-1], DoneEvent):
        assert reply.text == events[-1].text
        assert reply.token_ids == events[-1].token_ids
    return reply


_REFERENCES: dict[tuple[Any, ...], list] = {}


def reference_run(model: Path | str, requests: list[dict[str, Any]], **engine_kw: Any) -> list:
    """The same requests straight into a fresh engine, all at once: (per-step deltas of
    each request, its final output). A clean run is deterministic and several tests check
    their jobs against the same one, so each is computed once per process (keyed by the
    model's files, the requests and the engine options) and handed out as a copy."""
    key = (
        str(model),
        _files_of(Path(model)),
        json.dumps(requests, sort_keys=True, default=repr),
        json.dumps(engine_kw, sort_keys=True, default=repr),
    )
    if key not in _REFERENCES:
        _REFERENCES[key] = _run_alone(model, requests, **engine_kw)
    return copy.deepcopy(_REFERENCES[key])


def _files_of(model: Path) -> tuple[Any, ...]:
    """Each file's name, size and modification time: a rewritten file is another model
    (nothing for a model name that is not a path)."""
    paths = sorted(model.rglob("*")) if model.is_dir() else [model]
    files = [p for p in paths if p.is_file()]
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def _run_alone(model: Path | str, requests: list[dict[str, Any]], **engine_kw: Any) -> list:
    engine = make_engine(model, **engine_kw)
    for i, req in enumerate(requests):
        req = dict(req)
        params = SamplingParams.from_dict(req.pop("params"))
        engine.add_request(f"r{i}", **req, params=params)
    deltas: dict[str, list[tuple[list[int], str]]] = {f"r{i}": [] for i in range(len(requests))}
    finals: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas[out.request_id].append((out.new_token_ids, out.new_text))
            if out.finished:
                finals[out.request_id] = out
    return [(deltas[f"r{i}"], finals[f"r{i}"]) for i in range(len(requests))]


def worker_successes(conn: redis.Redis, namespace: str) -> int:
    """Jobs the workers of `namespace` finished, from their metrics summaries (rewritten
    every `--metrics-interval`)."""
    total = 0
    for key in conn.scan_iter(match=f"{namespace}:metrics:*"):
        for name, value in conn.hgetall(key).items():
            if name.startswith(b"request_success_total"):
                total += int(float(value))
    return total


def wait_for_summaries(conn: redis.Redis, namespace: str, after: float) -> None:
    """Until every worker of `namespace` has rewritten its metrics summary since `after`
    (a `time.time()`): what they had done by then is counted in it."""

    def fresh() -> bool:
        stamps = [
            conn.hget(key, "updated_at") for key in conn.scan_iter(match=f"{namespace}:metrics:*")
        ]
        return bool(stamps) and all(s is not None and float(s) > after for s in stamps)

    wait_for(fresh, timeout=60)
