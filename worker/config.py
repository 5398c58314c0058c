"""Worker settings (the queue side only; the engine has its own EngineConfig), and the
worker's Redis connection."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import redis

from tokenq.protocol import DEFAULT_LIMITS, DEFAULT_NAMESPACE, GROUP, Limits
from tokenq.protocol.connection import Cluster, keepalive_for
from tokenq.protocol.connection import connect as connect_url


def default_consumer() -> str:
    """Host and pid: unique per process. Give a stable name (``--consumer``) where a
    restarted worker should replay its own pending jobs at once instead of waiting for
    another worker to reclaim them after ``claim_idle_ms``."""
    return f"{socket.gethostname()}-{os.getpid()}"


# Where a worker's Redis work runs (`tokenq worker --redis-side`, worker/host.py).
REDIS_SIDES = ("auto", "process", "threads")


@dataclass
class WorkerConfig:
    namespace: str = DEFAULT_NAMESPACE
    group: str = GROUP
    consumer: str = field(default_factory=default_consumer)
    # The names this worker serves (vLLM's --served-model-name), the first the model's id
    # in `Client.models()`: it consumes the queues of each.
    served_names: tuple[str, ...] = ()
    # How long a Redis thread waits for work before it looks again (the intake's doorbell
    # XREAD BLOCK; new jobs ring it at once): bounds how soon a stop is seen. Shorter wakes
    # the worker and Redis more often, which a host whose cores the engine fills feels.
    block_ms: int = 100
    # A job pending this long without a heartbeat belongs to a dead worker.
    claim_idle_ms: int = 60_000
    claim_interval_s: float = 5.0  # at most; a quarter of claim_idle_ms when that is less
    # Must stay well below claim_idle_ms, or live workers lose long jobs to each other;
    # None: a quarter of claim_idle_ms, at most 10 s.
    heartbeat_interval_s: float | None = None
    max_deliveries: int = 3
    reply_ttl_s: int = 3600  # after done/error
    running_reply_ttl_s: int = 24 * 3600  # while running: bounds what a lost job leaves
    # A job's webhook state (the order of its events) outlives the dispatchers' retries.
    hook_ttl_s: int = 25 * 3600
    dead_letter_maxlen: int = 10_000  # entries (approximate, MAXLEN ~)
    # A dead letter keeps the original entry whole up to this size, else a prefix of it:
    # the dead-letter stream stays under about maxlen x this many bytes.
    dead_letter_fields_bytes: int = 32 << 10
    limits: Limits = DEFAULT_LIMITS  # size bounds of a job (tokenq.protocol.Limits)
    # Events a worker holds while Redis is slow or away: past half of it no new job is
    # taken, past all of it the engine pauses until Redis answers again.
    max_outbox_events: int = 65_536
    max_backoff_s: float = 2.0  # between retries while Redis does not answer
    # Tokens after a job's first are published at most this often (a job's first token and
    # its end go out at once): fast engines then cost Redis, the clients and this worker one
    # event per job per interval instead of one per step; with the Redis side in a process
    # of its own, the engine's process also sends them over the pipe that often. 0: every
    # step.
    stream_interval_s: float = 0.02
    metrics_interval_s: float = 10.0  # the summary in Redis and the log line
    # Prometheus metrics over HTTP at http://<metrics_addr>:<metrics_port>/metrics; 0: none.
    metrics_port: int = 0
    metrics_addr: str = "0.0.0.0"
    registry_interval_s: float = 5.0  # how often this worker tells the fleet it is alive
    # Aging: a lane whose oldest waiting job has waited this long is served first, so a
    # flood of higher-priority work delays lower lanes but never starves them.
    lane_max_wait_s: dict[str, float] = field(
        default_factory=lambda: {"interactive": 0.0, "default": 30.0, "batch": 120.0}
    )
    grace_period_s: float = 30.0
    max_step_failures: int = 3  # consecutive failed engine steps before the worker exits

    @property
    def claim_interval(self) -> float:
        """How often to look for orphaned entries: a dead worker's job waits at most about
        claim_idle_ms plus this before a live worker takes it."""
        return min(self.claim_interval_s, self.claim_idle_ms / 4000)

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s is None:
            self.heartbeat_interval_s = min(10.0, self.claim_idle_ms / 4000)
        if self.heartbeat_interval_s * 1000 * 2 > self.claim_idle_ms:
            raise ValueError("heartbeat_interval_s must be under half of claim_idle_ms")
        if self.max_deliveries < 1:
            raise ValueError("max_deliveries must be at least 1")
        if self.block_ms < 1:
            raise ValueError("block_ms must be at least 1")


def connect(redis_url: str, config: WorkerConfig) -> redis.Redis | Cluster:
    """The worker's connection, in whichever process its Redis side runs (a `Cluster` for
    a node of a Redis Cluster). Every read times out past the longest block, so a silent
    Redis is waited out with backoff like one that refuses (redis-py before 8 waits
    forever by default)."""
    return connect_url(
        redis_url,
        socket_connect_timeout=5,
        socket_timeout=5 + config.block_ms / 1000,
        **keepalive_for(redis_url),
    )
