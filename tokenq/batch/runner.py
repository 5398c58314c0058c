"""Batch files: OpenAI batch input lines in, OpenAI batch output lines out (`tokenq batch run`).

A batch is a stream, never a list: the input is read line by line, at most
`max_outstanding` jobs are queued and not yet written at any time, and results are
appended to the output as they arrive (in any order, as OpenAI's). Memory therefore stays
flat whatever the file's length, except for one compact set: the 8-byte digests of the
custom_ids already answered by an earlier run (`DoneSet`, 8 MB per million lines).

Resuming is what the queue already guarantees, used deliberately:

- A job's id is derived from the batch id and its `custom_id` (`job_id_for`), and job ids
  are idempotency keys: a re-run submits the same ids, so a job queued or finished by an
  interrupted run is followed, never generated twice.
- The output and errors files are the record of what is finished: a re-run reads them
  first (a torn last line, from a crash mid-write, is cut off), and skips every custom_id
  they answer. What ran but was not written is followed again from its reply stream.

The batch id defaults to the SHA-256 of the input's bytes, so the same file resumes and an
edited file is a new batch; `--batch-id` names it explicitly (to keep results after an
edit). Each job carries its line number in its metadata: a duplicate custom_id shares the
first line's job, and the line number in its answer tells the two apart with no table of
custom_ids held in memory. (So a `--batch-id` kept across an edit that moves lines reports
a job the earlier run queued and never wrote as a duplicate: edit, then resume, with care.)

OpenAI body <-> tokenq job conversion is the gateway's (`tokenq/server/openai_api.py`); this
module imports no torch.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import hashlib
import heapq
import json
import re
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from tokenq.producer.client import Client, Job, make_request
from tokenq.producer.errors import QueueFull, UnknownModel
from tokenq.protocol import (
    BATCH,
    TERMINAL_EVENTS,
    DoneEvent,
    ErrorEvent,
    Event,
    JobRequest,
    ProtocolError,
    RestartEvent,
    TokenEvent,
    lane_of,
)
from tokenq.server.openai_api import (
    BadRequest,
    ChoiceLogprobs,
    Rendering,
    job_error,
    rendering,
    response_body,
    to_submit_kwargs,
)

# The endpoints a batch line may name, and the kind the conversion functions take.
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# A batch id becomes part of every job id (protocol.JOB_ID_RE, 128 characters in all).
BATCH_ID_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")
CHUNK = 64  # jobs per submit script call, and per follower thread
QUEUE_FULL_PAUSE = 1.0  # seconds between tries while the batch lane is at its cap
EXPIRED = "the job ended and its reply stream has expired (to run it again: a new --batch-id)"


class BatchError(Exception):
    """The batch cannot run at all (as opposed to one line failing): a message for the user."""


class LineError(Exception):
    """One input line that cannot become a job; reported in the errors file with its
    line number, and the batch goes on."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.custom_id = custom_id


@dataclass(frozen=True)
class BatchLine:
    """One well-formed input line."""

    line: int  # 1-based, counting every line of the file
    custom_id: str
    kind: str  # "chat" or "completions"
    body: dict[str, Any]


def parse_line(raw: bytes, line: int) -> BatchLine:
    """A batch line, or LineError naming what is wrong with it."""
    try:
        obj = json.loads(raw.rstrip(b"\r\n"))
    except UnicodeDecodeError as exc:
        raise LineError("invalid_json", f"line {line} is not UTF-8: {exc}") from None
    except RecursionError:
        raise LineError("invalid_json", f"line {line} is nested too deeply to parse") from None
    except json.JSONDecodeError as exc:  # its own position: the line is all the parser saw
        where = f"column {exc.colno}" if exc.lineno == 1 else f"char {exc.pos}"
        raise LineError("invalid_json", f"line {line} is not JSON: {exc.msg} at {where}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"line {line} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", f"line {line} has no custom_id (a string)")
    if obj.get("method", "POST") != "POST":
        raise LineError("invalid_method", f"line {line}: method must be POST", custom_id)
    url = obj.get("url")
    if url not in ENDPOINTS:
        urls = ", ".join(ENDPOINTS)
        raise LineError("invalid_url", f"line {line}: url {url!r} is not one of {urls}", custom_id)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", f"line {line}: body must be a JSON object", custom_id)
    return BatchLine(line, custom_id, ENDPOINTS[url], body)


def scan_input(path: Path) -> tuple[str, int]:
    """(the default batch id, the number of non-blank lines): one pass over the file, so
    that the progress bar knows its total and the same bytes always get the same jobs."""
    digest = hashlib.sha256()
    count = 0
    with path.open("rb") as f:
        for raw in f:
            digest.update(raw)
            count += bool(raw.strip())
    return digest.hexdigest()[:16], count


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line, streamed."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield number, raw


def job_id_for(batch_id: str, custom_id: str) -> str:
    """The job id of a line: the same batch and custom_id always give the same id, which
    is what makes a re-run follow the job rather than generate it again."""
    digest = hashlib.blake2b(custom_id.encode(), digest_size=12).hexdigest()
    return f"batch-{batch_id}-{digest}"


def _key(custom_id: str | None, line: int | None) -> int:
    """The done-set key of an answered line: its custom_id, or for a malformed line without
    one, its line number. 64 bits: a collision among a million ids has odds of about 3e-8."""
    text = custom_id if custom_id is not None else f"\0line {line}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


SORT_RUN = 1 << 16  # keys sorted at a time: a Python list of them is ~40 bytes per key


def _sorted_array(keys: Iterable[int]) -> array[int]:
    """The keys in a sorted array, without ever holding them all as Python ints (a
    million of those would take 40 MB for a moment): sorted runs, merged."""
    runs: list[array[int]] = []
    run = array("Q")
    for key in keys:
        run.append(key)
        if len(run) >= SORT_RUN:
            runs.append(array("Q", sorted(run)))
            run = array("Q")
    runs.append(array("Q", sorted(run)))
    return runs[0] if len(runs) == 1 else array("Q", heapq.merge(*runs))


class DoneSet:
    """What earlier runs answered, read from the output and errors files: a sorted array of
    64-bit digests (8 bytes per line, against about 100 for a Python set of strings), and
    how many of those answers were failures (a resumed run's exit status describes the
    whole batch)."""

    def __init__(self, keys: Iterable[int] = (), failed: int = 0) -> None:
        self.keys = _sorted_array(keys)
        self.failed = failed

    def __len__(self) -> int:
        return len(self.keys)

    def answered(self, custom_id: str | None, line: int | None = None) -> bool:
        key = _key(custom_id, line)
        i = bisect.bisect_left(self.keys, key)
        return i < len(self.keys) and self.keys[i] == key


def repair(path: Path) -> None:
    """Cut a torn last line (a run killed mid-write) so the file ends on a whole line."""
    if not path.exists():
        return
    with path.open("r+b") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Walk back to the last newline, a block at a time.
        end = size
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            cut = f.read(end - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            end = start
        f.truncate(0)


def load_done(paths: Iterable[Path], batch_id: str) -> DoneSet:
    """The lines answered in these files (repaired first)."""
    sources = []
    for path in paths:
        repair(path)
        if path.exists():
            sources.append((str(path), path.open("rb")))
    try:
        return done_from(sources, batch_id)
    finally:
        for _, f in sources:
            f.close()


def done_from(sources: Iterable[tuple[str, Iterable[bytes]]], batch_id: str) -> DoneSet:
    """The lines answered in these (name, lines) of output and errors. A record from
    another batch means the results belong to another input: refuse rather than mix two
    batches."""
    failed = 0

    def every() -> Iterator[int]:
        nonlocal failed
        for key, error in _answered_keys(sources, f"batch-{batch_id}"):
            failed += error
            yield key

    done = DoneSet(every())
    done.failed = failed  # counted as `every` was read
    return done


def _answered_keys(
    sources: Iterable[tuple[str, Iterable[bytes]]], prefix: str
) -> Iterator[tuple[int, bool]]:
    """(key, answered with an error?) of every record: an error, or a response refusing."""
    for name, lines in sources:
        for number, raw in enumerate(lines, 1):
            try:
                rec = json.loads(raw)
                custom_id = rec.get("custom_id")
                response = rec.get("response") or {}
                error = rec.get("error") or {}
            except (ValueError, AttributeError):
                raise BatchError(f"{name}:{number} is not a batch output line") from None
            request_id = response.get("request_id")
            if request_id is not None and request_id.rpartition("-")[0] != prefix:
                raise BatchError(
                    f"{name} holds results of another batch (request {request_id}; this "
                    f"batch's ids start {prefix}-): the input changed? Write to another "
                    "file, or pass that batch's --batch-id"
                )
            failed = bool(error) or response.get("status_code", 200) != 200
            yield _key(custom_id, error.get("line")), failed


@dataclass
class Counts:
    """A run's tally; `total` counts every non-blank input line."""

    total: int = 0
    already: int = 0  # answered by an earlier run
    already_failed: int = 0  # answers of an earlier run that were errors
    succeeded: int = 0
    failed: int = 0  # answered with an error (worker error, malformed line, duplicate)
    tokens: int = 0  # completion tokens generated in this run
    started: float = field(default_factory=time.monotonic)

    @property
    def answered(self) -> int:
        return self.already + self.succeeded + self.failed

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)


class Meter(Protocol):
    """Counts a batch's jobs against a budget (the gateway's per-key limits)."""

    def charge(self, request: JobRequest) -> float:
        """Count one job before it is submitted: 0, or the seconds until there is room
        (nothing counted)."""
        ...

    def settle(self, job_id: str, used: int) -> None:
        """The job ended having used `used` tokens."""
        ...


class Sink(Protocol):
    """Where answers go: one record at a time, from any thread."""

    def write(self, record: dict[str, Any], error: bool) -> None: ...


def encode_record(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class ResultFiles:
    """The output and errors files, appended to one whole line at a time (one write call,
    flushed at once: a killed run leaves at most a torn last line, which `repair` cuts)."""

    def __init__(self, output: Path, errors: Path) -> None:
        self.output: IO[bytes] = output.open("ab")
        self.errors: IO[bytes] = errors.open("ab")
        self.lock = threading.Lock()

    def write(self, record: dict[str, Any], error: bool) -> None:
        data = encode_record(record)
        f = self.errors if error else self.output
        with self.lock:
            f.write(data)
            f.flush()

    def close(self) -> None:
        self.output.close()
        self.errors.close()


def request_record_id(job_id: str) -> str:
    return "batch_req_" + job_id.rpartition("-")[2]


def error_record(line: int, error: LineError) -> dict[str, Any]:
    """A line that never became a request: OpenAI's shape for an error file line."""
    return {
        "id": None,
        "custom_id": error.custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message, "line": line},
    }


def failure_record(custom_id: str, job_id: str, error: BadRequest) -> dict[str, Any]:
    """A request answered with an HTTP error, as OpenAI writes it to the error file."""
    return {
        "id": request_record_id(job_id),
        "custom_id": custom_id,
        "response": {"status_code": error.status, "request_id": job_id, "body": error.body()},
        "error": None,
    }


@dataclass
class _Pending:
    """A line on its way: converted, given its job id, waiting for its answer."""

    item: BatchLine
    job_id: str
    model: str | None
    request: JobRequest
    form: Rendering  # how the answer shows (logprobs, echo)


class BatchRun:
    """One run of a batch over a client: submit in chunks, follow, write, tally.

    Threads: the caller's reads the input and submits; follower threads (one per chunk of
    jobs, each over the client's single stream reader) write answers as they come. A
    semaphore of `max_outstanding` permits bounds the jobs submitted and not yet written.
    `stop` (from any thread) ends it early: no more submits; with `cancel`, the jobs
    still running are cancelled and their cut-off answers not written.
    """

    def __init__(
        self,
        client: Client,
        sink: Sink,
        batch_id: str,
        *,
        model: str | None = None,
        max_outstanding: int,
        queue_anyway: bool = False,
        on_answer: Callable[[Counts], None] | None = None,
        adjust: Callable[[dict[str, Any]], None] | None = None,
        meter: Meter | None = None,
    ) -> None:
        """`adjust` rewrites each job's arguments (the gateway: its owner's tenant and
        priorities); `meter` counts each job before it is submitted."""
        if max_outstanding < 1:
            raise ValueError("max_outstanding must be at least 1")
        self.client = client
        self.sink = sink
        self.batch_id = batch_id
        self.model = model
        self.queue_anyway = queue_anyway
        self.chunk = min(CHUNK, max_outstanding)
        self.permits = threading.BoundedSemaphore(max_outstanding)
        self.counts = Counts()
        self.on_answer = on_answer
        self.adjust = adjust
        self.meter = meter
        self.lock = threading.Lock()
        # Chunks are submitted short when permits run out: room for more of them than
        # max_outstanding / CHUNK (a chunk holds its thread until its last answer).
        threads = max(2, max_outstanding // 8)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="batch")
        self.futures: set[concurrent.futures.Future[None]] = set()
        self.stopped = threading.Event()
        self.cancelled = False
        self.running: dict[str, Job] = {}  # submitted, not yet answered (for cancel)

    # --- the caller's thread -----------------------------------------------------------

    def run(self, lines: Iterable[tuple[int, bytes]], done: DoneSet) -> Counts:
        """Submit every line not already answered, then wait for every answer."""
        self.counts.already_failed = done.failed
        batch: list[_Pending] = []
        for number, raw in lines:
            if self.stopped.is_set():
                break
            self._check_followers()
            try:
                item = parse_line(raw, number)
            except LineError as exc:
                if not done.answered(exc.custom_id, number):
                    self._answer(error_record(number, exc), error=True)
                else:
                    self._tally(already=1)
                continue
            if done.answered(item.custom_id):
                self._tally(already=1)
                continue
            pending = self._convert(item)
            if pending is None:
                continue
            if not self.permits.acquire(blocking=False):
                # Out of permits: queue what is gathered before waiting, so the workers
                # never idle while a chunk fills up.
                if batch:
                    self._submit(batch)
                    batch = []
                if not self._acquire():
                    break
            batch.append(pending)
            if len(batch) >= self.chunk:
                self._submit(batch)
                batch = []
        if batch and not self.stopped.is_set():
            self._submit(batch)
        while self.futures:
            finished, _ = concurrent.futures.wait(self.futures, timeout=0.5)
            self._reap(finished)
        return self.counts

    def stop(self, cancel: bool = False) -> None:
        """Submit nothing more; `run` returns once the jobs submitted are answered, which
        with `cancel` is at once: they are cancelled (a worker stops them within a step)."""
        self.cancelled = self.cancelled or cancel
        self.stopped.set()
        if cancel:
            with self.lock:
                jobs = list(self.running.values())
            for job in jobs:
                job.cancel()

    def close(self) -> None:
        """Stop following (jobs already queued keep running; a re-run follows them)."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _acquire(self) -> bool:
        """A permit for one more job; False once the run is stopped."""
        while not self.permits.acquire(timeout=0.5):
            if self.stopped.is_set():
                return False
            self._check_followers()
        return True

    def _check_followers(self) -> None:
        self._reap({f for f in self.futures if f.done()})

    def _reap(self, finished: Iterable[concurrent.futures.Future[None]]) -> None:
        for future in finished:
            self.futures.discard(future)
            future.result()  # a follower's failure (Redis gone for retry_for) ends the run

    def _convert(self, item: BatchLine) -> _Pending | None:
        """The job for a line, or None after writing why it cannot be one."""
        job_id = job_id_for(self.batch_id, item.custom_id)
        try:
            kwargs = to_submit_kwargs(item.kind, item.body, self.client.config.limits)
            form = rendering(item.kind, item.body)
        except BadRequest as exc:
            self._answer(failure_record(item.custom_id, job_id, exc), error=True)
            return None
        if self.model is not None:
            kwargs["model"] = self.model
        # Batch work runs in the batch lane; a priority inside it orders the batch's own jobs.
        priority = kwargs.get("priority")
        if priority is None or lane_of(priority) != BATCH:
            kwargs["priority"] = 1
        if self.adjust is not None:
            self.adjust(kwargs)
        metadata = {**kwargs.pop("metadata", {}), "line": item.line}
        request = make_request(job_id=job_id, metadata=metadata, **kwargs)
        return _Pending(item, job_id, kwargs.get("model"), request, form)

    def _submit(self, batch: list[_Pending]) -> None:
        """Queue a chunk in one script call; on a refusal, one at a time to find the lines
        at fault (they are answered, the rest go on)."""
        if self.meter is None:
            self._queue(batch)
            return
        ready: list[_Pending] = []
        for n, pending in enumerate(batch):
            while (wait := self.meter.charge(pending.request)) > 0:
                if ready:  # what has room goes now
                    self._queue(ready)
                    ready = []
                if self.stopped.wait(wait):
                    for _ in batch[n:]:  # never submitted: a re-run does
                        self.permits.release()
                    return
            ready.append(pending)
        if ready:
            self._queue(ready)

    def _queue(self, batch: list[_Pending]) -> None:
        try:
            jobs = self._submit_many([p.request for p in batch])
            accepted = list(zip(batch, jobs, strict=True))
        except (ProtocolError, UnknownModel):
            accepted = []
            for pending in batch:
                try:
                    accepted += zip([pending], self._submit_many([pending.request]), strict=True)
                except ProtocolError as exc:
                    self._refused(pending, job_error(exc.code, exc.message))
                except UnknownModel as exc:
                    error = BadRequest(
                        str(exc), "model", 404, "invalid_request_error", "model_not_found"
                    )
                    self._refused(pending, error)
        if accepted:
            expired = self._expired([job for _, job in accepted if job.duplicate])
            live = []
            for pending, job in accepted:
                if job.id in expired:
                    self._refused(pending, job_error("reply_expired", EXPIRED))
                else:
                    live.append((pending, job))
            if live:
                with self.lock:
                    self.running.update((job.id, job) for _, job in live)
                if self.cancelled:  # stopped while this chunk was on its way
                    for _, job in live:
                        job.cancel()
                self.futures.add(self.pool.submit(self._follow, live))

    def _submit_many(self, requests: list[JobRequest]) -> list[Job]:
        while True:
            try:
                return self.client.submit_many(requests, queue_anyway=self.queue_anyway)
            except QueueFull:  # the batch lane at its cap: wait for the workers
                self._check_followers()
                time.sleep(QUEUE_FULL_PAUSE)

    def _expired(self, jobs: list[Job]) -> set[str]:
        """Jobs submitted before whose reply stream is gone (ended more than the reply TTL
        ago): nothing left to follow, so they are answered with an error, not waited for."""
        if not jobs:
            return set()
        keys_of = self.client.keys_of  # on a cluster, each job's shard

        def read() -> list[Any]:
            with self.client.redis.pipeline(transaction=False) as pipe:
                for job in jobs:
                    pipe.get(keys_of(job.id).job(job.id))
                    pipe.exists(keys_of(job.id).reply(job.id))
                return pipe.execute()

        answers = self.client._retrying(read)
        expired = set()
        for i, job in enumerate(jobs):
            status, kept = answers[2 * i], answers[2 * i + 1]
            if status in (b"done", b"error") and not kept:
                expired.add(job.id)
        return expired

    def _refused(self, pending: _Pending, error: BadRequest) -> None:
        self._answer(failure_record(pending.item.custom_id, pending.job_id, error), error=True)
        self.permits.release()

    # --- follower threads --------------------------------------------------------------

    def _follow(self, live: list[tuple[_Pending, Job]]) -> None:
        """Wait for a chunk's answers and write each as it comes. Lines that share a job (a
        duplicate custom_id inside the chunk) are all answered from its one reply."""
        by_job: dict[str, list[_Pending]] = {}
        jobs: dict[str, Job] = {}
        logprobs: dict[str, ChoiceLogprobs] = {}
        for pending, job in live:
            by_job.setdefault(job.id, []).append(pending)
            jobs[job.id] = job
            if pending.form.logprobs is not None:
                logprobs[job.id] = ChoiceLogprobs()
        for job, event in self.client.stream_many(jobs.values()):
            if job.id in logprobs:
                if isinstance(event, TokenEvent):
                    logprobs[job.id].add(event)
                elif isinstance(event, RestartEvent):
                    logprobs[job.id].restart(event)
            if event.type not in TERMINAL_EVENTS:
                continue
            with self.lock:
                self.running.pop(job.id, None)
            for pending in by_job[job.id]:
                self._finish(pending, event, logprobs.get(job.id))
                self.permits.release()

    def _finish(self, pending: _Pending, event: Event, logprobs: ChoiceLogprobs | None) -> None:
        item = pending.item
        if self.meter is not None:
            used = event.usage.total_tokens if isinstance(event, DoneEvent) else 0
            self.meter.settle(pending.job_id, used)
        line = (event.metadata or {}).get("line") if isinstance(event.metadata, dict) else None
        if line is not None and line != item.line:
            message = f"line {item.line}: custom_id {item.custom_id!r} repeats line {line}'s"
            error = BadRequest(message, "custom_id", code="duplicate_custom_id")
            self._answer(failure_record(item.custom_id, pending.job_id, error), error=True)
            return
        if self.cancelled and isinstance(event, DoneEvent) and event.finish_reason == "cancelled":
            return  # cut off by the batch's cancel: no answer
        if isinstance(event, ErrorEvent):
            error = job_error(event.code, event.message)
            self._answer(failure_record(item.custom_id, pending.job_id, error), error=True)
            return
        assert isinstance(event, DoneEvent)
        model = pending.model or self._served_model()
        created = int(time.time())
        body = response_body(
            item.kind, pending.job_id, model, event, created, logprobs, pending.form
        )
        record = {
            "id": request_record_id(pending.job_id),
            "custom_id": item.custom_id,
            "response": {"status_code": 200, "request_id": pending.job_id, "body": body},
            "error": None,
        }
        self._answer(record, error=False, tokens=event.usage.completion_tokens)

    def _served_model(self) -> str:
        """The model of a line that named none: the client's, or the one model served."""
        if self.client.config.model:
            return self.client.config.model
        models = self.client.models()
        return models[0].id if len(models) == 1 else ""

    # --- either ------------------------------------------------------------------------

    def _answer(self, record: dict[str, Any], error: bool, tokens: int = 0) -> None:
        self.sink.write(record, error)
        if error:
            self._tally(failed=1)
        else:
            self._tally(succeeded=1, tokens=tokens)

    def _tally(self, **add: int) -> None:
        with self.lock:
            for name, value in add.items():
                setattr(self.counts, name, getattr(self.counts, name) + value)
            if self.on_answer is not None:
                self.on_answer(dataclasses.replace(self.counts))
