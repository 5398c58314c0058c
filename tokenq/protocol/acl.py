"""The least rights each role needs in Redis, as ACL rules (docs/security.md, "Redis ACL").

Every role is limited to its namespace's keys (a worker to the keys of the models it
serves and of the jobs it runs) and to the commands it sends, the commands its Lua
scripts run included: Redis checks those against the caller's rules too. The lists are
what tests/test_redis_tls_acl.py proves: each role runs jobs end to end under its rules,
and Redis's ACL log stays empty.

- `client`: producers: `Client`/`AsyncClient`, `tokenq submit`, `tokenq batch run`, the
  Celery bridge. Submits, follows replies, cancels, reads the registry.
- `worker`: `tokenq worker` for the models named.
- `gateway`: `tokenq serve`: a client, plus its bookmarks, per-key limits, Files and
  Batches, and the fleet's gauges for /metrics and /dashboard.
- `admin`: `tokenq inspect`, `result`, `cancel`, `dlq`, `exporter`, `webhooks add/list/
  remove`.
- `dispatcher`: `tokenq webhooks run`.

On a Redis Cluster (`cluster=True`) every role also reads the cluster's layout (CLUSTER
SLOTS, COMMAND: what redis-py's `RedisCluster` asks when it connects), and a worker's key
patterns name the shards' keys too (`ns:{*}:jobs:<model>:*`, ...); `~ns:*` already
covers them for the other roles. The rules go to every node (each keeps its own users).
"""

from __future__ import annotations

from collections.abc import Iterable

ROLES = ("client", "worker", "gateway", "admin", "dispatcher")

# Any connection: a client may name its connection (client_name=), PING checks an idle
# one; INFO server tells a stream reader how a blocked XREAD of several streams wakes
# (before Redis 7.2: with one stream). redis-py names its library on connect too (CLIENT
# SETINFO, from Redis 7.2: `SETINFO`).
_CONNECTION = ("ping", "info", "client|setname")
SETINFO = "client|setinfo"
SETINFO_SINCE = (7, 2)
# On a Redis Cluster: the slots' owners and the commands' key positions (redis-py asks both
# when it connects and after a failover), and INFO's cluster section (allowed with INFO).
CLUSTER = ("cluster|slots", "cluster|shards", "command")
# Lua scripts: EVALSHA, loaded on NOSCRIPT (SCRIPT LOAD; a pipeline asks SCRIPT EXISTS).
_SCRIPTS = ("evalsha", "eval", "script|load", "script|exists")
_SUBMIT = ("exists", "get", "set", "zadd", "xadd", "incrby")  # submit.lua
_CLIENT = (
    *_CONNECTION, *_SCRIPTS, *_SUBMIT,
    "xread",  # replies
    "zrangebyscore", "hgetall",  # the registry of live workers
    "sadd",  # the webhook event streams, listed for dispatchers
    "wait",  # a durable submit: until a replica holds it
)  # fmt: skip
_FLEET = (  # tokenq/ops/fleet.py: what /metrics, /dashboard and `inspect` read
    "time", "scan", "xlen", "zrange", "hgetall", "hmget", "get", "xinfo|groups", "xrange",
    "xrevrange", "xpending", "multi", "exec", "smembers",
)  # fmt: skip
COMMANDS: dict[str, tuple[str, ...]] = {
    "client": _CLIENT,
    "worker": (
        *_CONNECTION,
        *_SCRIPTS,
        "xread",  # doorbells
        "hset",
        "expire",
        "zadd",
        "zrem",
        "del",
        "multi",
        "exec",  # registry and metrics
        # take, start, publish, keep, reclaim, own (tokenq/protocol/scripts/)
        "exists",
        "get",
        "set",
        "decrby",  # a lane's backlog, less an acknowledged entry's weight (publish.lua)
        "zrange",
        "xadd",
        "xack",
        "xdel",
        "xlen",
        "xrange",
        "xrevrange",
        "xreadgroup",
        "xpending",
        "xclaim",
        "xautoclaim",
        "xgroup|create",
        "xinfo|groups",
        "hget",  # a job's webhook state (publish.lua)
    ),  # fmt: skip
    "gateway": (
        *_CLIENT,
        *_FLEET,
        "incr",
        "decr",
        "expire",  # watchers and bookmarks of streams
        "zrange",
        "hget",  # which model a 404 names
        # per-key limits (rate_admit.lua, rate_settle.lua)
        "hincrby",
        "hdel",
        "hexists",
        "pexpire",
        "pttl",
        "zcard",
        "zscore",
        "zremrangebyscore",
        "zrem",
        # Files and Batches, and their runner
        "hset",
        "sadd",
        "srem",
        "smembers",
        "zrevrange",
        "zrevrank",
        "append",
        "strlen",
        "del",
        "expireat",
    ),  # fmt: skip
    "admin": (
        *_CLIENT,
        *_FLEET,
        "xtrim",
        "xdel",
        "del",  # dlq purge, replay (replay.lua)
        "hset",
        "hget",
        "hdel",  # webhook endpoints
    ),  # fmt: skip
    "dispatcher": (
        *_CONNECTION,
        *_SCRIPTS,
        "smembers",
        "xgroup|create",
        "xreadgroup",
        "xautoclaim",
        "xclaim",
        "xack",  # events
        "xdel",
        "hget",
        "hset",
        "expire",  # hook_done.lua
        "hgetall",
        "sadd",
        "xadd",  # endpoints, gone URLs, failures
    ),  # fmt: skip
}


def _keys(namespace: str, role: str, models: Iterable[str], cluster: bool) -> list[str]:
    if role != "worker" or not models:
        return [f"~{namespace}:*"]
    patterns = _worker_keys(namespace, namespace, models)
    if cluster:  # a shard's keys, `ns:{<tag>}:...`, the shard's prefix its scripts name
        # (so that a node without the slot answers MOVED) and the namespace's shard count
        patterns += _worker_keys(namespace + ":{*}", namespace, models)
        patterns += [f"{namespace}:{{*}}", f"{namespace}:shards"]
    return ["~" + p for p in dict.fromkeys(patterns)]


def _worker_keys(ns: str, namespace: str, models: Iterable[str]) -> list[str]:
    """A worker's key patterns under `ns` (a shard's prefix pattern on a cluster); the
    fleet's own keys stay under `namespace`."""
    own = [
        pattern
        for model in models
        for pattern in (
            f"{ns}:jobs:{model}:*", f"{ns}:queues:{model}", f"{ns}:backlog:{model}:*",
            f"{ns}:bell:{model}",
        )
    ]  # fmt: skip
    jobs = [f"{ns}:{kind}:*" for kind in ("job", "reply", "cancel", "owner", "entry", "hook")]
    hooks = [f"{ns}:hooks:{model}:*" for model in models]
    fleet = [f"{namespace}:workers", f"{namespace}:worker:*", f"{namespace}:metrics:*"]
    return [*own, *hooks, *jobs, *fleet, f"{ns}:dead", f"{ns}:void", f"{ns}:jobs"]


def acl_rules(
    role: str,
    namespace: str,
    models: Iterable[str] = (),
    redis_version: tuple[int, ...] = SETINFO_SINCE,
    cluster: bool = False,
) -> str:
    """A role's rules for `ACL SETUSER <user> on ><password> <rules>` (or an ACL file's
    `user` line): nothing but its keys and commands. `models`: a worker's served names,
    to keep it to their queues (else the whole namespace). `redis_version`: the server's
    (an ACL naming a command it lacks is refused). `cluster`: for the nodes of a Redis
    Cluster."""
    if role not in COMMANDS:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    setinfo = (SETINFO,) if redis_version >= SETINFO_SINCE else ()
    commands = sorted({*COMMANDS[role], *setinfo, *(CLUSTER if cluster else ())})
    return " ".join(
        ["resetkeys", "resetchannels", "-@all", *_keys(namespace, role, models, cluster)]
        + [f"+{c}" for c in commands]
    )
