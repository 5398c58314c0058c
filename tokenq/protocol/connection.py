"""How every part of tokenq connects to Redis: the default server, TCP keepalive where it
applies, how a server's version is compared, how a URL is named in messages (never with
its password), and `connect`, the one function that opens a server or a Redis Cluster
(docs/protocol.md, "Redis Cluster")."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.connection import parse_url as parse_async_url
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException

from tokenq.protocol.keys import Layout, shards_key

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# `redis+cluster://h1:p1,h2:p2/` (or `rediss+cluster://`) forces cluster mode and may list
# several seed nodes; a plain URL naming any node of a cluster is found to be one.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# Answers of a cluster in the middle of a change (a failover, a slot moving): waited out
# like an unreachable server, after a fresh look at which node holds which slots.
CLUSTER_CHANGES = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.SlotNotCoveredError,
)
# At most one look at the cluster's slots this often: every connection of every shard
# that failed together asks for one.
REFRESH_EVERY_S = 0.25

log = logging.getLogger("tokenq.connection")


def keepalive_for(url: str) -> dict[str, bool]:
    """TCP keepalive, which finds a peer that vanished under an idle connection, for a
    redis:// or rediss:// URL; none for a unix:// socket, where the kernel knows when the
    server is gone (and redis-py refuses the option: a TypeError at the first command)."""
    return {} if urlsplit(url).scheme == "unix" else {"socket_keepalive": True}


def version_tuple(version: str) -> tuple[int, ...]:
    """A server's `redis_version` as (major, minor), to compare; () when it has none."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def redacted(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url)


def cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]] | None:
    """For a `redis+cluster://` URL: the plain URL of its first seed (credentials and
    options kept) and every seed as (host, port); None for any other URL."""
    parts = urlsplit(url)
    plain = CLUSTER_SCHEMES.get(parts.scheme)
    if plain is None:
        return None
    creds, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "6379")
        seeds.append((name or "127.0.0.1", int(port or 6379)))
    first = f"{seeds[0][0]}:{seeds[0][1]}"
    netloc = f"{creds}@{first}" if creds else first
    query = f"?{parts.query}" if parts.query else ""
    return f"{plain}://{netloc}{parts.path}{query}", seeds


def is_cluster_node(conn: redis.Redis) -> bool:
    """Whether the server runs in cluster mode (INFO's cluster section, which any ACL
    that allows INFO shows). A server that does not answer counts as a plain one."""
    try:
        return bool(conn.info("cluster").get("cluster_enabled"))
    except redis.RedisError:
        return False


def connect(url: str = DEFAULT_REDIS_URL, **options: Any) -> redis.Redis | Cluster:
    """The connection every component opens from a URL: a `redis.Redis` for one server
    (no extra round trip beyond one INFO), a `Cluster` for a node of a Redis Cluster or a
    `redis+cluster://` URL. `options` are redis-py's connection and pool options
    (`connection_pool_class` among them)."""
    seeds = cluster_seeds(url)
    if seeds is None:
        pool_class = options.get("connection_pool_class", redis.ConnectionPool)
        plain = {k: v for k, v in options.items() if k != "connection_pool_class"}
        conn = redis.Redis.from_pool(pool_class.from_url(url, **plain))
        if not is_cluster_node(conn):
            return conn
        seeds = url, [_host_port(url)]
        try:
            cluster = Cluster(url, seeds[1], options)
        except RedisClusterException as exc:
            # A node of no working cluster (no slot served): used as the one server it is,
            # so that its own refusal reaches the caller as any refused command does.
            log.info("redis cluster node not usable as a cluster: %s", exc)
            return conn
        conn.close()
        log.info("redis cluster mode: %d primaries", len(cluster.primaries()))
        return cluster
    plain, nodes = seeds
    try:
        cluster = Cluster(plain, nodes, options)
    except RedisClusterException as exc:
        raise _unreachable(url, exc) from exc
    log.info("redis cluster mode: %d primaries", len(cluster.primaries()))
    return cluster


def _unreachable(url: str, exc: RedisClusterException) -> redis.ConnectionError:
    """No seed of a `redis+cluster://` URL answered as a cluster: a ConnectionError, as an
    unreachable server is, so that every caller says so in its one line."""
    return redis.ConnectionError(f"no node of the Redis Cluster {redacted(url)} answered: {exc}")


def _host_port(url: str) -> tuple[str, int]:
    kwargs = parse_url(url)
    return kwargs.get("host", "127.0.0.1"), int(kwargs.get("port", 6379))


class _Topology:
    """When a cluster client looks at the slots again: after a failure (`failed`), at most
    once per REFRESH_EVERY_S; `epoch` counts the looks, so connections from before one
    connect again."""

    def __init__(self) -> None:
        self.epoch = 0
        self._stale = False
        self._refreshed_at = time.monotonic()

    def failed(self) -> None:
        """A connection failed or the cluster refused (MOVED, CLUSTERDOWN, READONLY): look
        at the slots again before the next connection; the connections made before that
        look connect again before their next command."""
        self._stale = True

    def _refresh_due(self) -> bool:
        """Whether to look now (and the look is counted as started)."""
        now = time.monotonic()
        if self._stale and now - self._refreshed_at >= REFRESH_EVERY_S:
            self._refreshed_at = now
            return True
        return False

    def _looked(self) -> None:
        self._stale = False
        self.epoch += 1


class Cluster(_Topology):
    """A Redis Cluster as tokenq uses it. `redis` (redis-py's `RedisCluster`) serves keys
    of any slot and follows MOVED itself; `bound(key)` is a plain `redis.Redis` whose
    connections go to whichever primary holds that key's slot when they connect, so that a
    shard's scripts, packed commands and blocking reads run as on one server. After a
    failover, the next connection looks the slot up again."""

    def __init__(self, url: str, seeds: list[tuple[str, int]], options: dict[str, Any]) -> None:
        self.url = url
        kwargs = {k: v for k, v in parse_url(url).items() if k not in ("host", "port", "db")}
        kwargs.update(options)
        kwargs.pop("db", None)  # a cluster has only db 0
        self.options = kwargs
        cluster_options = {k: v for k, v in kwargs.items() if k not in _POOL_ONLY}
        self.redis = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in seeds], **cluster_options
        )
        super().__init__()
        self._lock = threading.Lock()
        self._bound: list[redis.Redis] = []

    def shard_count(self, namespace: str, wanted: int | None = None) -> int:
        """How many shards the namespace's queues are split into: its setting, written by
        the first component to connect (`wanted`, else one per primary). A namespace keeps
        its count: jobs are placed by it."""
        key = shards_key(namespace)
        self.redis.set(key, wanted or len(self.primaries()), nx=True)
        count = int(self.redis.get(key))
        if wanted and wanted != count:
            raise ValueError(f"namespace {namespace!r} is split into {count} shards, not {wanted}")
        return count

    def layout(self, namespace: str) -> Layout:
        """The namespace's shards as they stand, read only (a reader of the fleet writes
        nothing): its setting, else one per primary, what the first client will write."""
        count = self.redis.get(shards_key(namespace))
        return Layout(namespace, int(count) if count else len(self.primaries()))

    def primaries(self) -> list[ClusterNode]:
        return self.redis.get_primaries()

    def primary_of(self, slot: int) -> tuple[str, int]:
        """(host, port) of the primary that holds `slot`, refreshed first if a connection
        failed or a command was refused since the last look."""
        with self._lock:
            if self._refresh_due():
                try:
                    self.redis.nodes_manager.initialize()
                    self._looked()
                except redis.RedisError as exc:
                    log.warning("redis cluster topology not refreshed: %s", exc)
        node = self.redis.nodes_manager.get_node_from_slot(slot)
        return node.host, int(node.port)

    def bound(self, key: str, **options: Any) -> redis.Redis:
        """A client for the primary of `key`'s slot; `options` (pool and connection) win
        over the URL's."""
        slot = self.redis.keyslot(key)
        kwargs = {**self.options, **options}
        secure = kwargs.pop("connection_class", None) is redis.SSLConnection
        pool_class = kwargs.pop("connection_pool_class", redis.ConnectionPool)
        kwargs["connection_class"] = _SecureShardConnection if secure else _ShardConnection
        kwargs["cluster"], kwargs["slot"] = self, slot
        conn = redis.Redis.from_pool(pool_class(**kwargs))
        self._bound.append(conn)
        return conn

    def close(self) -> None:
        for conn in self._bound:
            conn.close()
        self.redis.close()


# Options of a pool, not of RedisCluster's own connections.
_POOL_ONLY = frozenset({"max_connections", "timeout", "connection_class", "connection_pool_class"})


class _Located:
    """A connection that asks where to connect each time it connects (a shard's primary
    may have moved), reports a failure or a refusal that says the cluster changed, and
    connects again before its next command once the slots were looked at since."""

    def __init__(self, *, cluster: Cluster, slot: int, **kwargs: Any) -> None:
        self._cluster, self._slot, self._epoch = cluster, slot, -1
        kwargs.setdefault("host", "unresolved")
        super().__init__(**kwargs)  # type: ignore[call-arg]

    def _connect(self) -> Any:
        self.host, self.port = self._cluster.primary_of(self._slot)
        self._epoch = self._cluster.epoch
        try:
            return super()._connect()  # type: ignore[misc]
        except OSError:
            self._cluster.failed()
            raise

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._epoch != self._cluster.epoch:
            self.disconnect()  # type: ignore[attr-defined]
        super().send_packed_command(command, check_health)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except (redis.ConnectionError, redis.exceptions.ReadOnlyError, *CLUSTER_CHANGES):
            self._cluster.failed()
            self.disconnect()  # type: ignore[attr-defined]  # the next command looks again
            raise


class _ShardConnection(_Located, redis.Connection):
    pass


class _SecureShardConnection(_Located, redis.SSLConnection):
    pass


# --- asyncio ---------------------------------------------------------------------------


async def connect_async(
    url: str = DEFAULT_REDIS_URL, **options: Any
) -> aioredis.Redis | AsyncCluster:
    """`connect` for asyncio: a `redis.asyncio.Redis` for one server (one INFO asks
    whether it is a cluster node), an `AsyncCluster` for a node of a Redis Cluster or a
    `redis+cluster://` URL."""
    seeds = cluster_seeds(url)
    if seeds is None:
        pool_class = options.get("connection_pool_class", aioredis.ConnectionPool)
        plain = {k: v for k, v in options.items() if k != "connection_pool_class"}
        conn = aioredis.Redis.from_pool(pool_class.from_url(url, **plain))
        try:
            is_node = bool((await conn.info("cluster")).get("cluster_enabled"))
        except redis.RedisError:
            is_node = False  # as `is_cluster_node`: a silent server counts as a plain one
        if not is_node:
            return conn
        cluster = AsyncCluster(url, [_host_port(url)], options)
        try:
            await cluster.redis.initialize()
        except RedisClusterException as exc:  # as in `connect`: used as the one server
            log.info("redis cluster node not usable as a cluster: %s", exc)
            await cluster.aclose()
            return conn
        await conn.aclose()
    else:
        plain_url, nodes = seeds
        cluster = AsyncCluster(plain_url, nodes, options)
        try:
            await cluster.redis.initialize()
        except RedisClusterException as exc:  # no seed answered: nothing left open
            await cluster.aclose()
            raise _unreachable(url, exc) from exc
    log.info("redis cluster mode: %d primaries", len(cluster.primaries()))
    return cluster


class AsyncCluster(_Topology):
    """`Cluster` for asyncio: `redis` (redis-py's asyncio `RedisCluster`) serves keys of
    any slot; `bound(key)` is a `redis.asyncio.Redis` whose connections go to the primary
    of that key's slot, looked up again after a failure."""

    def __init__(self, url: str, seeds: list[tuple[str, int]], options: dict[str, Any]) -> None:
        self.url = url
        parsed = parse_async_url(url)
        kwargs = {k: v for k, v in parsed.items() if k not in ("host", "port", "db")}
        kwargs.update(options)
        kwargs.pop("db", None)
        self.options = kwargs
        cluster_options = {k: v for k, v in kwargs.items() if k not in _POOL_ONLY}
        if kwargs.get("connection_class") is aioredis.SSLConnection:
            cluster_options["ssl"] = True
        self.redis = AsyncRedisCluster(
            startup_nodes=[AsyncClusterNode(host, port) for host, port in seeds],
            **cluster_options,
        )
        super().__init__()
        self._lock = asyncio.Lock()
        self._bound: list[aioredis.Redis] = []

    async def shard_count(self, namespace: str, wanted: int | None = None) -> int:
        """As `Cluster.shard_count`."""
        key = shards_key(namespace)
        await self.redis.set(key, wanted or len(self.primaries()), nx=True)
        count = int(await self.redis.get(key))
        if wanted and wanted != count:
            raise ValueError(f"namespace {namespace!r} is split into {count} shards, not {wanted}")
        return count

    def primaries(self) -> list[AsyncClusterNode]:
        return self.redis.get_primaries()

    async def primary_of(self, slot: int) -> tuple[str, int]:
        """As `Cluster.primary_of`."""
        async with self._lock:
            await self.redis.initialize()  # nothing once the slots are known
            if self._refresh_due():
                try:
                    await self.redis.nodes_manager.initialize()
                    self._looked()
                except redis.RedisError as exc:
                    log.warning("redis cluster topology not refreshed: %s", exc)
        node = self.redis.nodes_manager.get_node_from_slot(slot)
        return node.host, int(node.port)

    def bound(self, key: str, **options: Any) -> aioredis.Redis:
        """As `Cluster.bound`."""
        slot = self.redis.keyslot(key)
        kwargs = {**self.options, **options}
        secure = kwargs.pop("connection_class", None) is aioredis.SSLConnection
        pool_class = kwargs.pop("connection_pool_class", aioredis.ConnectionPool)
        located = _AsyncSecureShardConnection if secure else _AsyncShardConnection
        kwargs["connection_class"] = located
        kwargs["cluster"], kwargs["slot"] = self, slot
        conn = aioredis.Redis.from_pool(pool_class(**kwargs))
        self._bound.append(conn)
        return conn

    async def aclose(self) -> None:
        for conn in self._bound:
            await conn.aclose()
        await self.redis.aclose()


class _AsyncLocated:
    """`_Located` for asyncio connections."""

    def __init__(self, *, cluster: AsyncCluster, slot: int, **kwargs: Any) -> None:
        self._cluster, self._slot, self._epoch = cluster, slot, -1
        kwargs.setdefault("host", "unresolved")
        super().__init__(**kwargs)  # type: ignore[call-arg]

    async def _connect(self) -> Any:
        self.host, self.port = await self._cluster.primary_of(self._slot)
        self._epoch = self._cluster.epoch
        try:
            return await super()._connect()  # type: ignore[misc]
        except OSError:
            self._cluster.failed()
            raise

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._epoch != self._cluster.epoch:
            await self.disconnect()  # type: ignore[attr-defined]
        await super().send_packed_command(command, check_health)  # type: ignore[misc]

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except (redis.ConnectionError, redis.exceptions.ReadOnlyError, *CLUSTER_CHANGES):
            self._cluster.failed()
            await self.disconnect()  # type: ignore[attr-defined]
            raise


class _AsyncShardConnection(_AsyncLocated, aioredis.Connection):
    pass


class _AsyncSecureShardConnection(_AsyncLocated, aioredis.SSLConnection):
    pass
