"""The Files and Batches API of `tokenq serve`, through the official `openai` SDK: a real
gateway process, a real Redis, a real worker process on a tiny random Llama ("tiny")."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from tests.faults import WorkerProcess
from tests.helpers import make_tiny_llama_dir
from tests.test_gateway import GatewayProcess
from tests.worker_support import wait_for, wait_for_summaries, worker_successes
from tokenq.batch.runner import job_id_for

POLL = "0.2"  # the gateways' --batch-poll


@pytest.fixture(scope="module")
def namespace(redis_url: str) -> Iterator[str]:
    ns = f"tqba-{uuid.uuid4().hex[:10]}"
    yield ns
    conn = redis.Redis.from_url(redis_url)
    keys = list(conn.scan_iter(match=f"{ns}:*", count=1000))
    if keys:
        conn.delete(*keys)
    conn.close()


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, namespace: str
) -> Iterator[WorkerProcess]:
    root = tmp_path_factory.mktemp("batch-api")
    model = make_tiny_llama_dir(root / "tiny")
    with WorkerProcess(
        model, redis_url, namespace, root / "worker.log", extra=["--max-num-seqs", "32"]
    ) as proc:
        proc.wait_registered()
        yield proc


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, namespace: str, worker: WorkerProcess
) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    proc = GatewayProcess(redis_url, namespace, log, "--batch-poll", POLL)
    yield proc
    proc.close()


def line(i: int, **body: Any) -> dict[str, Any]:
    base = {"model": "tiny", "messages": [{"role": "user", "content": f"Say {i}."}]}
    base.update({"max_tokens": 4, "temperature": 0, **body})
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": base}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def upload(sdk: openai.OpenAI, content: bytes) -> str:
    return sdk.files.create(file=("requests.jsonl", content), purpose="batch").id


def wait_status(sdk: openai.OpenAI, batch_id: str, *wanted: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in wanted:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.1)


def lines_of(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in sdk.files.content(file_id).text.splitlines()]


def test_a_gateway_killed_mid_batch_is_taken_over_by_one_and_nothing_runs_twice(
    worker: WorkerProcess, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    # First in the file, before the module's gateway starts: the batch must be the dead
    # gateway's alone.
    conn = redis.Redis.from_url(redis_url)
    before = worker_successes(conn, namespace)
    first = GatewayProcess(
        redis_url, namespace, tmp_path / "a.log", "--batch-poll", POLL, "--batch-lock-ttl", "2"
    )
    try:
        sdk = first.sdk(max_retries=0)
        content = jsonl([line(i, max_tokens=8) for i in range(300)])
        batch = sdk.batches.create(
            input_file_id=upload(sdk, content),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 60, 60)
    finally:
        first.proc.kill()
        first.proc.wait(timeout=10)
    stalled = conn.hgetall(f"{namespace}:batch:{batch.id}")
    assert stalled[b"status"] == b"in_progress" and int(stalled[b"completed"]) < 300
    # Two more gateways race for the batch once the dead one's lock has expired: one takes
    # it (had both run it, answers would be written twice).
    second = GatewayProcess(redis_url, namespace, tmp_path / "b.log", "--batch-poll", POLL)
    third = GatewayProcess(redis_url, namespace, tmp_path / "c.log", "--batch-poll", POLL)
    try:
        sdk = second.sdk()
        done = wait_status(sdk, batch.id, "completed", timeout=120)
        answers = lines_of(third.sdk(), done.output_file_id)
    finally:
        second.close()
        third.close()
    assert (done.request_counts.completed, done.request_counts.failed) == (300, 0)
    assert Counter(a["custom_id"] for a in answers) == Counter(f"c{i}" for i in range(300))
    try:
        # Every answer counted, and a late 301st would show: a summary a second later.
        wait_for_summaries(conn, namespace, after=time.time() + 1.0)
        assert worker_successes(conn, namespace) - before == 300
    finally:
        conn.close()


def test_a_batch_runs_through_the_sdk_and_its_files_hold_every_answer_once(
    gateway: GatewayProcess,
) -> None:
    sdk = gateway.sdk()
    requests = [line(i) for i in range(60)] + [line(60, temperature=-1)]
    content = jsonl(requests)
    file = sdk.files.create(file=("requests.jsonl", content), purpose="batch")
    assert file.bytes == len(content) and file.purpose == "batch"
    assert sdk.files.retrieve(file.id).filename == "requests.jsonl"
    assert sdk.files.content(file.id).content == content

    batch = sdk.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_status(sdk, batch.id, "completed")
    assert done.request_counts.total == 61
    assert (done.request_counts.completed, done.request_counts.failed) == (60, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.created_at <= done.in_progress_at <= done.completed_at

    answers = lines_of(sdk, done.output_file_id)
    assert Counter(a["custom_id"] for a in answers) == Counter(f"c{i}" for i in range(60))
    for a in answers:
        assert a["response"]["status_code"] == 200
        assert a["response"]["request_id"] == job_id_for(batch.id, a["custom_id"])
        assert a["response"]["body"]["object"] == "chat.completion"
        assert a["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    (refused,) = lines_of(sdk, done.error_file_id)
    assert refused["custom_id"] == "c60" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "temperature"
    assert sdk.files.retrieve(done.output_file_id).bytes == len(
        sdk.files.content(done.output_file_id).content
    )
    assert batch.id in [b.id for b in sdk.batches.list(limit=100).data]


def test_a_file_with_bad_lines_fails_validation_with_their_line_numbers(
    gateway: GatewayProcess,
) -> None:
    sdk = gateway.sdk()
    content = jsonl([line(0), "{oops", line(2), line(0), {**line(4), "url": "/v1/completions"}])
    batch = sdk.batches.create(
        input_file_id=upload(sdk, content),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    failed = wait_status(sdk, batch.id, "failed", timeout=30)
    errors = {e.line: e.code for e in failed.errors.data}
    assert errors == {2: "invalid_json", 4: "duplicate_custom_id", 5: "mismatched_url"}
    assert failed.output_file_id is None and failed.failed_at

    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(
            input_file_id="file_missing", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError):
        sdk.batches.create(
            input_file_id=upload(sdk, content), endpoint="/v1/embeddings", completion_window="24h"
        )


def test_cancel_stops_a_running_batch_and_keeps_what_was_answered(
    gateway: GatewayProcess, redis_url: str, namespace: str
) -> None:
    sdk = gateway.sdk()
    long = {"max_tokens": 1500, "ignore_eos": True}
    content = jsonl(
        [line(i, max_tokens=4) for i in range(4)] + [line(i, **long) for i in range(4, 100)]
    )
    batch = sdk.batches.create(
        input_file_id=upload(sdk, content), endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 4, 60, 0.1)
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    cancelled = wait_status(sdk, batch.id, "cancelled", timeout=30)
    assert 4 <= cancelled.request_counts.completed < 100
    answers = lines_of(sdk, cancelled.output_file_id)
    assert len(answers) == cancelled.request_counts.completed
    assert {f"c{i}" for i in range(4)} <= {a["custom_id"] for a in answers}

    # The long jobs it had queued were stopped, not left running.
    conn = redis.Redis.from_url(redis_url)
    try:
        statuses = [
            conn.get(f"{namespace}:job:{job_id_for(batch.id, f'c{i}')}") for i in range(4, 100)
        ]
        assert b"running" not in statuses
    finally:
        conn.close()
    assert sdk.batches.cancel(batch.id).status == "cancelled"  # again: no change
    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(_completed_batch(sdk))


def _completed_batch(sdk: openai.OpenAI) -> str:
    batch = sdk.batches.create(
        input_file_id=upload(sdk, jsonl([line(0)])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    return wait_status(sdk, batch.id, "completed").id


def test_a_batch_past_its_window_expires_and_keeps_what_was_answered(
    gateway: GatewayProcess, redis_url: str, namespace: str
) -> None:
    sdk = gateway.sdk()
    long = {"max_tokens": 1500, "ignore_eos": True}
    content = jsonl([line(i) for i in range(2)] + [line(i, **long) for i in range(2, 60)])
    batch = sdk.batches.create(
        input_file_id=upload(sdk, content), endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.expires_at == batch.created_at + 24 * 3600
    wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 2, 60, 0.1)
    conn = redis.Redis.from_url(redis_url)
    try:  # 24 hours pass
        conn.hset(f"{namespace}:batch:{batch.id}", "expires_at", int(time.time()) - 1)
    finally:
        conn.close()
    expired = wait_status(sdk, batch.id, "expired", timeout=30)
    assert expired.expired_at and 2 <= expired.request_counts.completed < 60
    assert len(lines_of(sdk, expired.output_file_id)) == expired.request_counts.completed


def test_batches_are_listed_newest_first_a_page_at_a_time(gateway: GatewayProcess) -> None:
    sdk = gateway.sdk()
    ids = [
        sdk.batches.create(
            input_file_id=upload(sdk, jsonl([line(i)])),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        ).id
        for i in range(3)
    ]
    first = sdk.batches.list(limit=2)
    assert first.has_more and len(first.data) == 2
    listed = [b.id for b in sdk.batches.list(limit=2)]  # the SDK follows `after` page by page
    assert listed[:3] == ids[::-1] and len(listed) == len(set(listed))
    with pytest.raises(openai.NotFoundError):
        sdk.batches.retrieve("batch_missing")
    with pytest.raises(openai.NotFoundError):
        sdk.files.content("file_missing")
