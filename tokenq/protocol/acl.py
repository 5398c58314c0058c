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


def _keys(namespace: str, role: str, models: Iterable[str]) -> list[str]:
    if role != "worker" or not models:
        return [f"~{namespace}:*"]
    ns = namespace
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
    fleet = [f"{ns}:workers", f"{ns}:worker:*", f"{ns}:metrics:*", f"{ns}:dead"]
    return ["~" + p for p in (*own, *hooks, *jobs, *fleet, f"{ns}:void", f"{ns}:jobs")]


def acl_rules(
    role: str,
    namespace: str,
    models: Iterable[str] = (),
    redis_version: tuple[int, ...] = SETINFO_SINCE,
) -> str:
    """A role's rules for `ACL SETUSER <user> on ><password> <rules>` (or an ACL file's
    `user` line): nothing but its keys and commands. `models`: a worker's served names,
    to keep it to their queues (else the whole namespace). `redis_version`: the server's
    (an ACL naming a command it lacks is refused)."""
    if role not in COMMANDS:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    setinfo = (SETINFO,) if redis_version >= SETINFO_SINCE else ()
    commands = sorted({*COMMANDS[role], *setinfo})
    return " ".join(
        ["resetkeys", "resetchannels", "-@all", *_keys(namespace, role, models)]
        + [f"+{c}" for c in commands]
    )
