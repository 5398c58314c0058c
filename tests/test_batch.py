"""`tokenq batch run`: an OpenAI batch file through a real Redis and a real worker process
on a tiny model, run as the command itself (a subprocess, killed with SIGKILL to test
resuming)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis

from tests.faults import WorkerProcess
from tests.worker_support import (
    tiny_model,  # noqa: F401
    wait_for,
    wait_for_summaries,
    worker_successes,
)
from tokenq.batch import runner as batch
from tokenq.batch.runner import (
    DoneSet,
    LineError,
    job_id_for,
    load_done,
    parse_line,
    repair,
    scan_input,
)
from tokenq.producer.client import Client
from tokenq.protocol import Keys

MAX_TOKENS = 4
VERDICT = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "schema": {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no"]}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
}


def request_line(i: int, **body: Any) -> dict[str, Any]:
    """Even lines chat, odd lines plain completions: both endpoints in every batch."""
    if i % 2 == 0:
        url = "/v1/chat/completions"
        base = {"model": "tiny", "messages": [{"role": "user", "content": f"Count to {i}."}]}
    else:
        url = "/v1/completions"
        base = {"model": "tiny", "prompt": f"Once upon a time number {i}"}
    base.update({"max_tokens": MAX_TOKENS, "temperature": 0, **body})
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": base}


def write_batch(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    with path.open("w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def records(path: Path) -> list[dict[str, Any]]:
    """The file's whole lines: a running batch may be writing the last one as it is read."""
    if not path.exists():
        return []
    whole = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in whole.splitlines()]


def batch_cmd(url: str, ns: str, source: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "tokenq.cli", "batch", "run", str(source), str(out),
        "--redis-url", url, "--namespace", ns, "--no-progress", "--max-outstanding", "64",
        *extra,
    ]  # fmt: skip


def run_batch(*args: Any, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(batch_cmd(*args), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def worker(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
) -> Iterator[WorkerProcess]:
    extra = ["--max-num-seqs", "32"]
    with WorkerProcess(
        tiny_model, redis_url, redis_namespace, tmp_path / "worker.log", extra=extra
    ) as proc:
        with Client(redis_url, namespace=redis_namespace) as client:
            wait_for(lambda: [m.id for m in client.models()] == ["tiny"], timeout=120)
        yield proc


def done_events(conn: redis.Redis, ns: str, job_id: str) -> int:
    entries = conn.xrange(Keys(ns).reply(job_id))
    return sum(1 for _, fields in entries if fields[b"type"] == b"done")


def test_a_500_line_batch_answers_every_custom_id_once(
    worker: WorkerProcess, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    source = write_batch(tmp_path / "in.jsonl", [request_line(i) for i in range(500)])
    out = tmp_path / "out.jsonl"
    done = run_batch(redis_url, redis_namespace, source, out)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = records(out)
    assert Counter(r["custom_id"] for r in answers) == Counter(f"req-{i}" for i in range(500))
    assert records(out.with_name("out.jsonl.errors")) == []
    batch_id, total = scan_input(source)
    assert total == 500
    for rec in answers:
        response = rec["response"]
        assert rec["error"] is None and response["status_code"] == 200
        assert response["request_id"] == job_id_for(batch_id, rec["custom_id"])
        assert rec["id"].startswith("batch_req_")
        body = response["body"]
        assert body["usage"]["completion_tokens"] <= MAX_TOKENS
        kind = "chat.completion" if int(rec["custom_id"][4:]) % 2 == 0 else "text_completion"
        assert body["object"] == kind
        assert body["model"] == "tiny" and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert "500 lines: 500 done, 0 failed" in done.stderr

    # Run again: everything is answered already; nothing is submitted or written.
    again = run_batch(redis_url, redis_namespace, source, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 done, 0 failed, 500 answered before" in again.stderr
    assert len(records(out)) == 500


def test_a_line_with_n_is_answered_with_n_choices(
    worker: WorkerProcess, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    extra = {"n": 3, "temperature": 0.9, "seed": 4, "ignore_eos": True}
    source = write_batch(tmp_path / "in.jsonl", [request_line(i, **extra) for i in range(2)])
    out = tmp_path / "out.jsonl"
    done = run_batch(redis_url, redis_namespace, source, out)
    assert done.returncode == 0, done.stderr[-3000:]
    for rec in records(out):
        body = rec["response"]["body"]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == 3 * MAX_TOKENS


def test_a_batch_killed_halfway_resumes_without_generating_anything_twice(
    worker: WorkerProcess, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    source = write_batch(tmp_path / "in.jsonl", [request_line(i) for i in range(500)])
    out = tmp_path / "out.jsonl"
    cmd = batch_cmd(redis_url, redis_namespace, source, out)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(records(out)) >= 150, timeout=120, interval=0.005)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    written = records(out)
    assert 150 <= len(written) < 500
    # As if it died in the middle of a write: half of an answer, without its newline.
    missing = next(
        f"req-{i}" for i in range(500) if f"req-{i}" not in {r["custom_id"] for r in written}
    )
    torn = json.dumps({"id": "batch_req_x", "custom_id": missing, "response": {"status_code": 200}})
    with out.open("a") as f:
        f.write(torn[: len(torn) // 2])

    resumed = run_batch(redis_url, redis_namespace, source, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    answers = records(out)
    assert Counter(r["custom_id"] for r in answers) == Counter(f"req-{i}" for i in range(500))
    assert answers[: len(written)] == written  # what the first run wrote is kept as it was
    assert f"{len(written)} answered before" in resumed.stderr

    conn = redis.Redis.from_url(redis_url)
    try:
        batch_id, _ = scan_input(source)
        ids = [job_id_for(batch_id, f"req-{i}") for i in range(500)]
        assert [done_events(conn, redis_namespace, j) for j in ids] == [1] * 500
        # The worker ran 500 jobs in all: none was generated again for the second run.
        wait_for(lambda: worker_successes(conn, redis_namespace) >= 500, timeout=10)
        # A late 501st would show in a summary written a second later.
        wait_for_summaries(conn, redis_namespace, after=time.time() + 1.0)
        assert worker_successes(conn, redis_namespace) == 500
    finally:
        conn.close()


def test_ctrl_c_stops_the_command_cleanly_and_the_same_command_resumes(
    worker: WorkerProcess, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    # Longer answers than the other tests' so that the interrupt lands while most of the
    # batch is still to come (with 4-token answers the whole batch takes about two seconds).
    lines = [request_line(i, max_tokens=16) for i in range(300)]
    source = write_batch(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    cmd = batch_cmd(redis_url, redis_namespace, source, out)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(records(out)) >= 50, timeout=120, interval=0.005)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (len(records(out)), err[-2000:])
    assert "interrupted; run the same command to resume" in err and "Traceback" not in err
    resumed = run_batch(redis_url, redis_namespace, source, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(r["custom_id"] for r in records(out)) == sorted(f"req-{i}" for i in range(300))


def test_malformed_lines_are_reported_with_their_line_numbers_and_the_rest_is_done(
    worker: WorkerProcess, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    good = [request_line(i) for i in range(20)]
    # Structured outputs in a line's body, as the gateway takes them.
    good[0] = request_line(0, max_tokens=40, response_format=VERDICT)
    good[1] = request_line(1, max_tokens=8, structured_outputs={"regex": "[0-9]{3}"})
    unenforceable = {"type": "json_schema", "json_schema": {"schema": {"uniqueItems": True}}}
    lines: list[dict[str, Any] | str] = [
        *good[:5],
        "{not json",  # line 6
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},  # 7: no id
        {**request_line(100), "url": "/v1/embeddings"},  # 8
        {**request_line(101), "body": "text"},  # 9
        {**request_line(102), "method": "GET"},  # 10
        request_line(103, temperature=-1),  # 11: refused before it is submitted
        {**request_line(3)},  # 12: custom_id of line 4 again
        request_line(105, prompt="many words " * 3000),  # 13: the worker refuses it
        *good[5:],
        request_line(106, response_format=unenforceable),  # 29: refused before it is submitted
    ]
    source = write_batch(tmp_path / "in.jsonl", lines)
    with source.open("a") as f:
        f.write("\n   \n")  # blank lines are not requests
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    done = run_batch(redis_url, redis_namespace, source, out, "--errors", str(errors))
    assert done.returncode == 1, done.stderr[-3000:]  # finished, with failed lines
    assert sorted(r["custom_id"] for r in records(out)) == sorted(f"req-{i}" for i in range(20))
    failed = records(errors)
    by_line = {r["error"]["line"]: r for r in failed if r["error"] is not None}
    assert sorted(by_line) == [6, 7, 8, 9, 10]
    assert (
        by_line[6]["error"]["code"] == "invalid_json" and "line 6" in by_line[6]["error"]["message"]
    )
    assert by_line[7]["error"]["code"] == "missing_custom_id"
    assert by_line[8]["custom_id"] == "req-100" and by_line[8]["error"]["code"] == "invalid_url"
    assert by_line[9]["error"]["code"] == "invalid_request"
    assert by_line[10]["error"]["code"] == "invalid_method"
    answered = {r["custom_id"]: r for r in failed if r["error"] is None}
    assert set(answered) == {"req-103", "req-3", "req-105", "req-106"}
    unenforced = answered["req-106"]["response"]["body"]["error"]
    assert unenforced["param"] == "response_format" and "uniqueItems" in unenforced["message"]
    by_id = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in records(out)}
    verdict = json.loads(by_id["req-0"]["message"]["content"])
    jsonschema.validate(verdict, VERDICT["json_schema"]["schema"])
    assert re.fullmatch("[0-9]{3}", by_id["req-1"]["text"])
    refused = answered["req-103"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    too_long = answered["req-105"]["response"]
    assert too_long["status_code"] == 400
    assert too_long["body"]["error"]["code"] == "prompt_too_long"
    assert too_long["request_id"] == job_id_for(scan_input(source)[0], "req-105")
    duplicate = answered["req-3"]["response"]["body"]["error"]
    assert duplicate["code"] == "duplicate_custom_id" and "line 12" in duplicate["message"]
    assert "20 done, 9 failed" in done.stderr

    # A re-run reports nothing twice.
    again = run_batch(redis_url, redis_namespace, source, out, "--errors", str(errors))
    assert "0 done, 0 failed, 29 answered before" in again.stderr, again.stderr[-2000:]
    assert len(records(errors)) == 9
    # Its status describes the whole batch, resumed or not: lines failed.
    assert "(9 of them failed)" in again.stderr, again.stderr[-2000:]
    assert again.returncode == 1, again.stderr[-3000:]


def test_a_line_that_is_not_json_is_named_by_its_own_column() -> None:
    """The parser sees one line: its position is a column of that line (with the line's
    newline it named the next line of a one-line document)."""
    for raw, column in ((b'{"custom_id": "a"\n', 18), (b"{not json\r\n", 2)):
        with pytest.raises(LineError) as info:
            parse_line(raw, 3)
        assert info.value.code == "invalid_json"
        assert info.value.message.startswith("line 3 is not JSON: ")
        assert info.value.message.endswith(f" at column {column}"), info.value.message


def test_results_of_another_batch_are_refused(
    redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    first = write_batch(tmp_path / "a.jsonl", [request_line(1)])
    second = write_batch(tmp_path / "b.jsonl", [request_line(2)])
    out = tmp_path / "out.jsonl"
    batch_id, _ = scan_input(first)
    job = job_id_for(batch_id, "req-1")
    record = {"custom_id": "req-1", "response": {"status_code": 200, "request_id": job}}
    out.write_text(json.dumps(record) + "\n")
    refused = run_batch(redis_url, redis_namespace, second, out)
    assert refused.returncode == 2
    assert "holds results of another batch" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_torn_last_line_is_cut_and_the_done_set_is_compact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out.jsonl"
    whole = [{"custom_id": f"c{i}", "response": None, "error": None} for i in range(3)]
    out.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"custom_id": "c3", "resp')
    repair(out)
    assert out.read_text().endswith("}\n") and len(records(out)) == 3
    done = load_done([out, tmp_path / "absent.jsonl"], "abc")
    assert isinstance(done, DoneSet) and len(done) == 3
    assert done.answered("c2") and not done.answered("c3")
    assert done.keys.itemsize == 8  # 8 bytes per answered line

    # Built from sorted runs merged: with runs of 4 keys, 50 keys make 13 of them.
    monkeypatch.setattr(batch, "SORT_RUN", 4)
    many = DoneSet(batch._key(f"id-{i}", None) for i in range(50))
    assert list(many.keys) == sorted(many.keys) and len(many) == 50
    assert all(many.answered(f"id-{i}") for i in range(50)) and not many.answered("id-50")


def test_a_rerun_after_the_replies_expired_reports_those_lines_and_runs_nothing_again(
    worker: WorkerProcess, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    source = write_batch(tmp_path / "in.jsonl", [request_line(i) for i in range(10)])
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    first = run_batch(redis_url, redis_namespace, source, out, "--errors", str(errors))
    assert first.returncode == 0, first.stderr[-3000:]
    # Three answers lost from the results file, and their replies gone from Redis as
    # they are once the reply TTL passes: nothing is left to follow for them.
    answers = records(out)
    kept, lost = answers[:7], answers[7:]
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    conn = redis.Redis.from_url(redis_url)
    try:
        keys = Keys(redis_namespace)
        assert conn.delete(*(keys.reply(r["response"]["request_id"]) for r in lost)) == 3

        again = run_batch(redis_url, redis_namespace, source, out, "--errors", str(errors))
        assert again.returncode == 1, again.stderr[-3000:]  # finished, with failed lines
        assert "0 done, 3 failed, 7 answered before" in again.stderr, again.stderr[-2000:]
        assert records(out) == kept
        expired = {r["custom_id"]: r["response"] for r in records(errors)}
        assert set(expired) == {r["custom_id"] for r in lost}
        for rec in lost:
            response = expired[rec["custom_id"]]
            assert response["request_id"] == rec["response"]["request_id"]
            assert response["body"]["error"]["code"] == "reply_expired"
            assert "--batch-id" in response["body"]["error"]["message"]
        # Not generated again: the worker ran the ten jobs of the first run only.
        wait_for(lambda: worker_successes(conn, redis_namespace) >= 10, timeout=10)
        # A late 11th would show in a summary written a second later.
        wait_for_summaries(conn, redis_namespace, after=time.time() + 1.0)
        assert worker_successes(conn, redis_namespace) == 10
    finally:
        conn.close()
