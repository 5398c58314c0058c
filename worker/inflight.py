"""What a worker owes Redis: the jobs it runs, each with the events not yet published, and
the entries that end without running. The intake and publisher threads share it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenq.protocol import (
    ERROR,
    ErrorEvent,
    Event,
    JobRequest,
    RestartEvent,
    TokenEvent,
    lane_of,
)
from tokenq.protocol.keys import Layout
from tokenq.worker.config import WorkerConfig
from tokenq.worker.entries import Rejection, dead_letter
from tokenq.worker.hooks import JobHooks, completed_hook
from tokenq.worker.logs import job_log
from tokenq.worker.metrics import WorkerMetrics
from tokenq.worker.replies import Continuation
from tokenq.worker.scripts import Item, Taken, event_arg

if TYPE_CHECKING:
    from tokenq.engine.outputs import RequestDelta


@dataclass
class InFlight:
    """A job this worker owns, from its start until its final event is published."""

    job: JobRequest
    delivery: Taken  # the entry as delivered: settled with the job, its dead letter if fails
    continuation: Continuation
    next_seq: int  # the reply stream sequence id of outbox[0]
    backlog: str | None  # its lane's backlog counter (named in every publish: parsed once)
    outbox: list[Event] = field(default_factory=list)  # events not yet published
    sent: int = 0  # how many of them a publish call has carried (answer pending or lost)
    status: str = ""  # the job key's next value, sent with the outbox
    # Until when the job key says running and the reply stream's running TTL is fresh:
    # `running` goes out with the first events, then only to renew that TTL.
    running_until: float = 0.0
    started: float = field(default_factory=time.monotonic)  # START asked if it was cancelled
    dead: dict[str, Any] | None = None  # a dead letter, sent with a final error
    output: RequestDelta | None = None  # the engine's final output, once finished
    hooks: JobHooks | None = None  # its webhook events, when it has a webhook

    def queue(self, event: Event) -> None:
        """Tokens that follow unpublished tokens join their event: while Redis falls
        behind, a job's pending tokens go out as one. The first `sent` events may be in
        Redis already (a call whose answer never came), so nothing joins them. A job of
        n outputs joins each output's tokens to that output's last event."""
        last = self.outbox[-1] if len(self.outbox) > self.sent else None
        if isinstance(event, TokenEvent) and event.output != getattr(last, "output", 0):
            last = next(
                (
                    e
                    for e in reversed(self.outbox[self.sent :])
                    if not isinstance(e, TokenEvent | RestartEvent) or e.output == event.output
                ),
                None,
            )
        if isinstance(event, TokenEvent) and isinstance(last, TokenEvent):
            last.token_ids = last.token_ids + event.token_ids
            last.text += event.text
            if last.logprobs is not None and event.logprobs is not None:
                last.logprobs = last.logprobs + event.logprobs
        else:
            self.outbox.append(event)
        if self.hooks is not None:
            self.hooks.follow(event)


class InFlightTable:
    """The jobs in flight by job id and the entries to settle, under the table's `lock`
    (the intake adds, the publisher removes); `wake` tells the publisher to settle."""

    def __init__(
        self,
        layout: Layout,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        log: Any,
        wake: Callable[[], None],
    ) -> None:
        self.layout = layout
        self.config = config
        self.metrics = metrics
        self.log = log
        self._wake = wake
        self.lock = threading.Lock()
        self.jobs: dict[str, InFlight] = {}
        self.settling: list[Item] = []  # entries that end without running, to publish

    def add(self, inf: InFlight) -> None:
        with self.lock:
            self.jobs[inf.job.job_id] = inf  # type: ignore[index]

    def take_all(self) -> list[InFlight]:
        with self.lock:
            jobs = list(self.jobs.values())
            self.jobs.clear()
        return jobs

    def running_entries(self) -> set[bytes]:
        with self.lock:
            return {inf.delivery.entry_id for inf in self.jobs.values()}

    def known_entries(self) -> set[bytes]:
        """Every entry this worker holds: running, or waiting to be settled."""
        with self.lock:
            known = {inf.delivery.entry_id for inf in self.jobs.values()}
            return known | {item.entry_id for item in self.settling}

    def outbox_size(self) -> int:
        with self.lock:
            return sum(len(inf.outbox) for inf in self.jobs.values())

    def oldest_start(self, default: float) -> float:
        with self.lock:
            return min((inf.started for inf in self.jobs.values()), default=default)

    def backlog(self, delivery: Taken) -> str | None:
        """The backlog counter of the lane an entry came from (None: protocol 1's stream)."""
        keys = self.layout.of_key(delivery.stream)  # the entry's shard
        queue = keys.parse_queue(delivery.stream.decode())
        return None if queue is None else keys.backlog(queue[0], lane_of(queue[1]))

    def hook_stream(self, delivery: Taken) -> str | None:
        """The webhook event stream of the queue an entry came from (None: protocol 1's)."""
        stream = delivery.stream.decode()
        keys = self.layout.of_key(delivery.stream)  # the entry's shard
        return None if keys.parse_queue(stream) is None else keys.hooks(stream)

    def job_hooks(self, delivery: Taken, job: JobRequest) -> JobHooks | None:
        stream = self.hook_stream(delivery)
        if stream is None or (job.webhook is None and job.webhook_endpoints is None):
            return None
        return JobHooks(job, stream)

    def settle(
        self, delivery: Taken, job_id: str | None, mode: str = "settle", **fields: Any
    ) -> None:
        """Queue an entry's ending for the next PUBLISH (`fields`: the rest of its Item)."""
        backlog, weight = self.backlog(delivery), delivery.weight
        item = Item(
            mode,
            delivery.stream,
            delivery.entry_id,
            job_id,
            backlog=backlog,
            weight=weight,
            **fields,
        )
        with self.lock:
            self.settling.append(item)
        self._wake()

    def dead_letter(self, delivery: Taken, rejection: Rejection) -> dict[str, Any]:
        c = self.config
        return dead_letter(delivery, rejection, c.consumer, c.dead_letter_fields_bytes)

    def reject(
        self,
        delivery: Taken,
        rejection: Rejection,
        mode: str = "settle",
        release: bool = False,
        job: JobRequest | None = None,
    ) -> None:
        """End an entry with an error, and a dead letter for poison input. `release`: this
        worker took the job for this entry (else its id may name a job that runs or ended
        elsewhere, whose reply PUBLISH leaves alone). `job`: the entry's job, when it could
        be read (its webhook is told)."""
        jid, eid = rejection.job_id, delivery.entry_id
        queue = self.layout.of_key(delivery.stream).parse_queue(delivery.stream.decode())
        self.metrics.failed(rejection.code, None if queue is None else lane_of(queue[1]))
        job_log(self.log, jid).warning(
            "job rejected", code=rejection.code, message=rejection.message, entry_id=eid.decode()
        )
        dead = self.dead_letter(delivery, rejection) if rejection.dead_letter else None
        events, hooks = [], []
        if jid is not None:
            error = ErrorEvent(rejection.code, rejection.message, rejection.metadata)
            events = [event_arg(error)]
            stream = self.hook_stream(delivery)
            if job is not None and stream is not None:
                hooks = completed_hook(job, stream, error)
        self.settle(
            delivery,
            jid,
            mode,
            status=ERROR,
            events=events,
            dead=dead,
            release=release,
            hooks=hooks,
        )
