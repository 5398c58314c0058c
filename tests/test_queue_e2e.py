"""End to end on the default model: the queue changes nothing about what is generated."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.helpers import DEFAULT_MODEL, make_tiny_llama_dir
from tests.redis_fixtures import CLIENT
from tests.worker_support import WorkerThread, check_reply, fast_config, make_engine
from tokenq.bench.queue import _url_of
from tokenq.engine import SamplingParams
from tokenq.producer.client import Client, make_request
from tokenq.worker.worker import Worker

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about autumn.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Explain gravity in one sentence.",
    "What do bees make?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "List two fruits that are red.",
    "What is a message queue?",
    "Describe the sea in five words.",
    "Why is the sky blue?",
    "What is the largest planet in our solar system?",
    "Suggest a name for a pet turtle.",
]
PARAMS = {"temperature": 0, "max_tokens": 16}


@pytest.mark.slow
def test_sixteen_jobs_through_redis_match_the_engine_exactly(
    redis_url: str, redis_namespace: str
) -> None:
    # No prefix cache: the second run must compute exactly what the first computed.
    engine = make_engine(DEFAULT_MODEL, enable_prefix_caching=False, num_threads=None)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]

    for i, messages in enumerate(conversations):
        engine.add_request(f"direct-{i}", messages=messages, params=SamplingParams(**PARAMS))
    direct = {}
    while engine.has_unfinished():
        direct.update({o.request_id: o for o in engine.step() if o.finished})

    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    jobs = client.submit_many(make_request(messages=m, **PARAMS) for m in conversations)
    with WorkerThread(Worker(engine, client.redis, fast_config(redis_namespace))):
        replies = {job.id: check_reply(list(job.stream(timeout=300))) for job in jobs}

    for i, job in enumerate(jobs):
        expected = direct[f"direct-{i}"]
        reply = replies[job.id]
        assert reply.done.token_ids == expected.token_ids, QUESTIONS[i]
        assert reply.done.text == expected.text
        assert reply.text == reply.done.text  # the streamed pieces join up to the final text
        assert reply.done.finish_reason == expected.finish_reason
    assert "Paris" in replies[jobs[0].id].text
    client.close()


def test_bench_queue_reports_both_sides_and_how_busy_the_engine_was(
    tmp_path: Path, redis_url: str
) -> None:
    model = make_tiny_llama_dir(tmp_path / "tiny")
    cmd = [
        sys.executable, "-m", "tokenq.cli", "bench", "queue", "--model", str(model),
        "--num-threads", "1", "--redis-url", redis_url, "--requests", "4",
        "--prompt-len", "8", "--gen", "4", "--repeat", "2", "--no-warm-up",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "queue/engine throughput" in out.stdout
    # Each alternating pair too, and their median: the best runs of a noisy host may be far apart.
    pattern = r"^each pair .*: throughput ([0-9.]+), ([0-9.]+) \(median ([0-9.]+)\)"
    pairs = re.search(pattern, out.stdout, re.M)
    assert pairs is not None, out.stdout
    first, second, median = map(float, pairs.groups())
    assert median == pytest.approx((first + second) / 2, abs=1e-3)
    ms = r"([-+][0-9.]+)"
    pattern = rf"^each pair .*added TTFT p50 {ms}, {ms} ms \(median {ms} ms\)$"
    added = re.search(pattern, out.stdout, re.M)
    assert added is not None, out.stdout
    first, second, median = map(float, added.groups())
    assert median == pytest.approx((first + second) / 2, abs=0.11)
    for side in ("engine", "queue"):
        pattern = rf"^{side}: steps took ([0-9.]+) s of ([0-9.]+) s .*\(([0-9.]+)% stepping\)$"
        line = re.search(pattern, out.stdout, re.M)
        assert line is not None, out.stdout
        stepping, span, share = map(float, line.groups())
        assert 0 < stepping <= span + 1e-3 and 0 < share <= 100.05
    # The CPU beside the engine: the client's process and redis-server, measured in the run.
    cpu = re.search(r"^CPU beside the engine in that run: (.*): (\d+) us a token", out.stdout, re.M)
    assert cpu is not None, out.stdout
    parts = dict(re.findall(r"([a-z -]+?) ([0-9.]+) s", cpu.group(1)))
    assert {"client process", "redis-server"} <= {k.strip(", ") for k in parts}, cpu.group(1)
    assert int(cpu.group(2)) > 0


def test_bench_queue_gives_its_processes_the_server_it_was_given() -> None:
    """The worker's queue process and the client's process connect by URL: a unix socket
    stays one (it was taken for no server, and the bench ran in-process), and TCP keeps its
    host, port and db."""
    for conn in (
        redis.Redis(unix_socket_path="/run/redis/redis.sock", db=3),
        redis.Redis(host="10.0.0.7", port=6380, db=2),
    ):
        url = _url_of(conn)
        assert url is not None
        again = redis.Redis.from_url(url).connection_pool.connection_kwargs
        for key in ("path", "host", "port", "db"):
            assert again.get(key) == conn.connection_pool.connection_kwargs.get(key), key
