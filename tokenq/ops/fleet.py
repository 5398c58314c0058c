"""The fleet as Redis holds it: workers, queues, pending entries, dead letters.

Read-only and torch-free, so that anything with a Redis connection can show the fleet:
`tokenq inspect` prints a `Fleet`, `tokenq exporter` serves `FleetCollector`'s gauges to
Prometheus, and the gateway mounts the same collector on its own /metrics. Everything is
read from the keys of docs/protocol.md; no worker needs to be asked.

Ages are measured on Redis's clock (TIME), the clock that stamped the stream entry ids,
so a reader on a machine with a skewed clock still reads them right.

On a Redis Cluster (a `Cluster` given, tokenq/protocol/connection.py) a model's queues,
backlog counters and dead letters are read from every shard and summed; the registry and
metrics are the fleet's own keys, as on one server.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenq.protocol import DEFAULT_NAMESPACE, GROUP, LANES, Keys, lane_of
from tokenq.protocol.connection import Cluster
from tokenq.protocol.keys import Layout

# A worker silent this long is not live (as `ClientConfig.worker_stale_s`).
DEFAULT_STALE_S = 30.0
# Model names are found by SCAN, which walks the whole keyspace: a long-running reader
# (the exporter, the gateway) repeats it at most this often, and in between reads the
# models it knows plus those of live workers.
DEFAULT_RESCAN_S = 60.0
# Pending entries read per queue for their idle times: more than a fleet runs at once.
MAX_PENDING_READ = 10_000
# The load figures a worker's registry entry carries on every heartbeat (docs/protocol.md):
# the batch now, and counters (tokens sampled, TTFT's sum and count) to rate in between.
REGISTRY_FIGURES = (
    "num_requests_running",
    "num_requests_waiting",
    "tokens_generated",
    "ttft_sum_s",
    "ttft_count",
)


@dataclass
class Waiting:
    """The oldest job of a lane that no worker has taken yet."""

    job_id: str | None
    queue: str
    entry_id: str
    age_s: float


@dataclass
class Lane:
    backlog: int = 0  # the lane's counter: outputs (n per job) not acknowledged (QueueFull's bound)
    waiting: int = 0  # entries no worker has taken yet
    pending: int = 0  # entries taken and not acknowledged: running, or their worker died
    oldest: Waiting | None = None


@dataclass
class Model:
    """A name jobs are queued under (a worker's served name or alias, or a name no live
    worker serves yet), with the live workers that take its jobs."""

    name: str
    workers: list[str]
    lanes: dict[str, Lane]


@dataclass
class RegisteredWorker:
    """A registry member. `live`: its heartbeat is fresher than the stale time; a worker
    killed without stopping stays listed, silent, until someone removes it."""

    consumer: str
    live: bool
    heartbeat_at: float  # unix seconds
    heartbeat_age_s: float
    names: list[str] = field(default_factory=list)  # empty once its hash has expired
    host: str | None = None
    pid: int | None = None
    started_at: float | None = None
    # Its metrics summary (`<ns>:metrics:<consumer>`): running, waiting, KV usage, totals.
    load: dict[str, float] = field(default_factory=dict)
    # The load its registry entry carried at its last heartbeat (REGISTRY_FIGURES): fresher
    # than `load`, and counters that a reader rates between two heartbeats.
    figures: dict[str, float] = field(default_factory=dict)


@dataclass
class PendingEntry:
    job_id: str | None  # None when the entry is gone from its stream
    model: str
    lane: str
    queue: str
    entry_id: str
    idle_s: float  # since its consumer last touched it: live workers keep this low
    deliveries: int


@dataclass
class Consumer:
    """The pending entries of one consumer, longest idle first (at most the reader's
    `entries` of them listed; `count` is all)."""

    consumer: str
    live: bool
    count: int
    max_idle_s: float
    entries: list[PendingEntry]


@dataclass
class Webhooks:
    """Webhook events not yet delivered, and deliveries given up (docs/protocol.md)."""

    streams: int = 0  # webhook event streams listed
    backlog: int = 0  # events in them: waiting for a dispatcher, or held by one
    held: int = 0  # of those, held by a dispatcher (delivering, waiting their turn, retrying)
    failures: int = 0  # deliveries given up (the failures stream, capped at about 10,000)
    recent_failures: list[dict[str, str]] = field(default_factory=list)  # the newest few
    endpoints: int = 0
    endpoints_disabled: int = 0  # answered 410 Gone


@dataclass
class Fleet:
    namespace: str
    at: float  # Redis's clock, unix seconds
    models: list[Model]
    workers: list[RegisteredWorker]
    pending: list[Consumer]
    dead_letters: int
    webhooks: Webhooks = field(default_factory=Webhooks)

    def to_json(self) -> dict[str, Any]:
        """As data, each labelled figure of a worker's load nested: `{"name": [{label: value,
        ..., "value": v}]}` rather than Prometheus's `name{label="value"}` as a key."""
        out = asdict(self)
        for worker in out["workers"]:
            worker["load"] = nest_labels(worker["load"])
        return out


LABELLED = re.compile(r"^(\w+)\{(.*)\}$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def nest_labels(figures: dict[str, float]) -> dict[str, Any]:
    """`{'total{code="x"}': 1, 'running': 2}` as `{"total": [{"code": "x", "value": 1}],
    "running": 2}`."""
    out: dict[str, Any] = {}
    for key, value in figures.items():
        found = LABELLED.match(key)
        if found is None:
            out[key] = value
            continue
        labels = dict(LABEL.findall(found[2]))
        out.setdefault(found[1], []).append({**labels, "value": value})
    return out


def _text(value: bytes | str | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return value.decode("utf-8", errors="replace")


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _entry_ms(entry_id: bytes | str) -> int:
    return int((_text(entry_id) or "0").split("-", 1)[0])


def _group(groups: Any) -> dict[str, Any] | None:
    """The workers' consumer group in an XINFO GROUPS answer (an error: no stream)."""
    if not isinstance(groups, list):
        return None
    return next((g for g in groups if g["name"] == GROUP.encode()), None)


def _after(entry_id: bytes | str) -> str:
    """The smallest stream id above `entry_id` (XRANGE from there excludes it)."""
    ms, _, seq = (_text(entry_id) or "0-0").partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def open_layout(conn: redis.Redis | Cluster, namespace: str) -> tuple[Any, Layout]:
    """The connection that reaches any key (on a cluster, redis-py's `RedisCluster`) and
    where the namespace's jobs live: one server, or the cluster's shards."""
    if isinstance(conn, Cluster):
        return conn.redis, conn.layout(namespace)
    return conn, Layout(namespace)


class FleetReader:
    """Reads a `Fleet` from one Redis connection (or a Redis Cluster, every shard); keeps
    the model names it has found so that a reader called every few seconds does not SCAN
    every time."""

    def __init__(
        self,
        conn: redis.Redis | Cluster,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        stale_s: float = DEFAULT_STALE_S,
        rescan_s: float = DEFAULT_RESCAN_S,
    ) -> None:
        self.conn = conn
        self.redis, self.layout = open_layout(conn, namespace)
        self.keys = Keys(namespace)
        self.stale_s = stale_s
        self.rescan_s = rescan_s
        self._names: set[str] = set()
        self._scanned_at = -float("inf")

    def read(self, entries: int = 100) -> Fleet:
        """The fleet now. `entries`: how many pending entries to list per consumer (with
        their job ids); 0 reads only the counts, as a scrape needs."""
        if isinstance(self.conn, Cluster):  # the shard count, set by the first client since
            self.layout = self.conn.layout(self.keys.namespace)
        clock = self.redis.time()
        if isinstance(clock, dict):  # a cluster's: every primary's; any one will do
            clock = next(iter(clock.values()))
        seconds, micros = clock
        now = seconds + micros / 1e6
        workers = self._workers(now)
        live = [w for w in workers if w.live]
        names = self._model_names() | {n for w in live for n in w.names}
        self._names |= names  # a model stays listed when its last worker leaves
        queues = self._queues(sorted(names))
        lanes = self._lanes(sorted(names), queues, now)
        serving = {n: sorted(w.consumer for w in live if n in w.names) for n in names}
        models = [Model(n, serving[n], lanes[n]) for n in sorted(names)]
        pending = self._pending(queues, {w.consumer for w in live}, entries)
        with self.redis.pipeline(transaction=False) as pipe:
            for shard in self.layout.shards:
                pipe.xlen(shard.dead)
            dead = sum(pipe.execute())
        hooks = self._webhooks()
        return Fleet(self.keys.namespace, round(now, 3), models, workers, pending, dead, hooks)

    def _webhooks(self, shown: int = 5) -> Webhooks:
        k = self.keys
        streams = sorted({m.decode() for m in self.redis.smembers(k.hook_streams)})
        streams.append(k.batch_hooks)
        with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xlen(stream)
                pipe.xinfo_groups(stream)
            pipe.xlen(k.webhook_failures)
            pipe.xrevrange(k.webhook_failures, count=shown)
            pipe.hgetall(k.webhook_endpoints)
            answers = pipe.execute(raise_on_error=False)
        backlog = held = 0
        for length, groups in zip(answers[0:-3:2], answers[1:-3:2], strict=True):
            backlog += length if isinstance(length, int) else 0
            if isinstance(groups, list):
                held += sum(int(g.get("pending", 0)) for g in groups)
        failures, recent, records = answers[-3:]
        newest = [{_text(a) or "": _text(b) or "" for a, b in f.items()} for _, f in recent]
        disabled = sum(bool(json.loads(r).get("disabled")) for r in records.values())
        return Webhooks(len(streams) - 1, backlog, held, failures, newest, len(records), disabled)

    # -- workers ---------------------------------------------------------------------------

    def _workers(self, now: float) -> list[RegisteredWorker]:
        members = self.redis.zrange(self.keys.workers, 0, -1, withscores=True)
        with self.redis.pipeline(transaction=False) as pipe:
            for consumer, _ in members:
                pipe.hgetall(self.keys.worker(consumer.decode()))
                pipe.hgetall(self.keys.metrics(consumer.decode()))
            rows = pipe.execute()
        out = []
        for i, (consumer, score) in enumerate(members):
            info, load = rows[2 * i], rows[2 * i + 1]
            age = max(0.0, now - score / 1000)
            worker = RegisteredWorker(
                consumer.decode(), age <= self.stale_s, round(score / 1000, 3), round(age, 3)
            )
            if info:
                worker.names = json.loads(info[b"names"])
                worker.host = _text(info.get(b"host"))
                worker.pid = int(info[b"pid"]) if b"pid" in info else None
                started = info.get(b"started_at")
                worker.started_at = float(started) if started else None
                worker.figures = {
                    name: float(info[name.encode()])
                    for name in REGISTRY_FIGURES
                    if name.encode() in info
                }
            worker.load = {k.decode(): float(v) for k, v in load.items() if k != b"updated_at"}
            out.append(worker)
        return sorted(out, key=lambda w: (not w.live, w.consumer))

    # -- queues ----------------------------------------------------------------------------

    def _model_names(self) -> set[str]:
        """Names with queues or backlog counters, found by SCAN at most every rescan_s."""
        if time.monotonic() - self._scanned_at < self.rescan_s:
            return set(self._names)
        found = set()
        for shard in self.layout.shards:
            queues = f"{shard.prefix}:queues:"
            for key in self.redis.scan_iter(match=_glob_escape(queues) + "*", count=1000):
                found.add(key.decode()[len(queues) :])
            backlog = f"{shard.prefix}:backlog:"
            for key in self.redis.scan_iter(match=_glob_escape(backlog) + "*", count=1000):
                model, _, lane = key.decode()[len(backlog) :].rpartition(":")
                if lane in LANES:
                    found.add(model)
        self._names, self._scanned_at = found, time.monotonic()
        return set(found)

    def _queues(self, names: list[str]) -> dict[str, list[tuple[str, str]]]:
        """Per model, its queues (of every shard) as (stream key, lane)."""
        pairs = [(name, shard) for name in names for shard in self.layout.shards]
        with self.redis.pipeline(transaction=False) as pipe:
            for name, shard in pairs:
                pipe.zrange(shard.queues(name), 0, -1)
            rows = pipe.execute()
        out: dict[str, list[tuple[str, str]]] = {name: [] for name in names}
        for (name, shard), members in zip(pairs, rows, strict=True):
            for member in members:
                priority, _, tenant = member.decode().partition(":")
                out[name].append((shard.queue(name, int(priority), tenant), lane_of(int(priority))))
        return out

    def _lanes(
        self, names: list[str], queues: dict[str, list[tuple[str, str]]], now: float
    ) -> dict[str, dict[str, Lane]]:
        flat = [(name, key, lane) for name in names for key, lane in queues[name]]
        with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                for lane in LANES:
                    for shard in self.layout.shards:
                        pipe.get(shard.backlog(name, lane))
            for _, key, _ in flat:
                pipe.xlen(key)
                pipe.xinfo_groups(key)
            rows = pipe.execute(raise_on_error=False)
        out = {name: {lane: Lane() for lane in LANES} for name in names}
        i = 0
        for name in names:
            for lane in LANES:
                for value in rows[i : i + len(self.layout.shards)]:
                    out[name][lane].backlog += int(value) if isinstance(value, bytes) else 0
                i += len(self.layout.shards)
        heads: list[tuple[Lane, str, str]] = []  # (lane, queue, XRANGE start)
        for name, key, lane in flat:
            length, groups = rows[i], rows[i + 1]
            i += 2
            if not isinstance(length, int) or length == 0:
                continue
            group = _group(groups)
            pending = int(group["pending"]) if group else 0
            row = out[name][lane]
            row.pending += pending
            row.waiting += max(0, length - pending)
            if length > pending:
                start = _after(group["last-delivered-id"]) if group else "-"
                heads.append((row, key, start))
        with self.redis.pipeline(transaction=False) as pipe:
            for _, key, start in heads:
                pipe.xrange(key, start, "+", count=1)
            firsts = pipe.execute(raise_on_error=False)
        for (row, key, _), first in zip(heads, firsts, strict=True):
            if not isinstance(first, list) or not first:
                continue
            entry_id, fields = first[0]
            age = max(0.0, now - _entry_ms(entry_id) / 1000)
            if row.oldest is None or age > row.oldest.age_s:
                row.oldest = Waiting(
                    _text(fields.get(b"id")), key, _text(entry_id) or "", round(age, 3)
                )
        return out

    # -- pending ---------------------------------------------------------------------------

    def _pending(
        self,
        queues: dict[str, list[tuple[str, str]]],
        live: set[str],
        entries: int,
    ) -> list[Consumer]:
        flat = [(name, key, lane) for name, qs in queues.items() for key, lane in qs]
        with self.redis.pipeline(transaction=False) as pipe:
            for _, key, _ in flat:
                pipe.xpending(key, GROUP)
            summaries = pipe.execute(raise_on_error=False)
        counts: dict[str, int] = {}
        busy = []
        for (name, key, lane), summary in zip(flat, summaries, strict=True):
            if not isinstance(summary, dict) or not summary.get("pending"):
                continue
            busy.append((name, key, lane))
            for row in summary["consumers"]:
                consumer = row["name"].decode()
                counts[consumer] = counts.get(consumer, 0) + int(row["pending"])
        listed: dict[str, list[PendingEntry]] = {c: [] for c in counts}
        max_idle: dict[str, float] = dict.fromkeys(counts, 0.0)
        if busy:
            with self.redis.pipeline(transaction=False) as pipe:
                for _, key, _ in busy:
                    # Every entry's idle time (for the longest), however few are listed.
                    pipe.xpending_range(key, GROUP, "-", "+", MAX_PENDING_READ)
                ranges = pipe.execute(raise_on_error=False)
            for (name, key, lane), rows in zip(busy, ranges, strict=True):
                for row in rows if isinstance(rows, list) else []:
                    consumer = row["consumer"].decode()
                    idle = row["time_since_delivered"] / 1000
                    max_idle[consumer] = max(max_idle.get(consumer, 0.0), idle)
                    entry_id = row["message_id"].decode()
                    deliveries = int(row["times_delivered"])
                    entry = PendingEntry(
                        None, name, lane, key, entry_id, round(idle, 3), deliveries
                    )
                    listed.setdefault(consumer, []).append(entry)
        out = []
        for consumer in sorted(counts):
            shown = sorted(listed[consumer], key=lambda e: -e.idle_s)[:entries]
            out.append(
                Consumer(
                    consumer,
                    consumer in live,
                    counts[consumer],
                    round(max_idle[consumer], 3),
                    shown,
                )
            )
        self._job_ids([e for c in out for e in c.entries])
        return out

    def _job_ids(self, entries: list[PendingEntry]) -> None:
        if not entries:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for e in entries:
                pipe.xrange(e.queue, e.entry_id, e.entry_id)
            rows = pipe.execute(raise_on_error=False)
        for e, row in zip(entries, rows, strict=True):
            if isinstance(row, list) and row:
                e.job_id = _text(row[0][1].get(b"id"))


# --- Prometheus ------------------------------------------------------------------------

# Name -> help of every gauge `FleetCollector` yields (tests check dashboards against it).
FLEET_METRICS = {
    "tokenq:redis_up": "1 if Redis answered this scrape, else 0 (and no other gauge)",
    "tokenq:queue_backlog": (
        "Outputs of a lane's jobs added and not acknowledged, n for a job of n (QueueFull's bound)"
    ),
    "tokenq:queue_waiting": "Jobs of a lane that no worker has taken yet",
    "tokenq:queue_pending": "Jobs of a lane taken by a worker and not acknowledged",
    "tokenq:queue_oldest_waiting_seconds": "Age of the lane's oldest job not taken (0: none)",
    "tokenq:pending_entries": "Entries a consumer holds unacknowledged",
    "tokenq:pending_max_idle_seconds": "Longest idle time of a consumer's pending entries "
    "(past the claim time: its worker is dead)",
    "tokenq:dead_letters": "Entries in the dead-letter stream (capped at about 10,000)",
    "tokenq:workers_live": "Live workers serving a model name",
    "tokenq:workers_silent": "Registered workers silent for longer than the stale time",
    "tokenq:webhook_backlog": "Webhook events not yet delivered (waiting or held)",
    "tokenq:webhook_held": "Webhook events held by dispatchers (delivering or retrying)",
    "tokenq:webhook_failures": "Webhook deliveries given up (capped at about 10,000)",
    "tokenq:webhook_endpoints_disabled": "Webhook endpoints disabled by a 410 Gone",
}


class FleetCollector(Collector):
    """The fleet's gauges, read from Redis at each scrape; register it in any
    `CollectorRegistry` (`tokenq exporter` does, the gateway does on its /metrics).

    Give it a synchronous `redis.Redis` with socket timeouts: a scrape runs the reads
    inline, and an unreachable Redis must answer `tokenq:redis_up 0` before the scrape
    times out."""

    def __init__(
        self,
        conn: redis.Redis | Cluster,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        stale_s: float = DEFAULT_STALE_S,
        rescan_s: float = DEFAULT_RESCAN_S,
    ) -> None:
        self.reader = FleetReader(conn, namespace, stale_s=stale_s, rescan_s=rescan_s)

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, labels: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, FLEET_METRICS[name], labels=labels)

        up = gauge("tokenq:redis_up")
        try:
            fleet = self.reader.read(entries=0)
        except redis.RedisError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        by_lane = {
            name: gauge(name, ["model", "lane"])
            for name in (
                "tokenq:queue_backlog",
                "tokenq:queue_waiting",
                "tokenq:queue_pending",
                "tokenq:queue_oldest_waiting_seconds",
            )
        }
        for model in fleet.models:
            for lane_name, lane in model.lanes.items():
                labels = [model.name, lane_name]
                by_lane["tokenq:queue_backlog"].add_metric(labels, lane.backlog)
                by_lane["tokenq:queue_waiting"].add_metric(labels, lane.waiting)
                by_lane["tokenq:queue_pending"].add_metric(labels, lane.pending)
                oldest = lane.oldest.age_s if lane.oldest else 0.0
                by_lane["tokenq:queue_oldest_waiting_seconds"].add_metric(labels, oldest)
        yield from by_lane.values()
        entries = gauge("tokenq:pending_entries", ["consumer"])
        idle = gauge("tokenq:pending_max_idle_seconds", ["consumer"])
        for c in fleet.pending:
            entries.add_metric([c.consumer], c.count)
            idle.add_metric([c.consumer], c.max_idle_s)
        yield entries
        yield idle
        dead = gauge("tokenq:dead_letters")
        dead.add_metric([], fleet.dead_letters)
        yield dead
        live = gauge("tokenq:workers_live", ["model"])
        for model in fleet.models:
            live.add_metric([model.name], len(model.workers))
        yield live
        silent = gauge("tokenq:workers_silent")
        silent.add_metric([], sum(not w.live for w in fleet.workers))
        yield silent
        hooks = fleet.webhooks
        for name, value in (
            ("tokenq:webhook_backlog", hooks.backlog),
            ("tokenq:webhook_held", hooks.held),
            ("tokenq:webhook_failures", hooks.failures),
            ("tokenq:webhook_endpoints_disabled", hooks.endpoints_disabled),
        ):
            figure = gauge(name)
            figure.add_metric([], value)
            yield figure
