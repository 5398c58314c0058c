"""A job's webhook events (docs/protocol.md, "Webhooks"): made beside the reply events they
follow and written by the same PUBLISH call, so a job's `completed` event exists exactly
when its terminal event does."""

from __future__ import annotations

import time

from tokenq.protocol import DoneEvent, ErrorEvent, Event, JobRequest, RestartEvent, TokenEvent, pack
from tokenq.protocol.webhooks import (
    COMPLETED,
    COMPLETED_SEQ,
    ENDPOINTS_SEQ,
    JOB_COMPLETED,
    JOB_OUTPUT,
    JOB_STARTED,
    OUTPUT,
    OUTPUT_INTERVAL_S,
    START,
    START_SEQ,
    HookEvent,
    job_data,
    job_filter,
)

Hook = tuple[int, str, bytes]  # seq, the webhook event stream, the event's payload


def completed_hook(job: JobRequest, stream: str, final: Event) -> list[Hook]:
    """The `completed` events of a job that ends with `final`: for its webhook, if its
    filter asks for it, and for the endpoints it names (written just after)."""
    to_url = job.webhook is not None and COMPLETED in job_filter(job.webhook_events_filter)
    if not to_url and job.webhook_endpoints is None:
        return []
    jid = job.job_id
    assert jid is not None
    if isinstance(final, DoneEvent):
        u = final.usage
        usage = {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
        }
        data = job_data(
            jid,
            job.model,
            "done",
            text=final.text,
            finish_reason=final.finish_reason,
            usage=usage,
            metadata=final.metadata,
        )
    else:
        assert isinstance(final, ErrorEvent)
        error = {"code": final.code, "message": final.message}
        data = job_data(jid, job.model, "error", error=error, metadata=final.metadata)
    hooks = []
    if to_url:
        hooks.append(_hook(jid, COMPLETED_SEQ, JOB_COMPLETED, data, job.webhook, stream))
    if job.webhook_endpoints is not None:
        owner = job.webhook_endpoints
        hooks.append(_hook(jid, ENDPOINTS_SEQ, JOB_COMPLETED, data, None, stream, owner))
    return hooks


def _hook(
    jid: str, seq: int, kind: str, data: dict, url: str | None, stream: str, owner: str = ""
) -> Hook:
    event = HookEvent(jid, seq, kind, data, round(time.time(), 3), url, owner)
    return (seq, stream, pack(event.payload()))


class JobHooks:
    """The webhook events a running job owes: `start` with its first events, `output` at
    most once an interval with the text so far, `completed` with its end."""

    def __init__(self, job: JobRequest, stream: str) -> None:
        self.job = job
        self.stream = stream
        self.filter = job_filter(job.webhook_events_filter)
        self.text = ""  # the completion so far, as its reply events give it
        self.started = START not in self.filter
        self.next_output = 0.0

    def follow(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.text += event.text
        elif isinstance(event, RestartEvent):
            self.text = ""

    def owed(self, first_seq: int, outbox: list[Event], status: str) -> list[Hook]:
        """The events to write with this publish of `outbox` (whose first event has
        sequence id `first_seq`); `sent` once the call landed."""
        jid, url = self.job.job_id, self.job.webhook
        assert jid is not None
        hooks: list[Hook] = []
        if url is not None and not self.started and (outbox or status):
            data = job_data(jid, self.job.model, "running")
            hooks.append(_hook(jid, START_SEQ, JOB_STARTED, data, url, self.stream))
        final = outbox[-1] if outbox and status in ("done", "error") else None
        if final is not None:
            return hooks + completed_hook(self.job, self.stream, final)
        if url is None:  # only endpoints: they hear the end alone
            return hooks
        now = time.monotonic()
        if OUTPUT in self.filter and outbox and now >= self.next_output and self.text:
            data = job_data(jid, self.job.model, "running", text=self.text)
            seq = first_seq + len(outbox) - 1  # the last reply event this call writes
            hooks.append(_hook(jid, seq, JOB_OUTPUT, data, url, self.stream))
        return hooks

    def sent(self, hooks: list[Hook]) -> None:
        for seq, _, _ in hooks:
            if seq == START_SEQ:
                self.started = True
            elif seq < COMPLETED_SEQ:
                self.next_output = time.monotonic() + OUTPUT_INTERVAL_S
