"""Key names: every Redis key tokenq uses, the names that become parts of keys (job ids,
models, tenants), the priority lanes, and the values of a job key (docs/protocol.md,
"Keys")."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_NAMESPACE = "tokenq"
GROUP = "workers"
# Job ids become parts of Redis keys and log lines: keep them printable and bounded. Always
# `fullmatch`: with `match`, `$` would let a trailing newline through.
JOB_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}")
# Model names (vLLM's --served-model-name: "smollm2-135m", "org/Model-7B") and tenants
# become parts of Redis keys and log lines.
MODEL_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/@+\-]{0,127}")
TENANT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@\-]{0,63}")
NO_TENANT = "-"  # the queue of jobs that name no tenant


# Priority lanes: `priority` keeps vLLM's meaning (an int, lower first) and its sign picks
# the lane. Workers serve the lanes in this order, lower lanes aging up (docs/protocol.md).
INTERACTIVE, DEFAULT, BATCH = "interactive", "default", "batch"
LANES = (INTERACTIVE, DEFAULT, BATCH)
LANE_PRIORITY = {INTERACTIVE: -1, DEFAULT: 0, BATCH: 1}  # what `lane=` alone means


def lane_of(priority: int) -> str:
    return INTERACTIVE if priority < 0 else BATCH if priority > 0 else DEFAULT


@dataclass(frozen=True)
class Keys:
    """Every Redis key tokenq uses lives under one namespace, so deployments can share a
    server and tests can clean up after themselves with one SCAN pattern."""

    namespace: str = DEFAULT_NAMESPACE

    @property
    def jobs(self) -> str:
        """Protocol 1's single job stream: workers answer what lands there with a clear
        `unsupported_version` error instead of leaving an old client waiting."""
        return f"{self.namespace}:jobs"

    def queue(self, model: str, priority: int, tenant: str) -> str:
        """A job stream: one per model, priority and tenant, consumer group `workers`."""
        return f"{self.namespace}:jobs:{model}:{priority}:{tenant}"

    def parse_queue(self, stream: str) -> tuple[str, int, str] | None:
        """(model, priority, tenant) of a queue's key; None for protocol 1's stream."""
        prefix = f"{self.namespace}:jobs:"
        if not stream.startswith(prefix):
            return None
        model, priority, tenant = stream[len(prefix) :].rsplit(":", 2)
        return model, int(priority), tenant

    def queues(self, model: str) -> str:
        """Sorted set of a model's queues: member "<priority>:<tenant>", score priority."""
        return f"{self.namespace}:queues:{model}"

    def backlog(self, model: str, lane: str) -> str:
        """Counter of a model's lane: jobs added and not yet acknowledged (QueueFull)."""
        return f"{self.namespace}:backlog:{model}:{lane}"

    def bell(self, model: str) -> str:
        """A one-entry stream producers touch on every submit: idle workers block on it."""
        return f"{self.namespace}:bell:{model}"

    @property
    def workers(self) -> str:
        """Sorted set of live workers: member consumer name, score last heartbeat (ms)."""
        return f"{self.namespace}:workers"

    def worker(self, consumer: str) -> str:
        """Hash of what a worker serves: names, max_model_len, host, pid, times."""
        return f"{self.namespace}:worker:{consumer}"

    @property
    def dead(self) -> str:
        return f"{self.namespace}:dead"

    @property
    def void(self) -> str:
        """A key that is never written: what a script gets in place of a job's keys when
        an entry has no readable job id."""
        return f"{self.namespace}:void"

    def job(self, job_id: str) -> str:
        return f"{self.namespace}:job:{job_id}"

    def reply(self, job_id: str) -> str:
        return f"{self.namespace}:reply:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self.namespace}:cancel:{job_id}"

    def owner(self, job_id: str) -> str:
        return f"{self.namespace}:owner:{job_id}"

    def entry(self, job_id: str) -> str:
        """The job's own queue entry (`<queue key> <entry id>`), while it is queued."""
        return f"{self.namespace}:entry:{job_id}"

    def metrics(self, consumer: str) -> str:
        return f"{self.namespace}:metrics:{consumer}"

    # --- webhooks (docs/protocol.md, "Webhooks") ---

    def hooks(self, queue: str) -> str:
        """The webhook event stream of a queue: the queue's key with its `jobs` part named
        `hooks`, so that it keeps any shard tag the queue's key carries and a script that
        ends a job writes the job's event beside its queue. Consumer group `dispatchers`."""
        prefix = f"{self.namespace}:jobs:"
        if not queue.startswith(prefix):
            raise ValueError(f"not a queue of namespace {self.namespace}: {queue!r}")
        return f"{self.namespace}:hooks:{queue[len(prefix) :]}"

    @property
    def batch_hooks(self) -> str:
        """The webhook event stream of batch events (batch.completed, ...)."""
        return f"{self.namespace}:hooks:batches"

    @property
    def hook_streams(self) -> str:
        """Set of the webhook event streams that dispatchers read, added to by producers
        before they queue a job with a webhook (and by gateways for batches)."""
        return f"{self.namespace}:hookstreams"

    def hook(self, subject: str) -> str:
        """Hash of a job's (or batch's) webhook events: `last`, the seq of the last one
        written; `done`, the seq of the last one delivered (or given up): its events go
        out in order."""
        return f"{self.namespace}:hook:{subject}"

    @property
    def webhook_endpoints(self) -> str:
        """Hash: endpoint id -> its record (URL, event types, owner, encrypted secret)."""
        return f"{self.namespace}:webhook:endpoints"

    @property
    def webhook_gone(self) -> str:
        """Set of jobs' webhook URLs that answered 410 Gone: nothing more is sent there."""
        return f"{self.namespace}:webhook:gone"

    @property
    def webhook_failures(self) -> str:
        """Stream of deliveries given up (retry time spent, endpoint gone, address refused)."""
        return f"{self.namespace}:webhook:failures"


def new_job_id() -> str:
    """A random UUID (version 4) as 32 hex digits, as `uuid.uuid4().hex` writes it, made
    without the UUID object: that cost a client 4.7 us of the 22 us it spent on each job it
    submitted."""
    bits = int.from_bytes(os.urandom(16)) & _UUID4_KEEP | _UUID4_SET
    return f"{bits:032x}"


# The version (4) and variant (10) bits of a random UUID: RFC 4122, 4.4.
_UUID4_KEEP = ~((0xF000 << 64) | (0xC000 << 48)) & ((1 << 128) - 1)
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)
