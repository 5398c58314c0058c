"""The worker: moves jobs between Redis and the engine without ever making the engine wait.

Three threads, each with one job (docs/design.md, "The worker"): the engine thread (the
caller of `run()`) only steps the engine through its driver (worker/driver.py); the
intake thread takes jobs (worker/intake.py); the publisher thread writes what the engine
made (worker/publisher.py). The two Redis threads share the in-flight table
(worker/inflight.py). Under `tokenq worker` the Redis threads may run in a process of their
own, the engine across a pipe (worker/host.py, worker/remote.py), with the same code.

Redis faults are ordinary (worker/retry.py): in-flight jobs run on through a short outage,
and the engine pauses only when the events it owes pass a bound.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis
import structlog

from tokenq.engine.prompts import Prompts
from tokenq.protocol import Keys
from tokenq.protocol.connection import Cluster, version_tuple
from tokenq.protocol.keys import Layout
from tokenq.worker.config import WorkerConfig
from tokenq.worker.driver import EngineDriver
from tokenq.worker.heap import frozen_heap
from tokenq.worker.inflight import InFlight, InFlightTable
from tokenq.worker.intake import Intake
from tokenq.worker.metrics import WorkerMetrics
from tokenq.worker.publisher import WAKE, Publisher
from tokenq.worker.scripts import Scripts
from tokenq.worker.shards import ShardedScripts

if TYPE_CHECKING:
    from tokenq.engine.llm_engine import LLMEngine
    from tokenq.worker.remote import RemoteEngine

# The oldest Redis the scripts run on: XAUTOCLAIM, exclusive XRANGE bounds and XTRIM MINID
# came in 6.2. On an older server a worker's scripts would fail or, worse, quietly skip
# what they cannot run (reclaiming a dead worker's jobs among it).
MIN_REDIS = (6, 2)


class UnsupportedRedis(RuntimeError):
    """The server is older than MIN_REDIS, or a cluster node passed as one server (not
    through `connect`): the worker does not start."""


class Worker:
    """Drives one engine from the queues of the models it serves: `run()` serves until
    `stop()`; tests may call `run_once()` (intake, engine, publisher in turn) instead."""

    def __init__(
        self,
        engine: LLMEngine | Prompts,
        conn: redis.Redis | Cluster,
        config: WorkerConfig | None = None,
        driver: RemoteEngine | None = None,
    ) -> None:
        # With `driver` the engine is in another process, and `engine` only its prompts'
        # rules: the intake tokenizes here, off the engine's process.
        self.prompts = engine if isinstance(engine, Prompts) else engine.prompts
        self.driver: EngineDriver | RemoteEngine
        if driver is None:
            assert not isinstance(engine, Prompts), "a worker on threads needs the engine"
            self.driver = EngineDriver(engine)
        else:
            self.driver = driver
        self.config = c = config or WorkerConfig()
        if not c.served_names:
            raise ValueError("a worker serves at least one model name (served_names)")
        self.keys = Keys(c.namespace)
        self.cluster = conn if isinstance(conn, Cluster) else None
        self.scripts: Scripts | ShardedScripts
        if self.cluster is None:
            self.redis = conn
            self.scripts = Scripts(conn, self.keys, c.group, c.consumer)
        else:  # every shard of the namespace, each on the primary holding it
            self.redis = self.cluster.redis
            layout = Layout(c.namespace, self.cluster.shard_count(c.namespace))
            shards = [
                Scripts(self.cluster.bound(k.prefix), k, c.group, c.consumer, sharded=True)
                for k in layout.shards
            ]
            self.scripts = ShardedScripts(layout, shards)
        self.metrics = WorkerMetrics(c.served_names[0], lambda: self.driver.stats)
        # Written into the owner key of each job this process runs: a worker that finds
        # another value there has lost the job and must stop writing to it.
        self.fence = f"{c.consumer}:{uuid.uuid4().hex[:12]}".encode()
        self.log = structlog.get_logger("tokenq.worker")
        layout = self.scripts.layout
        self.table = InFlightTable(
            layout, c, self.metrics, self.log, wake=lambda: self.driver.outputs.put(WAKE)
        )
        self.intake = Intake(
            self.redis, self.scripts, c, self.driver, self.table, self.metrics, self.fence,
            self.log,
            prompts=self.prompts,
            stopping=lambda: self.stopping,
            heartbeat_soon=lambda: self.publisher.heartbeat_soon(),
        )  # fmt: skip
        self.publisher = Publisher(
            self.redis, self.scripts, c, self.driver, self.table, self.metrics, self.fence,
            self.log,
            register=self.register,
            resync=self.intake.resync,
        )  # fmt: skip
        self._stop_at: float | None = None
        self._halt = threading.Event()  # the Redis threads end
        self._crash: BaseException | None = None
        self._started_at = round(time.time(), 3)

    @property
    def in_flight(self) -> dict[str, InFlight]:
        return self.table.jobs

    def stop(self, grace: float | None = None) -> None:
        """Stop taking jobs; give in-flight ones `grace` seconds. Safe in a signal handler;
        a second call can only shorten the grace."""
        at = time.monotonic() + (self.config.grace_period_s if grace is None else grace)
        self._stop_at = at if self._stop_at is None else min(self._stop_at, at)

    @property
    def stopping(self) -> bool:
        return self._stop_at is not None

    def register(self) -> None:
        """Tell the fleet what this worker serves and its load now (`Client.models()`, the
        gateway's /dashboard); renewed on the publisher's timer, removed at the end."""
        c, k = self.config, self.keys
        now = time.time()
        info = {
            "names": json.dumps(list(c.served_names)),
            "max_model_len": self.prompts.max_model_len,
            "host": socket.gethostname(),
            "pid": self.driver.pid,
            "started_at": self._started_at,
            "heartbeat_at": round(now, 3),
            **self.metrics.live(),
        }
        # (On a cluster the registry and a worker's hash are in two slots: two calls.)
        with self.redis.pipeline(transaction=self.cluster is None) as pipe:
            pipe.hset(k.worker(c.consumer), mapping=info)
            pipe.expire(k.worker(c.consumer), max(60, int(3 * c.registry_interval_s)))
            pipe.zadd(k.workers, {c.consumer: int(now * 1000)})
            pipe.execute()

    def _deregister(self) -> None:
        with self.redis.pipeline(transaction=self.cluster is None) as pipe:
            pipe.zrem(self.keys.workers, self.config.consumer)
            pipe.delete(self.keys.worker(self.config.consumer))
            pipe.execute()

    def _check_redis(self) -> None:
        """Refuse a server older than MIN_REDIS, or a cluster node given as a plain
        connection (the keys would lack their shard tags); warn about one that evicts
        keys, which may drop a job or its fence.
        All from INFO, which a worker's ACL allows (CONFIG would give it the server's
        settings, passwords included); a server that does not answer it (managed,
        fakeredis) is trusted."""
        node = self.redis if self.cluster is None else self.scripts.shards[0]._redis  # type: ignore[union-attr]
        try:
            info = node.info()  # the default sections: server and cluster among them
        except redis.RedisError:
            info = {}
        version = str(info.get("redis_version", ""))
        found = version_tuple(version)
        message = None
        if found and found < MIN_REDIS:
            need = ".".join(map(str, MIN_REDIS))
            message = f"Redis {version} is too old: tokenq needs Redis {need} or newer"
        elif info.get("cluster_enabled") and self.cluster is None:
            message = (
                "a Redis Cluster node not usable as a cluster: give a node of a cluster "
                "whose slots are all served (redis+cluster:// forces cluster mode)"
            )
        if message is not None:
            self.log.error("worker not started", error=message)
            raise UnsupportedRedis(message)
        policy = info.get("maxmemory_policy", "noeviction")
        if policy != "noeviction" and str(info.get("maxmemory", 0)) != "0":
            self.log.warning(
                "redis evicts keys at maxmemory: jobs can be lost",
                maxmemory=str(info["maxmemory"]),
                maxmemory_policy=policy,
                fix="maxmemory-policy noeviction",
            )

    def run(self) -> None:
        """Serve until `stop()`, then drain and hand back what did not finish. Raises
        UnsupportedRedis, before it registers, on a server it cannot run on."""
        self._check_redis()
        self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
        self.publisher.retrying(self.register)
        structlog.contextvars.bind_contextvars(consumer=self.config.consumer)
        self.log.info("worker started", models=list(self.config.served_names))
        threads = [
            threading.Thread(
                target=self._serve, args=(self.intake.run_pass,), name="tokenq-intake"
            ),
            threading.Thread(
                target=self._serve, args=(self.publisher.run_pass,), name="tokenq-publish"
            ),
        ]
        with frozen_heap():
            for thread in threads:
                thread.start()
            try:
                while not self._drained():
                    self.driver.pump(wait=0.05)
                    if self._crash is not None:
                        raise self._crash
            finally:
                self._halt.set()
                self.driver.outputs.put(WAKE)
                for thread in threads:
                    thread.join()
                self._shutdown()
                self.metrics.close()
                if isinstance(self.scripts, ShardedScripts):
                    self.scripts.close()
                self.log.info("worker stopped")

    def _serve(self, one_pass: Callable[[float], None]) -> None:
        """A Redis thread's loop. A bug must not leave the engine serving without it."""
        structlog.contextvars.bind_contextvars(consumer=self.config.consumer)
        try:
            while not self._halt.is_set():
                one_pass(self.config.block_ms / 1000)
        except BaseException as exc:
            self._crash = exc
            self._halt.set()

    def run_once(self) -> None:
        """One pass of intake, engine and publisher, on the calling thread."""
        self.intake.run_pass(0.0)
        self.driver.pump()
        self.publisher.run_pass(0.0)

    def _drained(self) -> bool:
        return self._stop_at is not None and (
            not self.table.jobs or time.monotonic() >= self._stop_at
        )

    def _shutdown(self) -> None:
        """Once the Redis threads have ended: take what the engine still had to say,
        publish what is owed, hand back what did not finish."""
        publisher = self.publisher
        self.driver.pump()
        publisher.collect(0.0)
        try:
            if self.table.jobs or self.table.settling:
                publisher.publish()
            publisher.hand_back()
            publisher.publish_metrics()
            self._deregister()
        except redis.RedisError as exc:
            self.log.warning("redis unavailable while stopping", error=str(exc))
        self.driver.pump()  # apply the aborts of what was handed back
