"""`tokenq celery`: Celery apps reach tokenq as the Celery task ``tokenq.generate``.

The bridge is a real Celery worker (the `celery` library, thread pool: no fork, and no
torch in it) whose one task submits a tokenq job with job id = Celery task id and follows
the job's reply stream. Celery brings its broker, result backend, canvas (chains, groups,
chords), revoke and retries; tokenq brings what Celery alone cannot give an LLM job:

- no duplicate run: the task id is tokenq's idempotency key, so a message that Celery
  delivers twice (the Redis broker redelivers tasks that outlive ``visibility_timeout``,
  celery#5935; a killed bridge's unacknowledged ``acks_late`` messages) attaches to the job
  already submitted instead of running it again;
- no CUDA in forked pool children: the bridge holds no model, tokenq workers do;
- tokens as they are generated: each token event becomes a ``PROGRESS`` state.

Only `add_parser` and `main` run without celery installed (the command then says what to
install); the rest imports celery where it is used, so `tokenq submit` and `tokenq --help`
never pay for importing it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import socket
import sys
import threading
from collections.abc import Callable, Container, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from tokenq.producer.client import Client, Job
from tokenq.producer.errors import JobFailed, QueueFull, RedisUnavailable, UnknownModel
from tokenq.protocol import (
    PROMPT_FIELDS,
    DoneEvent,
    ErrorEvent,
    Event,
    ProtocolError,
    RestartEvent,
    TokenEvent,
    quote,
)

if TYPE_CHECKING:
    from celery import Celery

TASK_NAME = "tokenq.generate"
DEFAULT_QUEUE = "tokenq"
PROGRESS = "PROGRESS"  # the custom state of a running task; its meta is one reply event
PREVIOUS = "{previous}"  # where a chained task puts the previous task's text
INSTALL_HINT = "tokenq: celery is not installed: pip install 'tokenq[celery]'"
RETRY_CAP = 60.0  # seconds: the longest pause between two retries of one task
# How often the bridge looks at Celery's revoked set for the tasks it runs: the delay a
# revoke adds before the job's cancel key is set.
REVOKE_POLL_S = 0.1

log = logging.getLogger("tokenq.celery")


class JobCancelled(Exception):
    """The job ended with finish reason ``cancelled``: its task becomes REVOKED."""


def job_kwargs(previous: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`Client.submit`'s arguments from the task's.

    The task's one positional argument is its input text: a prompt string
    (``generate.delay("Name three rivers.")``) or what the task before it in a chain
    returned (a result dict, or a chord header's list of them: their texts joined by blank
    lines). Without a prompt keyword it is the prompt; with one it replaces ``{previous}``
    in ``prompt`` or in the messages' contents, by plain replacement (other braces in a
    prompt mean nothing). The job id is the task id, never a keyword: it is what makes a
    redelivered message attach instead of running again.
    """
    if "job_id" in kwargs:
        raise ProtocolError(
            "invalid_request", "the job id is the Celery task id: give task_id= to apply_async"
        )
    if previous is None:
        return kwargs
    text = _text_of(previous)
    if all(kwargs.get(name) is None for name in PROMPT_FIELDS):
        return {**kwargs, "prompt": text}
    prompt, messages = kwargs.get("prompt"), kwargs.get("messages")
    if isinstance(prompt, str) and PREVIOUS in prompt:
        return {**kwargs, "prompt": prompt.replace(PREVIOUS, text)}
    if isinstance(messages, list) and any(_holds_previous(m) for m in messages):
        filled = [
            {**m, "content": m["content"].replace(PREVIOUS, text)} if _holds_previous(m) else m
            for m in messages
        ]
        return {**kwargs, "messages": filled}
    raise ProtocolError(
        "invalid_request",
        f"got the previous task's result but no {PREVIOUS} in prompt or messages to put it "
        "in (a .si() signature ignores the previous result)",
    )


def _holds_previous(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("content"), str)
        and PREVIOUS in message["content"]
    )


def _text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return value["text"]
    if isinstance(value, list | tuple) and value:
        return "\n\n".join(_text_of(v) for v in value)
    raise ProtocolError(
        "invalid_request",
        "the positional argument must be a prompt, a tokenq.generate result or a list of "
        f"them, not {quote(value)}",
    )


def result_of(done: DoneEvent) -> dict[str, Any]:
    """A task's return value: the `done` event as JSON (any Celery serializer takes it);
    a job of n outputs adds ``outputs``, each with its index, text, ids and finish reason
    (``text`` and the rest are output 0's)."""
    result = {
        "text": done.text,
        "finish_reason": done.finish_reason,
        "token_ids": done.token_ids,
        "usage": {**asdict(done.usage), "total_tokens": done.usage.total_tokens},
        "timings": asdict(done.timings),
        "metadata": done.metadata,
    }
    if done.outputs is not None:
        result["outputs"] = [
            {"index": o.index, "text": o.text, "token_ids": o.token_ids}
            | {"finish_reason": o.finish_reason}
            for o in done.outputs
        ]
    return result


def progress_of(event: TokenEvent | RestartEvent) -> dict[str, Any]:
    """A ``PROGRESS`` state's meta: the new text and token ids at `index` (of output
    ``output``, when a job has n). ``restart``: drop what came before, the tokens start
    again at 0 (tokenq's `restart` event, or the task redelivered: its progress is sent
    again from the start)."""
    if isinstance(event, RestartEvent):
        meta: dict[str, Any] = {"index": 0, "token_ids": [], "text": "", "restart": True}
    else:
        meta = {"index": event.index, "token_ids": event.token_ids, "text": event.text}
        if event.logprobs is not None:
            meta["logprobs"] = event.logprobs
        meta["restart"] = False
    if event.output:  # which of a job's n outputs (absent for the first)
        meta["output"] = event.output
    return meta


def retry_countdown(backoff: float, retries: int) -> float:
    """Exponential, capped, and jittered by at most half, so that tasks refused together do
    not come back together, and none comes back sooner than half its step."""
    return min(RETRY_CAP, backoff * 2**retries) * random.uniform(0.5, 1.0)


class RevokeWatcher:
    """Cancels the tokenq jobs of tasks revoked while they run.

    Celery's revoke only adds the task id to the worker's revoked set (the worker itself
    marks REVOKED, and never runs, a task revoked before it starts), and a thread pool
    cannot terminate a running task. So a thread looks at that set every `interval` for
    the tasks this bridge runs and sets their jobs' cancel keys: a job waiting in tokenq's
    queue ends without running, a running one within one engine step, both with finish
    reason ``cancelled``. A task registers before it submits, so a revoke that comes
    between Celery's own check and the submit still cancels the job.
    """

    def __init__(self, client: Client, revoked: Container[str], interval: float) -> None:
        self.client = client
        self.revoked = revoked
        self.interval = interval
        self.lock = threading.Lock()
        # job id -> tasks running it here (a message redelivered to this same bridge while
        # its first delivery still runs makes two).
        self.running: dict[str, int] = {}
        self.cancelled: set[str] = set()
        self.stopped = threading.Event()

    @contextlib.contextmanager
    def watching(self, job_id: str) -> Iterator[None]:
        with self.lock:
            self.running[job_id] = self.running.get(job_id, 0) + 1
        try:
            yield
        finally:
            with self.lock:
                self.running[job_id] -= 1
                if not self.running[job_id]:
                    del self.running[job_id]
                    self.cancelled.discard(job_id)

    def run(self) -> None:
        """The thread's loop, until `stop`."""
        while not self.stopped.wait(self.interval):
            with self.lock:
                revoked = [j for j in self.running if j not in self.cancelled and j in self.revoked]
            for job_id in revoked:
                try:
                    self.client.job(job_id).cancel()
                except RedisUnavailable as exc:  # tried for retry_for; try again next round
                    log.warning("cannot cancel revoked job %s: %s", job_id, exc)
                    continue
                log.info("task %s revoked: its tokenq job is cancelled", job_id)
                with self.lock:
                    self.cancelled.add(job_id)

    def stop(self) -> None:
        self.stopped.set()


class Bridge:
    """What the task does, apart from Celery: submit, follow, translate the outcome."""

    def __init__(self, client: Client, watcher: RevokeWatcher) -> None:
        self.client = client
        self.watcher = watcher

    def run(
        self,
        job_id: str,
        previous: Any,
        kwargs: dict[str, Any],
        progress: Callable[[dict[str, Any]], None],
    ) -> dict[str, Any]:
        """Run (or attach to) job `job_id`, reporting each token event through `progress`.

        Returns the result dict; raises JobFailed on a tokenq error, JobCancelled when the
        job was cancelled, QueueFull or RedisUnavailable when it is worth retrying.
        """
        with self.watcher.watching(job_id):
            try:
                job = self.client.submit(job_id=job_id, **job_kwargs(previous, kwargs))
            except ProtocolError as exc:  # refused before it reached Redis
                raise JobFailed(job_id, exc.code, exc.message) from None
            except UnknownModel as exc:  # an answer, as a refused job is: no traceback
                raise JobFailed(job_id, "unknown_model", str(exc)) from None
            if job.duplicate:
                log.info("task %s: attached to its tokenq job, already submitted", job_id)
                self._check_reply_kept(job)
                progress(progress_of(RestartEvent("redelivered")))
            last: Event | None = None
            for last in job.stream():
                if isinstance(last, TokenEvent | RestartEvent):
                    progress(progress_of(last))
        if isinstance(last, ErrorEvent):
            raise JobFailed(job_id, last.code, last.message)
        assert isinstance(last, DoneEvent), last
        if last.finish_reason == "cancelled":
            raise JobCancelled(job_id)
        return result_of(last)

    def _check_reply_kept(self, job: Job) -> None:
        """A job that ended longer ago than its reply stream's TTL (1 h by default) has no
        reply left to follow: fail rather than wait forever. That happens to a message
        redelivered long after its bridge died, e.g. after a default visibility timeout."""
        if job.status() not in ("done", "error"):
            return
        key = self.client.keys_of(job.id).reply(job.id)
        if not self.client._retrying(lambda: self.client.redis.exists(key)):
            raise JobFailed(
                job.id, "reply_expired", "the job ended and its reply stream has expired"
            )


def make_app(args: argparse.Namespace, bridge: Bridge) -> Celery:
    """The bridge's Celery app, with the task ``tokenq.generate`` registered.

    The guarantees are the task's own options, which no configuration overrides:
    ``acks_late`` with ``reject_on_worker_lost`` (a message is acknowledged only when its
    task has finished, so a bridge that dies loses none; the redelivery attaches), and
    ``track_started``. The task's ``queue`` is the bridge's, so that a chain step this
    bridge sends for the next ``tokenq.generate`` goes to a bridge too.
    """
    from celery import Celery, Task
    from celery.exceptions import Ignore

    app = Celery("tokenq-bridge", set_as_current=False)
    if args.celery_config:
        app.config_from_object(args.celery_config)
    given = {"broker_url": args.broker, "result_backend": args.backend}
    app.conf.update({k: v for k, v in given.items() if v})
    app.conf.update(
        # With acks_late every reserved message stays unacknowledged; reserving one per
        # thread spreads tasks over bridges instead of piling them on the first.
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )

    @app.task(
        name=TASK_NAME,
        bind=True,
        acks_late=True,
        reject_on_worker_lost=True,
        track_started=True,
        throws=(JobFailed,),  # an answer, not a bridge fault: logged without a traceback
        queue=args.queue,
        max_retries=args.max_retries,
    )
    def generate(task: Task, previous: Any = None, **kwargs: Any) -> dict[str, Any]:
        job_id = task.request.id

        def progress(meta: dict[str, Any]) -> None:
            task.update_state(state=PROGRESS, meta=meta)

        try:
            return bridge.run(job_id, previous, kwargs, progress)
        except (QueueFull, RedisUnavailable) as exc:
            # Nothing was queued (QueueFull), or Redis may come back: the same task id
            # comes again, and a job it did queue is attached to, not queued twice.
            countdown = retry_countdown(args.retry_backoff, task.request.retries)
            raise task.retry(exc=exc, countdown=countdown) from None
        except JobCancelled:
            task.backend.mark_as_revoked(job_id, reason="cancelled", request=task.request)
            raise Ignore() from None  # keep REVOKED; the message is acknowledged

    return app


def serve(args: argparse.Namespace) -> int:
    """Run the Celery worker until it is stopped; its exit code."""
    from celery.worker import state as worker_state

    options: dict[str, Any] = {
        "model": args.model,
        "require_worker": not args.queue_anyway,
        "durable_submit": getattr(args, "durable_submit", False),
    }
    if args.max_backlog is not None:
        options["max_backlog"] = args.max_backlog
    client = Client(args.redis_url, namespace=args.namespace, **options)
    watcher = RevokeWatcher(client, worker_state.revoked, REVOKE_POLL_S)
    app = make_app(args, Bridge(client, watcher))
    for setting, flag in (("broker_url", "--broker"), ("result_backend", "--backend")):
        if not app.conf[setting]:
            print(f"tokenq celery: give {flag} (or {setting} in --celery-config)", file=sys.stderr)
            return 2
    threading.Thread(target=watcher.run, name="tokenq-revoke-watcher", daemon=True).start()
    worker = app.Worker(
        # One name per process: a restarted bridge is a new node, not a duplicate one.
        hostname=f"tokenq-{os.getpid()}@{socket.gethostname()}",
        pool_cls="threads",
        concurrency=args.concurrency,
        queues=[args.queue],
        loglevel=args.log_level.upper(),
        without_gossip=True,  # clock sync and elections: nothing the bridge uses
    )
    try:
        worker.start()
    finally:
        watcher.stop()
        client.close()
    return worker.exitcode or 0
