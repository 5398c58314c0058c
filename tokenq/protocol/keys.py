"""Key names: every Redis key tokenq uses, the names that become parts of keys (job ids,
models, tenants), the priority lanes, and the values of a job key (docs/protocol.md,
"Keys")."""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

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
    server and tests can clean up after themselves with one SCAN pattern. On a cluster a
    job's keys, its queue's and everything one script call touches live in a shard: under
    `<namespace>:{<tag>}`, one hash slot (`tag`, empty on one server, where the names are
    as they always were). Fleet-wide keys (the registry, metrics) stay under the namespace."""

    namespace: str = DEFAULT_NAMESPACE
    tag: str = ""
    # Where a shard's keys start: the namespace on one server, `<namespace>:{<tag>}` on a
    # cluster. Any per-job or per-queue key derived from it shares the shard's slot.
    prefix: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prefix = f"{self.namespace}:{{{self.tag}}}" if self.tag else self.namespace
        object.__setattr__(self, "prefix", prefix)

    @property
    def jobs(self) -> str:
        """Protocol 1's single job stream: workers answer what lands there with a clear
        `unsupported_version` error instead of leaving an old client waiting."""
        return f"{self.prefix}:jobs"

    def queue(self, model: str, priority: int, tenant: str) -> str:
        """A job stream: one per model, priority and tenant, consumer group `workers`."""
        return f"{self.prefix}:jobs:{model}:{priority}:{tenant}"

    def parse_queue(self, stream: str) -> tuple[str, int, str] | None:
        """(model, priority, tenant) of a queue's key; None for protocol 1's stream."""
        prefix = f"{self.prefix}:jobs:"
        if not stream.startswith(prefix):
            return None
        model, priority, tenant = stream[len(prefix) :].rsplit(":", 2)
        return model, int(priority), tenant

    def queues(self, model: str) -> str:
        """Sorted set of a model's queues: member "<priority>:<tenant>", score priority."""
        return f"{self.prefix}:queues:{model}"

    def backlog(self, model: str, lane: str) -> str:
        """Counter of a model's lane: jobs added and not yet acknowledged (QueueFull)."""
        return f"{self.prefix}:backlog:{model}:{lane}"

    def bell(self, model: str) -> str:
        """A one-entry stream producers touch on every submit: idle workers block on it."""
        return f"{self.prefix}:bell:{model}"

    @property
    def workers(self) -> str:
        """Sorted set of live workers: member consumer name, score last heartbeat (ms)."""
        return f"{self.namespace}:workers"

    def worker(self, consumer: str) -> str:
        """Hash of what a worker serves: names, max_model_len, host, pid, times."""
        return f"{self.namespace}:worker:{consumer}"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def void(self) -> str:
        """A key that is never written: what a script gets in place of a job's keys when
        an entry has no readable job id."""
        return f"{self.prefix}:void"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def reply(self, job_id: str) -> str:
        return f"{self.prefix}:reply:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self.prefix}:cancel:{job_id}"

    def owner(self, job_id: str) -> str:
        return f"{self.prefix}:owner:{job_id}"

    def entry(self, job_id: str) -> str:
        """The job's own queue entry (`<queue key> <entry id>`), while it is queued."""
        return f"{self.prefix}:entry:{job_id}"

    def metrics(self, consumer: str) -> str:
        return f"{self.namespace}:metrics:{consumer}"

    # --- webhooks (docs/protocol.md, "Webhooks") ---

    def hooks(self, queue: str) -> str:
        """The webhook event stream of a queue: the queue's key with its `jobs` part named
        `hooks`, so that it keeps any shard tag the queue's key carries and a script that
        ends a job writes the job's event beside its queue. Consumer group `dispatchers`."""
        prefix = f"{self.prefix}:jobs:"
        if not queue.startswith(prefix):
            raise ValueError(f"not a queue of namespace {self.namespace}: {queue!r}")
        return f"{self.prefix}:hooks:{queue[len(prefix) :]}"

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


def shard_tags(count: int) -> tuple[str, ...]:
    """The hash tags of `count` shards: tag i is the first of `0.0`, `0.1`, ... (`i.k`)
    whose slot falls in the middle half of the i-th of `count` equal slot ranges. Fixed by
    `count` alone, so every process agrees on them, and spread over the slots as
    `redis-cli --cluster create` spreads primaries (equal ranges): with a multiple of the
    primaries' number of shards each primary holds as many."""
    if count <= 0:
        return ()
    width = REDIS_CLUSTER_HASH_SLOTS / count
    tags = []
    for i in range(count):
        low, high = (i + 0.25) * width, (i + 0.75) * width
        k = 0
        while not low <= key_slot(f"{i}.{k}".encode()) < max(high, low + 1):
            k += 1
        tags.append(f"{i}.{k}")
    return tuple(tags)


@dataclass(frozen=True)
class Layout:
    """Where a namespace's jobs live: `count` 0 is one server (the keys without tags),
    else `count` shards of a cluster. A job's shard is the CRC-32 of its id modulo
    `count`, so any producer finds it, and a retry with the same id lands in the same
    shard (where its job key makes it a duplicate)."""

    namespace: str = DEFAULT_NAMESPACE
    count: int = 0
    shards: tuple[Keys, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.count < 0 or self.count > 1024:
            raise ValueError("shards must be between 0 (one server) and 1024")
        shards = tuple(Keys(self.namespace, tag) for tag in shard_tags(self.count))
        object.__setattr__(self, "shards", shards or (Keys(self.namespace),))

    @property
    def keys(self) -> Keys:
        """The fleet-wide keys (registry, metrics), and the only shard on one server."""
        return self.shards[0] if not self.count else Keys(self.namespace)

    @property
    def sharded(self) -> bool:
        return self.count > 0

    def index(self, job_id: str) -> int:
        return zlib.crc32(job_id.encode()) % self.count if self.count else 0

    def of(self, job_id: str) -> Keys:
        """The shard of a job: its job, reply, owner, cancel and entry keys and queue."""
        return self.shards[self.index(job_id)]

    def index_of_key(self, key: str | bytes) -> int:
        """The shard a key of it belongs to (its tag's first number)."""
        if not self.count:
            return 0
        text = key.decode() if isinstance(key, bytes) else key
        start = len(self.namespace) + 2  # past "<namespace>:{"
        return int(text[start : text.index(".", start)])

    def of_key(self, key: str | bytes) -> Keys:
        return self.shards[self.index_of_key(key)]


def shards_key(namespace: str) -> str:
    """A cluster's setting per namespace: how many shards its queues are split into."""
    return f"{namespace}:shards"


def new_job_id() -> str:
    """A random UUID (version 4) as 32 hex digits, as `uuid.uuid4().hex` writes it, made
    without the UUID object: that cost a client 4.7 us of the 22 us it spent on each job it
    submitted."""
    bits = int.from_bytes(os.urandom(16)) & _UUID4_KEEP | _UUID4_SET
    return f"{bits:032x}"


# The version (4) and variant (10) bits of a random UUID: RFC 4122, 4.4.
_UUID4_KEEP = ~((0xF000 << 64) | (0xC000 << 48)) & ((1 << 128) - 1)
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)
