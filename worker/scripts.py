"""The worker's Lua scripts (tokenq/protocol/scripts/) bound to its connection: their
arguments built, their replies parsed.

Scripts, not MULTI/EXEC: a transaction whose reply is lost cannot be told apart from one
that never ran, while each script guards itself (owner key, pending entry, reply sequence
ids), so the worker sends it again until it gets an answer.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis
import redis
from redis.commands.core import Script

from tokenq.protocol import DONE, ERROR, RESTART, TOKEN, Event, Keys, pack
from tokenq.protocol.keys import Layout
from tokenq.protocol.scripts import source


@dataclass
class StartResult:
    verdict: str  # "finished", "elsewhere" or "start"
    cancelled: bool
    reply: list[tuple[bytes, dict[bytes, bytes]]]


@dataclass
class Item:
    """One job's or entry's share of a PUBLISH call."""

    mode: str  # "run" ("check" on a cluster), "settle" or "orphan"
    stream: bytes  # the queue the entry came from
    entry_id: bytes
    job_id: str | None
    first_seq: int = 0  # "run": the sequence id of events[0]
    status: str = ""  # "", "running", "done", "error"
    events: list[bytes] = field(default_factory=list)  # event_arg() of each
    dead: dict[str, Any] | None = None  # a dead-letter entry to add
    release: bool = False  # "settle": this worker took the job's owner key for this entry
    backlog: str | None = None  # the lane's backlog counter, decremented on acknowledgement
    weight: int = 1  # what acknowledging takes off it: the entry's `w` (its job's n outputs)
    hooks: list[tuple[int, str, bytes]] = field(default_factory=list)  # webhook: seq, stream, data


OUTCOMES = {b"o": "ok", b"l": "lost", b"g": "gone", b"k": "kept", b"r": "rerun"}
TYPE_LETTERS = {TOKEN: b"t", DONE: b"d", ERROR: b"e", RESTART: b"r"}


def event_arg(event: Event) -> bytes:
    """An event as one PUBLISH argument: its type's letter, then its msgpack data."""
    return TYPE_LETTERS[event.type] + pack(event.to_data())


@dataclass
class Taken:
    """An entry a script handed this worker."""

    stream: bytes
    entry_id: bytes
    fields: dict[bytes, bytes] | None  # None: trimmed from the stream while pending
    count: int = 1  # deliveries, this one included
    started: StartResult | None = None  # TAKE started its job already (as START would)

    @property
    def weight(self) -> int:
        """What the entry counts in its lane's backlog: its `w` field (SUBMIT writes its
        job's n outputs there when above 1), else 1."""
        raw = (self.fields or {}).get(b"w", b"1")
        return int(raw) if raw.isdigit() and 0 < len(raw) < 8 and int(raw) > 0 else 1


@dataclass
class TakeResult:
    """What TAKE handed this worker, and what it saw of the queues while doing so."""

    taken: list[Taken]
    drained: tuple[bool, bool, bool]  # per lane: its queues hold nothing more to deliver
    rings: dict[str, bytes]  # per doorbell (key) of a served model: its last ring, if any


class Scripts:
    """The worker's scripts bound to one connection, namespace and consumer."""

    def __init__(
        self, conn: redis.Redis, keys: Keys, group: str, consumer: str, sharded: bool = False
    ) -> None:
        self.keys = keys
        self.layout = Layout(keys.namespace)
        # On a cluster each call names one key of its shard (never touched: the scripts
        # build their keys from the prefix), so a node that lost the slot answers MOVED.
        self._declared = [keys.prefix] if sharded else []
        self.group = group
        self.consumer = consumer
        self._redis = conn
        self._start = conn.register_script(source("start"))
        self._publish = conn.register_script(source("publish"))
        self._keep = conn.register_script(source("keep"))
        self._take = conn.register_script(source("take"))
        self._reclaim = conn.register_script(source("reclaim"))
        self._own = conn.register_script(source("own"))

    def start(
        self, token: bytes, owner_ttl_s: int, jobs: Sequence[tuple[str, bool]]
    ) -> list[StartResult]:
        """`jobs`: (job id, first delivery?)."""
        k = self.keys
        keys = [
            key
            for jid, _ in jobs
            for key in (k.job(jid), k.owner(jid), k.cancel(jid), k.reply(jid))
        ]
        args = [token, owner_ttl_s, *("1" if fresh else "0" for _, fresh in jobs)]
        return [_started(row) for row in self._start(keys=keys, args=args)]

    def take(
        self,
        names: Sequence[str],
        slots: Sequence[int],
        max_wait_ms: Sequence[int],
        turn: int,
        token: bytes,
        owner_ttl_s: int,
    ) -> TakeResult:
        """Entries for the free slots of each lane (interactive, default, batch), each with
        its job started as `start` would (unless its id field is not a job id); see TAKE."""
        args: list[Any] = [self.keys.prefix, self.group, self.consumer]
        args += [int(time.time() * 1000), *slots, *max_wait_ms, turn, token, owner_ttl_s]
        rows, drained, rings = self._take(keys=self._declared, args=[*args, *names])
        taken = [
            Taken(stream, eid, _pairs(fields), started=_started(start) if start else None)
            for stream, eid, fields, start in rows
        ]
        lanes = (drained[0:1] == b"1", drained[1:2] == b"1", drained[2:3] == b"1")
        bells = self.bell_keys(names)
        return TakeResult(taken, lanes, {b: r for b, r in zip(bells, rings, strict=True) if r})

    def bell_keys(self, names: Sequence[str]) -> list[str]:
        """The doorbells of the served models, in `names`' order."""
        return [self.keys.bell(name) for name in names]

    def wait_bells(self, bells: dict[str, bytes], block_ms: int) -> list[tuple[bytes, Any]]:
        """Block until a doorbell rings past its id in `bells`, or `block_ms` passes."""
        return self._redis.xread(bells, count=1, block=block_ms) or []

    def reclaim(self, names: Sequence[str], idle_ms: int, most: int) -> list[Taken]:
        args = [self.keys.prefix, self.group, self.consumer, idle_ms, most, *names]
        return [
            Taken(stream, eid, _pairs(fields) if fields else None, int(count))
            for stream, eid, fields, count in self._reclaim(keys=self._declared, args=args)
        ]

    def own(self, names: Sequence[str], replay: bool) -> list[Taken]:
        args = [self.keys.prefix, self.group, self.consumer, "replay" if replay else "look"]
        rows = self._own(keys=self._declared, args=[*args, *names])
        return [
            Taken(stream, eid, _pairs(fields) if fields else None, int(count))
            for stream, eid, count, fields in rows
        ]

    def publish(
        self,
        token: bytes,
        items: Sequence[Item],
        running_ttl_s: int,
        reply_ttl_s: int,
        dead_maxlen: int,
        hook_ttl_s: int = 90_000,
    ) -> list[tuple[str, bool]]:
        """(outcome, cancel requested) per item; see PUBLISH. `hook_ttl_s`: how long a job's
        webhook state lives (its retry time and more)."""
        args: list[Any] = [token, self.consumer, self.group, running_ttl_s, reply_ttl_s]
        args += [dead_maxlen, self.keys.prefix, hook_ttl_s]
        for it in items:
            dead = [x for pair in it.dead.items() for x in pair] if it.dead else []
            head = _head(it.mode, it.job_id, it.stream, it.entry_id, it.backlog)
            weight = f" {it.weight}" if it.weight > 1 else ""
            args.append(
                f"{head} {it.first_seq} {it.status or '-'} {int(it.release)} "
                f"{len(it.events)} {len(dead)} {len(it.hooks)}{weight}"
            )
            args += it.events
            args += dead
            for seq, stream, data in it.hooks:
                args += [f"{seq} {stream}", data]
        answer = self._evalsha(self._publish, [self.keys.dead], args)
        return [
            (OUTCOMES[answer[i : i + 1]], answer[i + 1 : i + 2] == b"1")
            for i in range(0, len(answer), 2)
        ]

    def _evalsha(self, script: Script, keys: list[Any], args: list[Any]) -> Any:
        """`script(keys, args)` packed by hiredis in one call: redis-py's command path added
        about 100 us of CPU to a PUBLISH of 64 jobs, sent every step. Failures raise for
        the caller's backoff; the connection is dropped unless a whole reply was read."""
        pool = self._redis.connection_pool
        conn = pool.get_connection()
        try:
            try:
                return _evalsha_on(conn, script.sha, keys, args)
            except redis.exceptions.NoScriptError:  # a flushed script cache, another server
                script.sha = self._redis.script_load(script.script)
                return _evalsha_on(conn, script.sha, keys, args)
        except redis.ResponseError:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def keep(self, entries: Sequence[tuple[bytes, bytes]], idle_ms: int = 0) -> set[bytes]:
        """Heartbeat (idle 0) or hand back (idle = claim time) this consumer's entries,
        given as (stream, entry id); returns the ids it no longer holds."""
        if not entries:
            return set()
        args: list[Any] = [self.group, self.consumer, idle_ms]
        for stream, eid in entries:
            args += [stream, eid]
        return set(self._keep(keys=self._declared, args=args))


def _evalsha_on(conn: Any, sha: str, keys: list[Any], args: list[Any]) -> Any:
    conn.send_packed_command([hiredis.pack_command(("EVALSHA", sha, len(keys), *keys, *args))])
    return conn.read_response()


@functools.lru_cache(maxsize=4096)
def _head(
    mode: str, job_id: str | None, stream: bytes, entry_id: bytes, backlog: str | None
) -> str:
    """The part of an item's PUBLISH header that stays the same for as long as its job
    runs: formatted once, not for each of the job's publishes (one a step)."""
    return f"{mode} {job_id or '-'} {stream.decode()} {entry_id.decode()} {backlog or '-'}"


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _started(row: list[Any]) -> StartResult:
    """start_job's answer."""
    verdict, cancelled, reply = row
    return StartResult(
        verdict.decode(), bool(cancelled), [(eid, _pairs(fields)) for eid, fields in reply]
    )
