"""Operations: a worker's Prometheus metrics, the fleet's gauges (`tokenq exporter`), and
the operator's commands (`inspect`, `result`, `cancel`, `dlq`) against a real Redis."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from tests.faults import WorkerProcess, free_port
from tests.redis_fixtures import CLIENT
from tests.worker_support import (
    WorkerThread,
    check_reply,
    default_queue,
    fast_config,
    make_engine,
    single_torch_thread,  # noqa: F401
    tiny_model,  # noqa: F401
    wait_for,
)
from tokenq import cli
from tokenq.ops.dlq import DeadLetters
from tokenq.ops.fleet import FLEET_METRICS, FleetCollector
from tokenq.producer.client import Client
from tokenq.producer.errors import JobFailed
from tokenq.protocol import Keys, pack
from tokenq.worker.metrics import LATENCY_BUCKETS, observe_many
from tokenq.worker.worker import Worker

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(autouse=True)
def worker_logs_aside() -> Iterator[None]:
    """In-process workers log through structlog, to stdout unless configured: send their
    lines to the process's own stderr, so that what `capsys` reads is the command's."""
    before = structlog.get_config()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.__stderr__))
    yield
    structlog.configure(**before)


GREEDY = {"temperature": 0, "ignore_eos": True}
Sample = tuple[str, dict[str, str], float]


def parse(text: str) -> list[Sample]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def scrape(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return parse(answer.read().decode())


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of a sample's values over the series that carry these labels."""
    return sum(
        v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def tokenq(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the `tokenq` command in-process: (exit status, stdout, stderr)."""
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_a_workers_metrics_endpoint_counts_what_it_ran(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    """Two workers in one process, each with its own registry and port: between them their
    scrapes count every request by lane and finish reason, every token, every latency."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    ports = [free_port(), free_port()]
    workers = [
        Worker(
            make_engine(tiny_model),
            client.redis,
            fast_config(
                redis_namespace, consumer=f"w{i}", metrics_port=port, metrics_addr="127.0.0.1"
            ),
        )
        for i, port in enumerate(ports)
    ]
    lanes = {"interactive": [5, 6, 7, 8], "default": [4, 9], "batch": [3, 3, 3]}
    jobs = [
        (lane, client.submit(f"{lane} job {i}", lane=lane, max_tokens=n, **GREEDY))
        for lane, sizes in lanes.items()
        for i, n in enumerate(sizes)
    ]
    bad = client.submit("bad sampling", temperature=-1.0)
    threads = [WorkerThread(w) for w in workers]
    for t in threads:
        t.__enter__()
    try:
        dones = [(lane, check_reply(list(job.stream(timeout=60))).done) for lane, job in jobs]
        with pytest.raises(JobFailed, match="invalid_params"):
            bad.result(timeout=30)

        def scraped() -> list[Sample]:
            return [s for port in ports for s in scrape(port)]

        wait_for(lambda: total(scraped(), "tokenq:request_success_total") == len(jobs))
        wait_for(lambda: total(scraped(), "tokenq:num_requests_running") == 0)
        samples = scraped()
        per_worker = [scrape(port) for port in ports]
    finally:
        for t in reversed(threads):
            t.__exit__(None, None, None)
    for lane, sizes in lanes.items():
        mine = [d for name, d in dones if name == lane]
        assert all(d.finish_reason == "length" for d in mine)
        labels = {"model": "tiny", "lane": lane}
        assert total(
            samples, "tokenq:request_success_total", **labels, finished_reason="length"
        ) == len(sizes)
        generated = sum(d.usage.completion_tokens for d in mine)
        assert generated == sum(sizes)
        assert total(samples, "tokenq:generation_tokens_total", **labels) == generated
        prompts = sum(d.usage.prompt_tokens for d in mine)
        assert total(samples, "tokenq:prompt_tokens_total", **labels) == prompts
        for name in (
            "time_to_first_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
        ):
            assert total(samples, f"tokenq:{name}_count", **labels) == len(sizes), name
            assert total(samples, f"tokenq:{name}_bucket", **labels, le="+Inf") == len(sizes)
        gaps = sum(n - 1 for n in sizes)
        assert total(samples, "tokenq:inter_token_latency_seconds_count", **labels) == gaps
    assert total(samples, "tokenq:request_error_total", code="invalid_params", lane="default") == 1
    assert total(samples, "tokenq:request_error_total") == 1
    # The engine's own figures, from each worker's latest stats.
    prompts = sum(d.usage.prompt_tokens for _, d in dones)
    assert total(samples, "tokenq:prefix_cache_queries_total") == prompts
    for own in per_worker:
        assert total(own, "tokenq:num_requests_waiting", model="tiny") == 0
        assert 0 <= total(own, "tokenq:kv_cache_usage_perc", model="tiny") <= 1
        causes = {lab["cause"] for n, lab, _ in own if n == "tokenq:num_preemptions_total"}
        assert causes == {"kv_cache", "priority"}
        assert any(n == "tokenq:prefix_cache_hits_total" for n, _, _ in own)
    # Each worker's registry holds its own requests only.
    served = [total(own, "tokenq:request_success_total") for own in per_worker]
    assert sum(served) == len(jobs)
    assert served == [sum(w.metrics.request_success_total.values()) for w in workers]
    client.close()


def test_inspect_shows_finished_pending_and_dead_jobs(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A worker killed with kill -9 leaves two jobs pending; a live worker finishes three
    and dead-letters one; two jobs wait for a model nobody serves. `inspect --json` shows
    exactly that."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = client.redis
    with WorkerProcess(
        tiny_model, redis_url, redis_namespace, tmp_path / "doomed.log", consumer="doomed"
    ) as doomed:
        wait_for(lambda: [m.id for m in client.models()] == ["tiny"], timeout=120)
        long = [client.submit(f"long {i}", max_tokens=2000, **GREEDY) for i in range(2)]
        wait_for(lambda: all(j.status() == "running" for j in long), timeout=60)
        doomed.kill()
        killed_at = time.monotonic()
    # claim_idle_ms far away: the live worker leaves the dead one's entries pending.
    config = fast_config(
        redis_namespace, consumer="w1", claim_idle_ms=600_000, registry_interval_s=0.2
    )
    with WorkerThread(Worker(make_engine(tiny_model), conn, config)):
        finished = [client.submit(f"short {i}", max_tokens=4, **GREEDY) for i in range(3)]
        for job in finished:
            assert job.result(timeout=60).finish_reason == "length"
        bad = client.submit("bad sampling", temperature=-1.0)
        with pytest.raises(JobFailed):
            bad.result(timeout=30)
        waiting = [client.submit(f"later {i}", model="other", lane="batch") for i in range(2)]
        load = client.keys.metrics("w1")
        success = 'request_success_total{finished_reason="length"}'
        wait_for(lambda: conn.hget(load, success) == b"3")
        # Past --stale-after 3 since the kill (its last heartbeat and KEEP came before it).
        time.sleep(max(0.0, 3.5 - (time.monotonic() - killed_at)))
        where = ["--redis-url", redis_url, "--namespace", redis_namespace, "--stale-after", "3"]
        status, out, _ = tokenq(capsys, "inspect", "--json", *where)
        assert status == 0
        text_status, text, _ = tokenq(capsys, "inspect", *where)
    fleet = json.loads(out)
    assert fleet["namespace"] == redis_namespace
    assert fleet["dead_letters"] == 1
    models = {m["name"]: m for m in fleet["models"]}
    assert sorted(models) == ["other", "tiny"]
    assert models["tiny"]["workers"] == ["w1"]
    tiny = models["tiny"]["lanes"]
    assert tiny["default"] == {"backlog": 2, "waiting": 0, "pending": 2, "oldest": None}
    for lane in ("interactive", "batch"):
        assert tiny[lane] == {"backlog": 0, "waiting": 0, "pending": 0, "oldest": None}
    assert models["other"]["workers"] == []
    batch = models["other"]["lanes"]["batch"]
    assert (batch["backlog"], batch["waiting"], batch["pending"]) == (2, 2, 0)
    assert batch["oldest"]["job_id"] == waiting[0].id
    assert batch["oldest"]["queue"] == f"{redis_namespace}:jobs:other:1:-"
    assert batch["oldest"]["age_s"] >= 0
    workers = {w["consumer"]: w for w in fleet["workers"]}
    assert sorted(workers) == ["doomed", "w1"]
    assert workers["w1"]["live"] and workers["w1"]["names"] == ["tiny"]
    # Labels nest as fields (JSON readers need no Prometheus key parsing).
    load = workers["w1"]["load"]
    assert {"finished_reason": "length", "value": 3} in load["request_success_total"]
    assert load["request_error_total"] == [{"code": "invalid_params", "value": 1}]
    assert not any("{" in key for key in load)
    assert not workers["doomed"]["live"]
    assert workers["doomed"]["heartbeat_age_s"] >= 3
    assert workers["doomed"]["pid"] == doomed.pid
    (held,) = fleet["pending"]
    assert (held["consumer"], held["live"], held["count"]) == ("doomed", False, 2)
    assert held["max_idle_s"] >= 3
    assert sorted(e["job_id"] for e in held["entries"]) == sorted(j.id for j in long)
    for e in held["entries"]:
        assert (e["model"], e["lane"], e["deliveries"]) == ("tiny", "default", 1)
        assert e["queue"] == default_queue(client.keys)
    assert text_status == 0
    assert "doomed (NOT LIVE" in text and "dead letters: 1" in text
    assert f"(job {waiting[0].id})" in text
    client.close()


def test_a_dead_job_replayed_after_the_fix_runs_to_the_end(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Workers kept dying on a job (max_deliveries_exceeded); once that is fixed, `dlq
    replay` puts it back under its id and it finishes with one clean reply."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    where = ["--redis-url", redis_url, "--namespace", redis_namespace]
    job = client.submit("replay me", max_tokens=6, metadata={"order": 7}, **GREEDY)
    queue = default_queue(keys)
    conn.xgroup_create(queue, "workers", id="0")
    ((_, ((entry, _),)),) = conn.xreadgroup("workers", "ghost", {queue: ">"}, count=1)
    conn.xclaim(queue, "workers", "ghost", 0, [entry], retrycount=5, justid=True)
    with WorkerThread(Worker(make_engine(tiny_model), conn, fast_config(redis_namespace))):
        with pytest.raises(JobFailed) as failed:
            job.result(timeout=30)
        assert failed.value.code == "max_deliveries_exceeded"
        status, out, _ = tokenq(capsys, "dlq", "list", "--json", *where)
        assert status == 0
        listing = json.loads(out)
        assert listing["count"] == 1
        (letter,) = listing["dead_letters"]
        assert (letter["job_id"], letter["code"], letter["queue"]) == (
            job.id,
            "max_deliveries_exceeded",
            queue,
        )
        status, out, _ = tokenq(capsys, "dlq", "show", letter["id"], "--json", *where)
        shown = json.loads(out)
        assert status == 0 and shown["payload"]["prompt"] == "replay me"
        assert shown["fields"] == {"v": "2", "id": job.id}
        status, text, _ = tokenq(capsys, "dlq", "list", *where)
        assert status == 0 and f"job {job.id}  max_deliveries_exceeded  queue tiny/default" in text

        status, out, err = tokenq(capsys, "dlq", "replay", job.id, *where)
        assert status == 0, err
        assert f"replayed job {job.id} onto {queue}" in out
        reply = check_reply(list(job.stream(timeout=30)))
    assert reply.done.finish_reason == "length"
    assert reply.done.usage.completion_tokens == 6
    assert reply.done.metadata == {"order": 7}
    assert job.status() == "done"
    assert DeadLetters(conn, redis_namespace).count() == 0
    assert conn.get(keys.backlog("tiny", "default")) == b"0"
    status, out, _ = tokenq(capsys, "result", job.id, *where)
    assert (status, out) == (0, reply.done.text + "\n")
    status, _, err = tokenq(capsys, "dlq", "replay", job.id, *where)
    assert status == 2 and err.startswith(f"tokenq: no dead letter with id or job id '{job.id}'")
    client.close()


def dead_letter(conn: redis.Redis, keys: Keys, job_id: str, **over: Any) -> str:
    """A dead letter as a worker writes it, for a job of the test model's default queue."""
    data = pack({"prompt": "hi", "model": "tiny"})
    letter: dict[str, Any] = {
        "stream": keys.queue("tiny", 0, "-"),
        "entry_id": "1-1",
        "job_id": job_id,
        "code": "max_deliveries_exceeded",
        "message": "delivered 4 times",
        "deliveries": 4,
        "consumer": "w0",
        "failed_at": time.time(),
        "fields": pack({b"v": b"2", b"id": job_id.encode(), b"data": data}),
        "truncated": 0,
    }
    letter.update(over)
    return conn.xadd(keys.dead, letter).decode()


def test_dead_letters_that_cannot_be_replayed_say_why_and_change_nothing(
    redis_url: str, redis_namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = redis.Redis.from_url(redis_url)
    keys = Keys(redis_namespace)
    where = ["--redis-url", redis_url, "--namespace", redis_namespace]
    junk = pack({b"v": b"2", b"id": b"j-bad", b"data": b"\xc1\xc1"})
    cases = {
        "truncated": dead_letter(conn, keys, "j-trunc", truncated=1),
        "still invalid": dead_letter(conn, keys, "j-bad", fields=junk, code="invalid_payload"),
        "not a protocol 2 queue": dead_letter(conn, keys, "j-old", stream=keys.jobs),
        "submitted again": dead_letter(conn, keys, "j-again"),
    }
    conn.set(keys.job("j-again"), "queued")
    for reason, letter in cases.items():
        status, out, err = tokenq(capsys, "dlq", "replay", letter, *where)
        assert (status, out) == (2, ""), reason
        assert len(err.splitlines()) == 1 and reason in err, err
    # A full lane: QueueFull's status, and the dead job's state is left as it was.
    full = dead_letter(conn, keys, "j-full")
    conn.set(keys.job("j-full"), "error")
    conn.xadd(keys.reply("j-full"), {"type": "error", "data": pack({})}, id="0-1")
    status, _, err = tokenq(capsys, "dlq", "replay", "j-full", "--max-backlog", "0", *where)
    assert status == 3 and "queue full: tiny default lane" in err
    assert conn.get(keys.job("j-full")) == b"error" and conn.xlen(keys.reply("j-full")) == 1
    assert DeadLetters(conn, redis_namespace).count() == len(cases) + 1
    status, out, _ = tokenq(capsys, "dlq", "show", full, *where)
    assert status == 0 and "payload: {" in out and '"prompt": "hi"' in out
    status, out, _ = tokenq(capsys, "dlq", "show", cases["truncated"], *where)
    assert "truncated: True" in out
    # Purge asks first; without a terminal it wants --yes. It deletes only what it counted.
    status, _, err = tokenq(capsys, "dlq", "purge", *where)
    assert status == 2 and "--yes" in err
    letters = DeadLetters(conn, redis_namespace)
    assert letters.count() == 5
    later = dead_letter(conn, keys, "j-later")
    assert letters.purge(full) == 5
    assert [d.id for d in letters.newest(10)] == [later]
    status, out, _ = tokenq(capsys, "dlq", "purge", "--yes", *where)
    assert (status, out) == (0, "deleted 1 dead letter(s)\n")
    assert letters.count() == 0
    conn.close()


def test_result_and_cancel_from_the_command_line(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    where = ["--redis-url", redis_url, "--namespace", redis_namespace]
    later = client.submit("nobody serves this yet", model="other")
    status, _, err = tokenq(capsys, "result", later.id, *where)
    assert (status, err) == (4, f"tokenq: job {later.id} has not ended: it is queued\n")
    status, _, err = tokenq(capsys, "result", "no-such-job", *where)
    assert status == 2 and err.startswith("tokenq: no job no-such-job in namespace")
    status, _, err = tokenq(capsys, "cancel", "no-such-job", *where)
    assert status == 2 and len(err.splitlines()) == 1
    status, _, err = tokenq(capsys, "result", "not a job id!", *where)
    assert status == 2 and "is not a job id" in err
    with WorkerThread(Worker(make_engine(tiny_model), client.redis, fast_config(redis_namespace))):
        job = client.submit("go on for a long while", max_tokens=1900, **GREEDY)
        wait_for(lambda: job.status() == "running")
        status, out, _ = tokenq(capsys, "cancel", job.id, *where)
        assert status == 0 and out.startswith(f"cancel requested for job {job.id} (running)")
        status, out, err = tokenq(capsys, "result", job.id, "--json", "--timeout", "30", *where)
        assert status == 0, err
        done = json.loads(out)
        assert (done["job_id"], done["type"], done["finish_reason"]) == (
            job.id,
            "done",
            "cancelled",
        )
        assert done["usage"]["completion_tokens"] < 1900
        status, out, _ = tokenq(capsys, "cancel", job.id, *where)
        assert (status, out) == (0, f"job {job.id} has already ended (done): nothing to cancel\n")
        bad = client.submit("bad sampling", temperature=-1.0)
        status, _, err = tokenq(capsys, "result", bad.id, "--timeout", "30", *where)
        assert status == 1 and err.startswith(f"tokenq: job {bad.id} failed: invalid_params: ")
        status, out, _ = tokenq(capsys, "result", bad.id, "--json", *where)
        assert status == 1 and json.loads(out)["code"] == "invalid_params"
    client.close()


def test_the_exporters_gauges_match_redis(redis_url: str, redis_namespace: str) -> None:
    """`tokenq exporter` in its own process, scraped over HTTP, against a fleet state set up
    in Redis: jobs waiting per lane, entries pending for a consumer, dead letters, a live
    and a silent worker."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    for lane, n in (("interactive", 1), ("default", 3), ("batch", 2)):
        for i in range(n):
            client.submit(f"{lane} {i}", lane=lane)
    queue = default_queue(keys)
    conn.xgroup_create(queue, "workers", id="0")
    conn.xreadgroup("workers", "ghost", {queue: ">"}, count=2)
    for i in range(2):
        dead_letter(conn, keys, f"dead-{i}")
    now_ms = int(time.time() * 1000)
    conn.zadd(keys.workers, {"fake-1": now_ms, "gone-1": now_ms - 120_000})
    conn.hset(keys.worker("fake-1"), mapping={"names": json.dumps(["tiny"]), "pid": 1})
    port = free_port()
    argv = ["exporter", "--port", str(port), "--addr", "127.0.0.1"]
    argv += ["--redis-url", redis_url, "--namespace", redis_namespace]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenq.cli", *argv], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                samples = scrape(port)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    names = {n for n, _, _ in samples}
    assert names == set(FLEET_METRICS)
    assert total(samples, "tokenq:redis_up") == 1

    def lane(name: str, lane: str) -> float:
        return total(samples, f"tokenq:{name}", model="tiny", lane=lane)

    assert [lane("queue_backlog", x) for x in ("interactive", "default", "batch")] == [1, 3, 2]
    assert [lane("queue_waiting", x) for x in ("interactive", "default", "batch")] == [1, 1, 2]
    assert [lane("queue_pending", x) for x in ("interactive", "default", "batch")] == [0, 2, 0]
    # The oldest job no worker has taken in the default lane is its third one.
    third = conn.xrange(queue, "-", "+")[2][0]
    age = time.time() - int(third.split(b"-")[0]) / 1000
    assert 0 <= lane("queue_oldest_waiting_seconds", "default") <= age + 1
    assert lane("queue_oldest_waiting_seconds", "batch") > 0
    assert total(samples, "tokenq:pending_entries", consumer="ghost") == 2
    assert total(samples, "tokenq:pending_entries") == 2
    assert total(samples, "tokenq:pending_max_idle_seconds", consumer="ghost") >= 0
    assert total(samples, "tokenq:dead_letters") == 2
    assert total(samples, "tokenq:workers_live", model="tiny") == 1
    assert total(samples, "tokenq:workers_silent") == 1
    client.close()


def test_the_fleet_collector_says_when_redis_does_not_answer() -> None:
    conn = redis.Redis(port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    families = list(FleetCollector(conn, "nowhere").collect())
    assert [(f.name, [s.value for s in f.samples]) for f in families] == [("tokenq:redis_up", [0])]


def test_observe_many_fills_a_histogram_as_one_observe_per_value() -> None:
    """The worker records a job's inter-token gaps in one call; the histogram must read as
    if each gap had been observed alone, bucket edges included."""
    rng = random.Random(7)
    values = [rng.random() ** 3 * 3 for _ in range(500)] + [0.0, 0.001, 0.0025, 640.0, 1e4]
    one, many = CollectorRegistry(), CollectorRegistry()
    h_one = Histogram("gap", "gap", ["model"], buckets=LATENCY_BUCKETS, registry=one)
    h_many = Histogram("gap", "gap", ["model"], buckets=LATENCY_BUCKETS, registry=many)
    for v in values:
        h_one.labels("m").observe(v)
    observe_many(h_many.labels("m"), values)
    observe_many(h_many.labels("m"), [])

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for metric in registry.collect()
            for s in metric.samples
            if not s.name.endswith("_created")
        }

    got, expected = samples(many), samples(one)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
