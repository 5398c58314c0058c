"""A fleet on one Redis: jobs routed by model, priority lanes across the whole backlog,
tenants served in turn, back-pressure per lane."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from tests.helpers import make_tiny_llama_dir
from tests.worker_support import (
    WorkerThread,
    check_reply,
    fast_config,
    make_engine,
    reference_run,
    single_torch_thread,  # noqa: F401
    tiny_model,  # noqa: F401
    wait_for,
)
from tokenq import Client, QueueFull, UnknownModel
from tokenq.producer.client import make_request
from tokenq.protocol import ErrorEvent, TokenEvent, pack
from tokenq.worker.host import make_worker
from tokenq.worker.worker import Worker

pytestmark = pytest.mark.usefixtures("single_torch_thread")

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two different tiny Llamas: the same prompt gives different tokens on each."""
    return {
        name: make_tiny_llama_dir(tmp_path_factory.mktemp(name), seed=seed)
        for name, seed in (("alpha", 1), ("beta", 2))
    }


def worker_for(model: Path, name: str, namespace: str, conn: redis.Redis, **kw: object) -> Worker:
    config = fast_config(namespace, served_names=(name,), consumer=f"{name}-{kw.pop('n', 0)}")
    engine = make_engine(model, **kw.pop("engine", {}))  # type: ignore[arg-type]
    return Worker(engine, conn, replace(config, **kw))


def two_slot_worker(model: Path, namespace: str, conn: redis.Redis, **kw: object) -> Worker:
    """A worker that runs two jobs at a time: the rest of a backlog waits in Redis."""
    return worker_for(model, "tiny", namespace, conn, engine={"max_num_seqs": 2}, **kw)


def test_two_models_share_one_redis_and_each_job_reaches_its_model(
    two_models: dict[str, Path], redis_url: str, redis_namespace: str
) -> None:
    client = Client(redis_url, namespace=redis_namespace)
    conn = client.redis
    workers = [
        worker_for(path, name, redis_namespace, conn, n=i)
        for name, path in two_models.items()
        for i in range(2)
    ]
    threads = [WorkerThread(w) for w in workers]
    for t in threads:
        t.__enter__()
    try:
        wait_for(lambda: {m.id: m.workers for m in client.models()} == {"alpha": 2, "beta": 2})
        prompts = [f"story {i}" for i in range(8)]
        jobs = [
            (name, p, client.submit(p, model=name, max_tokens=12, **GREEDY))
            for p in prompts
            for name in two_models
        ]
        replies = [(name, p, check_reply(list(job.stream(timeout=60)))) for name, p, job in jobs]
    finally:
        for t in reversed(threads):
            t.__exit__(None, None, None)
    for name, path in two_models.items():
        mine = [(p, r) for n, p, r in replies if n == name]
        expected = reference_run(
            path, [{"prompt": p, "params": {"max_tokens": 12, **GREEDY}} for p, _ in mine]
        )
        for (_, reply), (_, final) in zip(mine, expected, strict=True):
            assert reply.done.token_ids == final.token_ids
    alpha = [r.done.token_ids for n, _, r in replies if n == "alpha"]
    beta = [r.done.token_ids for n, _, r in replies if n == "beta"]
    assert alpha != beta  # really two models
    served = [sum(w.metrics.request_success_total.values()) for w in workers]
    assert served[0] + served[1] == 8 and served[2] + served[3] == 8, served  # alpha, beta
    assert conn.xlen(client.keys.dead) == 0
    client.close()


def test_a_model_no_live_worker_serves_fails_at_once_unless_queued_anyway(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace)
    with pytest.raises(UnknownModel, match="no live worker serves model 'tiny'"):
        client.submit("x", model="tiny")
    with pytest.raises(UnknownModel, match="no model given"):
        client.submit("x")
    early = client.submit("x", model="tiny", queue_anyway=True, max_tokens=3, **GREEDY)
    config = fast_config(redis_namespace, served_names=("tiny", "tiny-alias"))
    with WorkerThread(Worker(make_engine(tiny_model), client.redis, config)):
        wait_for(lambda: bool(client.models()))
        (info,) = client.models()
        assert (info.id, info.aliases, info.workers) == ("tiny", ("tiny-alias",), 1)
        assert info.max_model_len == 2048  # the tiny model's context
        assert early.result(timeout=30).usage.completion_tokens == 3
        # The one model served is every job's default; an alias reaches the same worker.
        assert client.submit("y", max_tokens=2).result(timeout=30).usage.completion_tokens == 2
        aliased = client.submit("z", model="tiny-alias", max_tokens=2)
        assert aliased.result(timeout=30).usage.completion_tokens == 2
        with pytest.raises(UnknownModel):
            client.submit("x", model="gpt-9")
    # Stopped workers leave the registry.
    assert client.models() == []
    client.close()


def test_interactive_jobs_overtake_a_batch_backlog(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, model="tiny", require_worker=False)
    backlog = client.submit_many(
        make_request(f"batch {i}", priority=5, max_tokens=60, **GREEDY) for i in range(30)
    )
    urgent = client.submit_many(
        make_request(f"urgent {i}", lane="interactive", max_tokens=8, **GREEDY) for i in range(3)
    )
    worker = worker_for(
        tiny_model, "tiny", redis_namespace, client.redis, engine={"max_num_seqs": 2}
    )
    with WorkerThread(worker):
        for job in urgent:
            job.result(timeout=60)
        done_batch = sum(j.status() == "done" for j in backlog)
        for job in backlog:
            job.result(timeout=120)
    # The interactive jobs came last but ran as soon as a slot freed.
    assert done_batch <= 4, done_batch
    client.close()


def test_one_tenants_flood_does_not_hold_up_another_tenant(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, model="tiny", require_worker=False)
    flood = client.submit_many(
        make_request(f"flood {i}", tenant="acme", max_tokens=20, **GREEDY) for i in range(40)
    )
    few = client.submit_many(
        make_request(f"few {i}", tenant="bob", max_tokens=20, **GREEDY) for i in range(3)
    )
    worker = worker_for(
        tiny_model, "tiny", redis_namespace, client.redis, engine={"max_num_seqs": 2}
    )
    with WorkerThread(worker):
        for job in few:
            job.result(timeout=60)
        flood_done = sum(j.status() == "done" for j in flood)
        for job in flood:
            job.result(timeout=120)
    # Served in turn: bob waited for about as many of acme's jobs as he had himself.
    assert flood_done <= 6, flood_done
    client.close()


def test_queue_full_is_per_lane_and_names_it(redis_url: str, redis_namespace: str) -> None:
    caps = {"interactive": 5, "default": 5, "batch": 2}
    client = Client(
        redis_url, namespace=redis_namespace, model="tiny", require_worker=False, max_backlog=caps
    )
    client.submit_many(make_request(f"b{i}", lane="batch") for i in range(2))
    with pytest.raises(QueueFull) as full:
        client.submit("b3", lane="batch")
    assert (full.value.lane, full.value.backlog, full.value.max_backlog) == ("batch", 2, 2)
    assert "tiny batch lane" in str(full.value)
    # A batch flood never refuses interactive or default work.
    client.submit("now", lane="interactive")
    client.submit("soon")
    client.close()


def test_a_starved_lane_ages_up(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    """A default job behind a steady interactive flood still runs once it has waited its
    lane's max wait."""
    client = Client(redis_url, namespace=redis_namespace, model="tiny", require_worker=False)
    patient = client.submit("patient", max_tokens=4, **GREEDY)
    flood = client.submit_many(
        make_request(f"urgent {i}", lane="interactive", max_tokens=30, **GREEDY) for i in range(40)
    )
    waits = {"interactive": 0.0, "default": 0.3, "batch": 0.3}
    worker = two_slot_worker(tiny_model, redis_namespace, client.redis, lane_max_wait_s=waits)
    with WorkerThread(worker):
        patient.result(timeout=60)
        still_waiting = sum(j.status() == "queued" for j in flood)
        for job in flood:
            job.result(timeout=120)
    assert still_waiting > 0  # it did not just wait for the flood to drain
    client.close()


def test_a_protocol_1_entry_gets_a_clear_error(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, model="tiny", require_worker=False)
    conn, keys = client.redis, client.keys
    conn.xadd(keys.jobs, {"v": "1", "id": "old", "data": pack({"prompt": "x"})})
    with WorkerThread(Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))):
        (event,) = client.job("old").stream(timeout=30)
    assert isinstance(event, ErrorEvent) and event.code == "unsupported_version"
    assert "speaks 2" in event.message
    wait_for(lambda: conn.xlen(keys.jobs) == 0)
    client.close()


def test_the_registry_shows_each_worker_and_its_heartbeat(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace)
    worker = Worker(make_engine(tiny_model), client.redis, fast_config(redis_namespace))
    with WorkerThread(worker):
        wait_for(lambda: bool(client.models()))
        first = client.models()[0].heartbeat_at
        assert abs(first - time.time()) < 10
    client.close()


def test_an_interactive_job_preempts_a_full_worker_of_batch_jobs(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    """Both slots run long batch jobs: an interactive job still starts within a few steps
    (the engine preempts a batch job by recompute), and the batch jobs lose nothing."""
    client = Client(redis_url, namespace=redis_namespace, model="tiny", require_worker=False)
    params = {"max_tokens": 1500, **GREEDY}
    batch = client.submit_many(make_request(f"long {i}", lane="batch", **params) for i in range(2))
    worker = two_slot_worker(tiny_model, redis_namespace, client.redis)
    with WorkerThread(worker):
        wait_for(lambda: all(j.status() == "running" for j in batch))
        urgent = client.submit("now please", lane="interactive", max_tokens=4, **GREEDY)
        urgent.result(timeout=30)
        assert all(j.status() == "running" for j in batch)  # it did not wait for them
        replies = [check_reply(list(j.stream(timeout=120))) for j in batch]
    # It took a batch job's slot, or (had it come during a step) a seat ahead of them.
    counters = worker.driver.stats.counters
    assert counters.get("preemptions_priority", 0) + counters.get("steps_ahead", 0) >= 1
    expected = reference_run(
        tiny_model, [{"prompt": f"long {i}", "params": params} for i in range(2)]
    )
    for reply, (_, final) in zip(replies, expected, strict=True):
        assert reply.done.token_ids == final.token_ids
        assert not any(e.type == "restart" for e in reply.events)
    client.close()


@pytest.mark.parametrize("side", ["threads", "process"])
def test_an_interactive_jobs_first_token_is_published_before_the_batch_step_in_flight_ends(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    side: str,
) -> None:
    """A batch step is held between two layers, an interactive job is submitted, and the
    step goes on only once that job's first token is in Redis: the job ran a step ahead,
    and its token was published, from inside the batch step. Every job's tokens stay
    those of the engine alone."""
    client = Client(redis_url, namespace=redis_namespace, model="tiny", require_worker=False)
    params = {"max_tokens": 1000, **GREEDY}
    batch = client.submit_many(make_request(f"long {i}", lane="batch", **params) for i in range(2))
    config = fast_config(redis_namespace, served_names=("tiny",))
    worker = make_worker(make_engine(tiny_model), redis_url, config, side=side)
    take_in = worker.driver.between_layers  # the two-process host's, or the driver's own
    armed, holding, published = threading.Event(), threading.Event(), threading.Event()
    ran_ahead: list[bool] = []

    def between_layers() -> bool:
        if holding.is_set() or not armed.is_set():
            return take_in()
        holding.set()
        deadline = time.monotonic() + 30
        while not ran_ahead and time.monotonic() < deadline:
            if take_in():  # once the interactive job has come and run ahead
                ran_ahead.append(True)
            time.sleep(0.001)
        published.wait(30)
        return bool(ran_ahead)

    worker.driver.between_layers = between_layers
    with WorkerThread(worker):
        wait_for(lambda: all(j.status() == "running" for j in batch))
        armed.set()
        assert holding.wait(30)
        urgent = client.submit("now please", lane="interactive", max_tokens=4, **GREEDY)
        events = []
        for event in urgent.stream(timeout=30):
            events.append(event)
            if isinstance(event, TokenEvent):
                break
        published.set()
        assert ran_ahead == [True]
        events += urgent.stream(after=events[-1].event_id, timeout=60)
        replies = [check_reply(events)] + [check_reply(list(j.stream(timeout=120))) for j in batch]
    requests = [{"prompt": "now please", "params": {"max_tokens": 4, **GREEDY}}]
    requests += [{"prompt": f"long {i}", "params": params} for i in range(2)]
    for reply, (_, final) in zip(replies, reference_run(tiny_model, requests), strict=True):
        assert reply.done.token_ids == final.token_ids
    assert worker.driver.stats.counters["steps_ahead"] >= 1
    client.close()


@pytest.mark.parametrize("side", ["threads", "process"])
def test_a_job_that_comes_while_a_prefill_step_runs_joins_that_step(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    side: str,
) -> None:
    """A job's first step is held between two layers until a second job of the same lane
    has reached the engine; that job then joins the step in flight instead of waiting for
    the next one (as requests sent over HTTP one after another do). Both jobs' tokens
    stay those of the engine alone."""
    client = Client(redis_url, namespace=redis_namespace, model="tiny", require_worker=False)
    params = {"max_tokens": 8, **GREEDY}
    engine = make_engine(tiny_model)
    config = fast_config(redis_namespace, served_names=("tiny",))
    worker = make_worker(engine, redis_url, config, side=side)
    take_in = worker.driver.between_layers
    holding = threading.Event()

    def between_layers() -> bool:
        if holding.is_set():
            return take_in()
        holding.set()
        deadline = time.monotonic() + 30
        while len(engine.requests) < 2 and time.monotonic() < deadline:
            take_in()
            time.sleep(0.001)
        return False

    worker.driver.between_layers = between_layers
    with WorkerThread(worker):
        first = client.submit("the first", **params)
        assert holding.wait(30)
        second = client.submit("the second", **params)
        replies = [check_reply(list(j.stream(timeout=60))) for j in (first, second)]
    assert worker.driver.stats.counters.get("requests_joined", 0) == 1
    requests = [{"prompt": p, "params": params} for p in ("the first", "the second")]
    for reply, (_, final) in zip(replies, reference_run(tiny_model, requests), strict=True):
        assert reply.done.token_ids == final.token_ids
    client.close()
