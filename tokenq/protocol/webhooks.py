"""Webhooks on the wire: a job's `webhook` and `webhook_events_filter` (Replicate's names),
the event entries workers and gateways write for dispatchers, and the Standard Webhooks
body a receiver gets (docs/protocol.md, "Webhooks")."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tokenq.protocol.errors import quote

# What a job's `webhook_events_filter` may name, and what it is without one.
START, OUTPUT, COMPLETED = "start", "output", "completed"
EVENT_FILTERS = (START, OUTPUT, COMPLETED)
DEFAULT_FILTER = (COMPLETED,)
# The body's `type` of each, and of the events endpoints subscribe to.
JOB_STARTED, JOB_OUTPUT, JOB_COMPLETED = "job.started", "job.output", "job.completed"
JOB_TYPES = {START: JOB_STARTED, OUTPUT: JOB_OUTPUT, COMPLETED: JOB_COMPLETED}
BATCH_TYPES = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
ENDPOINT_TYPES = (JOB_COMPLETED, *BATCH_TYPES)
MAX_URL_CHARS = 2048
# A job's events are delivered in the order of their `seq`: start 0, output the reply
# event's sequence id it follows, completed after everything (a job ends once), then the
# completed event of the endpoints it names.
START_SEQ, COMPLETED_SEQ, ENDPOINTS_SEQ = 0, 10**15, 10**15 + 1
# At most one `output` event a second per job, each with the text so far.
OUTPUT_INTERVAL_S = 1.0
DISPATCHERS = "dispatchers"  # the consumer group of every webhook event stream


def check_webhook(url: Any, events: Any) -> str | None:
    """Why a job's webhook fields are refused (a message naming the field), or None. The
    address itself (https, public) is the dispatcher's to check, when it resolves it."""
    if url is None:
        return None if events is None else "webhook_events_filter needs a webhook"
    if not isinstance(url, str) or len(url) > MAX_URL_CHARS:
        return f"webhook must be a URL of at most {MAX_URL_CHARS} characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a bad port raises)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        return f"webhook {quote(url)} must be an http(s) URL with a host"
    if parts.username or parts.password:
        return "webhook must not carry credentials"
    if events is None:
        return None
    if not isinstance(events, list) or not events or any(e not in EVENT_FILTERS for e in events):
        names = ", ".join(EVENT_FILTERS)
        return f"webhook_events_filter must be a non-empty list of {names}: {quote(events)}"
    return None


# Who registers endpoints: "" the namespace's operator, else an API key's principal id.
OWNER_RE = re.compile(r"[A-Za-z0-9_.@\-]{0,64}")


def check_owner(owner: Any) -> str | None:
    if not isinstance(owner, str) or not OWNER_RE.fullmatch(owner):
        return f"webhook_endpoints {quote(owner)} must match {OWNER_RE.pattern}"
    return None


def job_filter(events: list[str] | None) -> tuple[str, ...]:
    return tuple(events) if events else DEFAULT_FILTER


@dataclass
class HookEvent:
    """One event for dispatchers, as a webhook event stream entry holds it. `url`: a job's
    own webhook (signed with the namespace's secret); without one, the event goes to the
    endpoints of `owner` subscribed to its type ("" for the namespace's own endpoints)."""

    subject: str  # the job or batch id: the event's order and its `webhook-id`
    seq: int
    type: str  # job.started, job.output, job.completed, batch.*
    data: dict[str, Any]
    created: float  # unix seconds
    url: str | None = None
    owner: str = ""

    @property
    def webhook_id(self) -> str:
        """Stable across retries and re-runs: a receiver keeps the ids it handled."""
        if self.type != JOB_OUTPUT:
            return f"msg_{self.subject}_{self.type}"
        return f"msg_{self.subject}_{self.type}_{self.seq}"

    def payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "data": self.data, "created": self.created}
        if self.url is not None:
            out["url"] = self.url
        if self.owner:
            out["owner"] = self.owner
        return out

    @classmethod
    def from_payload(cls, subject: str, seq: int, p: dict[str, Any]) -> HookEvent:
        url, owner = p.get("url"), p.get("owner", "")
        return cls(subject, seq, p["type"], p["data"], p["created"], url, owner)

    def body(self) -> bytes:
        """The Standard Webhooks body: `type`, `timestamp` (when it happened, ISO 8601) and
        `data`."""
        from datetime import UTC, datetime

        stamp = datetime.fromtimestamp(self.created, UTC).isoformat().replace("+00:00", "Z")
        doc = {"type": self.type, "timestamp": stamp, "data": self.data}
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def job_data(
    job_id: str,
    model: str | None,
    status: str,
    *,
    text: str | None = None,
    finish_reason: str | None = None,
    usage: dict[str, int] | None = None,
    metadata: Any = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A job's `data`: what `Job.result()` gives, with the job's id, model and status."""
    data: dict[str, Any] = {"id": job_id, "model": model, "status": status}
    if text is not None:
        data["text"] = text
    if finish_reason is not None:
        data["finish_reason"] = finish_reason
    if usage is not None:
        data["usage"] = usage
    if error is not None:
        data["error"] = error
    data["metadata"] = metadata
    return data
