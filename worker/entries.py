"""From a job stream entry to the engine's arguments, or to a clear rejection."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from tokenq.protocol import (
    DEFAULT_LIMITS,
    JobRequest,
    Limits,
    ProtocolError,
    decode_job,
    pack,
    quote,
)
from tokenq.worker.scripts import Taken


@dataclass
class Rejection:
    """Why an entry is not run. `dead_letter`: poison input, kept for a human to look at;
    other rejections (deadline, cancelled) are the job's normal end."""

    code: str
    message: str
    job_id: str | None = None
    dead_letter: bool = True
    metadata: Any = None  # echoed in the error event when the payload could be read


def lost_payload() -> Rejection:
    return Rejection("lost_payload", "the entry was trimmed from the job stream while pending")


def parse_entry(
    fields: dict[bytes, bytes] | None,
    deliveries: int,
    max_deliveries: int,
    limits: Limits = DEFAULT_LIMITS,
) -> JobRequest | Rejection:
    if not fields:
        return lost_payload()
    try:
        job = decode_job(fields, limits)
    except ProtocolError as exc:
        return Rejection(exc.code, exc.message, exc.job_id)
    if deliveries > max_deliveries:
        return Rejection(
            "max_deliveries_exceeded",
            f"delivered {deliveries} times (limit {max_deliveries}); workers kept failing on it",
            job.job_id,
            metadata=job.metadata,
        )
    return job


def check_model(job: JobRequest, model_names: frozenset[str]) -> Rejection | None:
    if job.model is None or not model_names or job.model in model_names:
        return None
    served = ", ".join(sorted(model_names))
    return Rejection(
        "unknown_model",
        f"model {quote(job.model)} is not served here ({served})",
        job.job_id,
        metadata=job.metadata,
    )


def enqueue_time(entry_id: bytes | str) -> float:
    """Unix seconds at which Redis appended the entry: one clock for every producer."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(eid.split("-", 1)[0]) / 1000.0


def to_monotonic(unix_time: float) -> float:
    """The engine keeps `time.monotonic()` times; the wire carries unix times."""
    return time.monotonic() + (unix_time - time.time())


def derived_seed(job_id: str) -> int:
    """A sampled job without a seed gets one from its id, so a re-run after a crash draws
    the same tokens and continues the reply seamlessly (see worker/replies.py)."""
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:4], "big") & 0x7FFF_FFFF


def engine_params(job: JobRequest) -> dict[str, Any]:
    params = dict(job.params)
    temperature = params.get("temperature", 1.0)
    if params.get("seed") is None and temperature != 0:
        params["seed"] = derived_seed(job.job_id or "")
    return params


def dead_letter(
    delivery: Taken, rejection: Rejection, consumer: str, max_bytes: int
) -> dict[str, Any]:
    """The dead-letter entry: the original fields whole up to `max_bytes`, so a fixed job
    can be re-submitted, else a prefix of each, so poison floods stay bounded."""
    fields = delivery.fields or {}
    truncated = sum(len(k) + len(v) for k, v in fields.items()) > max_bytes
    if truncated:
        share = max_bytes // max(1, len(fields))
        fields = {k[:64]: v[:share] for k, v in list(fields.items())[:16]}
    return {
        "stream": delivery.stream,
        "entry_id": delivery.entry_id,
        "job_id": rejection.job_id or "",
        "code": rejection.code,
        "message": rejection.message,
        "deliveries": delivery.count,
        "consumer": consumer,
        "failed_at": time.time(),
        "fields": pack(fields),
        "truncated": int(truncated),
    }
