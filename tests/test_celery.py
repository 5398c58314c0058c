"""Celery apps through the bridge: a real `tokenq celery` process (a Celery worker), a real
Redis broker and result backend, and a tokenq worker thread on a tiny random Llama.

Every test keeps its Celery keys under a key prefix of its own (broker and result backend
alike, `global_keyprefix`), consumes a queue of its own and deletes only those keys.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis
from celery import Celery, chord, group
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

from tests.redis_fixtures import CLIENT, TEST_MODEL
from tests.worker_support import (
    WorkerThread,
    check_reply,
    fast_config,
    make_engine,
    reference_run,
    single_torch_thread,  # noqa: F401
    slow_steps,
    tiny_model,  # noqa: F401
    wait_for,
)
from tokenq.celery import PROGRESS, generate
from tokenq.celery.bridge import Bridge, RevokeWatcher, job_kwargs
from tokenq.producer.client import Client
from tokenq.producer.errors import JobFailed, QueueFull
from tokenq.protocol import Keys, ProtocolError, decode_event
from tokenq.worker.worker import Worker

# On the tests that run a tokenq worker only: the fixture sets torch's (process-wide) thread
# count on the way out, which a test without an engine has no reason to touch.
engine_threads = pytest.mark.usefixtures("single_torch_thread")

GREEDY = {"temperature": 0, "ignore_eos": True}
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Stack:
    """One test's Celery side: its key prefix, queue and tokenq namespace, the settings the
    bridge reads (`--celery-config`), and a client app with the same settings."""

    url: str
    namespace: str
    prefix: str
    queue: str
    config_dir: Path
    config_module: str
    app: Celery

    def send(self, **kwargs: Any) -> AsyncResult:
        options = kwargs.pop("options", {})
        return self.app.send_task("tokenq.generate", kwargs=kwargs, queue=self.queue, **options)

    def sig(self, *args: Any, **kwargs: Any) -> Any:
        return generate.s(*args, **kwargs).set(queue=self.queue)

    def client(self, **overrides: Any) -> Client:
        return Client(self.url, namespace=self.namespace, **CLIENT, **overrides)

    def worker(
        self, model: Path, conn: redis.Redis, step_delay: float = 0.0, **options: Any
    ) -> WorkerThread:
        """A tokenq worker thread; `step_delay` makes every engine step take that much
        longer, so that a job outlasts what a test does meanwhile on any machine."""
        engine = make_engine(model, **options)
        if step_delay:
            slow_steps(engine, step_delay)
        return WorkerThread(Worker(engine, conn, fast_config(self.namespace, consumer="w1")))


def make_stack(url: str, namespace: str, workdir: Path, **broker_options: Any) -> Stack:
    tag = uuid.uuid4().hex[:10]
    prefix = f"tqcelery-{tag}:"
    settings = {
        "broker_transport_options": {"global_keyprefix": prefix, **broker_options},
        "result_backend_transport_options": {"global_keyprefix": prefix},
    }
    module = f"celerycfg_{tag}"
    lines = [f"{key} = {value!r}\n" for key, value in settings.items()]
    (workdir / f"{module}.py").write_text("".join(lines))
    app = Celery(f"test-{tag}", broker=url, backend=url)  # the current app: `generate` uses it
    app.conf.update(settings)
    return Stack(url, namespace, prefix, f"tqcelery-{tag}", workdir, module, app)


def drop_stack(stack: Stack) -> None:
    stack.app.close()
    conn = redis.Redis.from_url(stack.url)
    try:
        keys = list(conn.scan_iter(match=f"{stack.prefix}*", count=1000))
        if keys:
            conn.delete(*keys)
    finally:
        conn.close()


class BridgeProcess:
    """`tokenq celery` in a subprocess, its log in a file."""

    def __init__(self, stack: Stack, log: Path, *extra: str, queue_anyway: bool = True) -> None:
        cmd = [
            sys.executable, "-m", "tokenq.cli", "celery",
            "--redis-url", stack.url, "--namespace", stack.namespace,
            "--broker", stack.url, "--backend", stack.url, "--queue", stack.queue,
            "--celery-config", stack.config_module, "--concurrency", "8",
            "--model", TEST_MODEL, *(["--queue-anyway"] if queue_anyway else []), *extra,
        ]  # fmt: skip
        path = os.pathsep.join(filter(None, [str(stack.config_dir), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
            )
        try:
            wait_for(self._ready, timeout=60, interval=0.05)
        except BaseException:
            self.kill()
            raise

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        return " ready." in self.log.read_text()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __enter__(self) -> BridgeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.kill()


def reply_events(conn: redis.Redis, namespace: str, job_id: str) -> list:
    return [decode_event(eid, f) for eid, f in conn.xrange(Keys(namespace).reply(job_id))]


@pytest.fixture(scope="module")
def shared_bridge(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Stack, BridgeProcess]]:
    """One bridge and one tokenq worker for the tests that need nothing special."""
    workdir = tmp_path_factory.mktemp("celery-shared")
    namespace = f"tqtest-{uuid.uuid4().hex[:12]}"
    stack = make_stack(redis_url, namespace, workdir)
    conn = redis.Redis.from_url(redis_url)
    try:
        with stack.worker(tiny_model, conn), BridgeProcess(stack, workdir / "bridge.log") as bridge:
            yield stack, bridge
    finally:
        drop_stack(stack)
        keys = list(conn.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            conn.delete(*keys)
        conn.close()


@pytest.fixture
def shared(shared_bridge: tuple[Stack, BridgeProcess]) -> Stack:
    return shared_bridge[0]


def test_the_positional_argument_is_the_prompt_or_fills_previous() -> None:
    assert job_kwargs("Hi", {"max_tokens": 3}) == {"prompt": "Hi", "max_tokens": 3}
    filled = job_kwargs({"text": "Nile"}, {"prompt": "Where does {previous} flow? {x}"})
    assert filled == {"prompt": "Where does Nile flow? {x}"}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "{previous}!"}]
    filled = job_kwargs([{"text": "a"}, {"text": "b"}], {"messages": chat})
    assert filled["messages"] == [chat[0], {"role": "user", "content": "a\n\nb!"}]
    for previous, kwargs in [
        ({"text": "a"}, {"prompt": "no slot"}),
        (3, {}),
        (None, {"job_id": "x"}),
    ]:
        with pytest.raises(ProtocolError) as info:
            job_kwargs(previous, kwargs)
        assert info.value.code == "invalid_request"


def test_a_redelivery_after_the_reply_expired_fails_instead_of_waiting(
    redis_url: str, redis_namespace: str, redis_conn: redis.Redis
) -> None:
    redis_conn.set(Keys(redis_namespace).job("ended"), "done")  # its reply stream is gone
    with Client(redis_url, namespace=redis_namespace, **CLIENT) as client:
        bridge = Bridge(client, RevokeWatcher(client, set(), 0.1))
        with pytest.raises(JobFailed) as info:
            bridge.run("ended", None, {"prompt": "again"}, lambda meta: None)
    assert info.value.code == "reply_expired"


@engine_threads
def test_send_task_gives_the_engines_tokens_and_streams_them_as_progress(
    shared_bridge: tuple[Stack, BridgeProcess],
    tiny_model: Path,  # noqa: F811
) -> None:
    shared, bridge = shared_bridge
    if sys.platform == "linux":  # no torch in the bridge: no CUDA in any forked child
        assert "libtorch" not in Path(f"/proc/{bridge.proc.pid}/maps").read_text()
    prompt = "Name three rivers."
    r = shared.send(prompt=prompt, max_tokens=12, metadata={"order": 7}, **GREEDY)
    messages: list[dict[str, Any]] = []
    result = r.get(timeout=30, on_message=messages.append)

    params = {"max_tokens": 12, **GREEDY}
    (_, final), *_ = reference_run(tiny_model, [{"prompt": prompt, "params": params}])
    assert result["token_ids"] == final.token_ids
    assert result["text"] == final.text
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 12
    assert result["usage"]["total_tokens"] == result["usage"]["prompt_tokens"] + 12
    assert result["metadata"] == {"order": 7}
    assert set(result["timings"]) == {"queue_time", "time_to_first_token", "total"}

    # Progress states come before the result, contiguous, and join up to it.
    states = [m["status"] for m in messages]
    assert states[-1] == "SUCCESS" and "SUCCESS" not in states[:-1]
    progress = [m["result"] for m in messages if m["status"] == PROGRESS]
    assert progress and not any(p["restart"] for p in progress)
    ids: list[int] = []
    for meta in progress:
        assert meta["index"] == len(ids)
        ids += meta["token_ids"]
    assert ids == result["token_ids"]
    assert "".join(p["text"] for p in progress) == result["text"]

    # The task id is the job id: tokenq's own client follows the same job.
    with shared.client() as client:
        reply = check_reply(list(client.job(r.id).stream(timeout=10)))
    assert reply.done.token_ids == result["token_ids"]


def test_a_task_of_n_holds_every_output_each_equal_to_its_own_seeded_job(
    shared_bridge: tuple[Stack, BridgeProcess],
    tiny_model: Path,  # noqa: F811
) -> None:
    shared, _ = shared_bridge
    params = {"temperature": 0.9, "max_tokens": 8, "ignore_eos": True}
    r = shared.send(prompt="Name three rivers.", n=3, seed=11, **params)
    messages: list[dict[str, Any]] = []
    result = r.get(timeout=30, on_message=messages.append)
    alone = [
        {"prompt": "Name three rivers.", "params": {**params, "seed": 11 + i}} for i in range(3)
    ]
    expected = [final for _, final in reference_run(tiny_model, alone)]
    assert [o["index"] for o in result["outputs"]] == [0, 1, 2]
    assert [o["token_ids"] for o in result["outputs"]] == [f.token_ids for f in expected]
    assert result["usage"]["completion_tokens"] == 3 * 8
    progress = [m["result"] for m in messages if m["status"] == PROGRESS]
    for i, output in enumerate(result["outputs"]):
        mine = [p for p in progress if p.get("output", 0) == i]
        assert sum((p["token_ids"] for p in mine), []) == output["token_ids"]


@engine_threads
def test_groups_chains_and_chords_run_through_the_bridge(
    shared: Stack,
    tiny_model: Path,  # noqa: F811
) -> None:
    shared.app.set_current()  # `generate` sends through the current app, as in an app
    params = {"max_tokens": 6, **GREEDY}
    prompts = [f"Item {i}: the river" for i in range(50)]
    many = group(shared.sig(prompt=p, **params) for p in prompts).apply_async()
    first = shared.sig(prompt="Name a river.", **params)
    then = shared.sig(prompt="Where does {previous} flow?", **params)
    chained = (first | then).apply_async()
    header = [shared.sig(prompt=p, **params) for p in prompts[:3]]
    summary = chord(header)(
        shared.sig(messages=[{"role": "user", "content": "Sum up: {previous}"}], **params)
    )

    results = many.get(timeout=60)
    expected = reference_run(tiny_model, [{"prompt": p, "params": params} for p in prompts])
    assert [r["token_ids"] for r in results] == [final.token_ids for _, final in expected]

    river = chained.parent.get(timeout=30)["text"]
    where = chained.get(timeout=30)
    summed = summary.get(timeout=30)
    joined = "\n\n".join(r["text"] for r in results[:3])
    with shared.client() as client:
        direct = client.submit(prompt=f"Where does {river} flow?", **params).result(timeout=30)
        chat = [{"role": "user", "content": f"Sum up: {joined}"}]
        direct_sum = client.submit(messages=chat, **params).result(timeout=30)
    assert where["token_ids"] == direct.token_ids
    assert summed["token_ids"] == direct_sum.token_ids


@engine_threads
def test_a_bad_request_fails_with_the_tokenq_error_code(shared: Stack) -> None:
    cases = {
        "invalid_params": shared.send(prompt="x", bogus=1),  # refused by the bridge's client
        "prompt_too_long": shared.send(prompt_token_ids=[5] * 3000),  # by the worker
        "invalid_request": shared.send(options={"args": [{"text": "a"}]}, prompt="no slot"),
    }
    bad_value = shared.send(prompt="x", temperature=-1)  # the engine's own range check
    for code, r in [*cases.items(), ("invalid_params", bad_value)]:
        error = r.get(timeout=30, propagate=False)
        assert r.state == "FAILURE"
        assert isinstance(error, JobFailed), error
        assert (error.code, error.job_id) == (code, r.id)
    assert "temperature" in bad_value.result.message

    # A client without torch rebuilds the failure as JobFailed, code included.
    script = f"""
import sys
from celery import Celery
import tokenq.celery
from tokenq import JobFailed
app = Celery(broker={shared.url!r}, backend={shared.url!r})
app.conf.result_backend_transport_options = {{"global_keyprefix": {shared.prefix!r}}}
error = app.AsyncResult({bad_value.id!r}).result
assert isinstance(error, JobFailed) and error.code == "invalid_params", repr(error)
assert "torch" not in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_an_unknown_model_fails_the_task_as_an_answer_without_a_traceback(
    redis_url: str, tmp_path: Path
) -> None:
    stack = make_stack(redis_url, f"tqtest-{uuid.uuid4().hex[:12]}", tmp_path)
    try:
        with BridgeProcess(stack, tmp_path / "bridge.log", queue_anyway=False) as bridge:
            r = stack.send(prompt="x", model="no-such-model")
            error = r.get(timeout=30, propagate=False)
            assert r.state == "FAILURE"
            assert isinstance(error, JobFailed) and error.code == "unknown_model", error
            assert "no-such-model" in error.message
            log = bridge.log.read_text()
        assert "raised unexpected" not in log and "Traceback" not in log, log[-3000:]
    finally:
        drop_stack(stack)


@engine_threads
def test_a_redelivered_task_attaches_to_its_job_even_from_a_new_bridge(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    redis_conn: redis.Redis,
    tmp_path: Path,
) -> None:
    """celery#5935, then a SIGKILL. The Redis broker hands a message out again once it has
    been unacknowledged for its visibility timeout (here 1 s, looked for every second), so
    each task is delivered again while it runs, to the same bridge; that bridge is then
    killed, and the next one takes every unfinished task back. Each job runs once."""
    redeliver = {
        "visibility_timeout": 1,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
    stack = make_stack(redis_url, redis_namespace, tmp_path, **redeliver)
    logs = [tmp_path / "bridge1.log", tmp_path / "bridge2.log"]
    tokens = 600
    try:
        # Two jobs at a time, each at least 3 s: the last two wait in tokenq's queue while the
        # first two run, and none has finished when the first bridge is killed (about 2 s).
        with stack.worker(tiny_model, redis_conn, step_delay=0.005, max_num_seqs=2):
            with BridgeProcess(stack, logs[0]) as first, stack.client() as client:
                tasks = [
                    stack.send(prompt=f"Tell me {i}", max_tokens=tokens, **GREEDY) for i in range(4)
                ]
                wait_for(
                    lambda: all(f"task {t.id}: attached" in logs[0].read_text() for t in tasks)
                )
                first.kill()
                status = {t.id: client.job(t.id).status() for t in tasks}
            unfinished = [job_id for job_id, s in status.items() if s != "done"]
            assert unfinished, "every job had finished before the kill: nothing to take back"
            with BridgeProcess(stack, logs[1]):
                results = [t.get(timeout=60) for t in tasks]
            taken_back = logs[1].read_text()
            metrics = Keys(redis_namespace).metrics("w1")
            finished = 'request_success_total{finished_reason="length"}'
            wait_for(lambda: redis_conn.hget(metrics, finished) == b"4")
        for task, result in zip(tasks, results, strict=True):
            reply = check_reply(reply_events(redis_conn, redis_namespace, task.id))  # one done
            assert result["token_ids"] == reply.done.token_ids
            assert len(result["token_ids"]) == tokens
        for job_id in unfinished:
            assert f"task {job_id}: attached" in taken_back
    finally:
        drop_stack(stack)


@engine_threads
def test_revoke_cancels_a_waiting_and_a_running_task(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    redis_conn: redis.Redis,
    tmp_path: Path,
) -> None:
    stack = make_stack(redis_url, redis_namespace, tmp_path)
    long = {"max_tokens": 1000, **GREEDY}  # at least 3 s: revoked long before it ends
    try:
        with (
            BridgeProcess(stack, tmp_path / "bridge.log", "--concurrency", "1"),
            stack.client() as client,
        ):
            # No tokenq worker yet: a's job waits in tokenq's queue, b behind a in Celery's.
            a = stack.send(prompt="waits in tokenq", **long)
            wait_for(lambda: client.job(a.id).status() == "queued")
            b = stack.send(prompt="waits in Celery", **long)
            b.revoke()
            wait_for(lambda: b.state == "REVOKED")
            a.revoke()
            wait_for(lambda: redis_conn.exists(Keys(redis_namespace).cancel(a.id)))
            with stack.worker(tiny_model, redis_conn, step_delay=0.003):
                c = stack.send(prompt="runs", **long)
                wait_for(lambda: c.state == PROGRESS)
                c.revoke()
                for r in (a, b, c):
                    with pytest.raises(TaskRevokedError):
                        r.get(timeout=30)
                    assert r.state == "REVOKED"
                cancelled_a = client.job(a.id).result(timeout=10)
                cancelled_c = client.job(c.id).result(timeout=10)
            assert client.job(b.id).status() == "unknown"  # never submitted
        assert cancelled_a.finish_reason == "cancelled"
        assert cancelled_a.usage.completion_tokens == 0  # never ran
        assert cancelled_c.finish_reason == "cancelled"
        assert 0 < cancelled_c.usage.completion_tokens < 1000
    finally:
        drop_stack(stack)


@engine_threads
def test_queue_full_is_retried_then_fails_clearly(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    redis_conn: redis.Redis,
    tmp_path: Path,
) -> None:
    stack = make_stack(redis_url, redis_namespace, tmp_path)
    retry = ["--max-backlog", "1", "--max-retries", "4", "--retry-backoff", "0.2"]
    try:
        with BridgeProcess(stack, tmp_path / "bridge.log", *retry), stack.client() as client:
            filler = client.submit(prompt="fills the backlog", max_tokens=4)  # no worker yet
            refused = stack.send(prompt="refused", max_tokens=4)
            states: list[str] = []
            with pytest.raises(QueueFull) as info:
                refused.get(timeout=30, on_message=lambda m: states.append(m["status"]))
            assert info.value.max_backlog == 1
            assert states.count("RETRY") == 4
            assert client.job(refused.id).status() == "unknown"

            # Retried until the backlog drains: then it runs.
            later = stack.send(prompt="later", max_tokens=4)
            wait_for(lambda: later.state == "RETRY")
            with stack.worker(tiny_model, redis_conn):
                assert later.get(timeout=30)["usage"]["completion_tokens"] == 4
                assert filler.result(timeout=10).finish_reason == "length"
    finally:
        drop_stack(stack)


def test_without_celery_the_command_says_what_to_install() -> None:
    script = (
        "import sys; sys.modules['celery'] = None\n"
        "from tokenq.cli import main\n"
        "raise SystemExit(main(['celery', '--broker', 'redis://x']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "tokenq: celery is not installed: pip install 'tokenq[celery]'"
    ]


@engine_threads
def test_a_structured_task_validates_and_an_unenforceable_one_fails_at_the_door(
    shared: Stack,
) -> None:
    schema = {
        "type": "object",
        "properties": {"river": {"enum": ["Nile", "Amazon"]}, "long": {"type": "boolean"}},
        "required": ["river", "long"],
        "additionalProperties": False,
    }
    good = shared.send(prompt="A river?", max_tokens=40, structured_outputs={"json": schema})
    bad = shared.send(prompt="x", structured_outputs={"json": {"uniqueItems": True}})
    result = good.get(timeout=30)
    assert result["finish_reason"] == "stop"
    jsonschema.validate(json.loads(result["text"]), schema)
    error = bad.get(timeout=30, propagate=False)
    assert isinstance(error, JobFailed) and error.code == "invalid_params"
    assert "uniqueItems" in error.message
