"""Dead letters (`<ns>:dead`, docs/protocol.md "Dead letters"): list, show, replay, purge.

Replaying puts a dead job back on its original queue, under its original job id and with
its original payload, once the cause is fixed (a worker for its model has started, the
workers no longer die on it). A dead job has ended: its job key says `error` and its reply
stream holds the `error` event, and a worker that finds either acknowledges the entry
without running it ("one terminal event per job"). So the replay, one script
(tokenq/protocol/scripts/replay.lua):

1. refuses if the dead letter is gone (replayed or purged meanwhile), or if the job key
   holds anything but `error` (the job was submitted again and is queued, running or done);
2. refuses, changing nothing, if the lane is full (QueueFull; the job weighs its n outputs);
3. deletes the job key, the reply stream, the owner and cancel keys: the job starts over
   with a clean reply, as if never submitted;
4. submits it with the client's own SUBMIT, included whole (job key, queue set, entry,
   backlog counter, doorbell), to the queue the entry came from;
5. deletes the dead letter.

A client that followed the old reply saw its `error` and stopped; one that asks for the
result after the replay reads the new reply from its start.

On a Redis Cluster each shard has its dead letters (`<ns>:{<tag>}:dead`), beside the
queues and jobs the script touches: they are listed newest first across the shards, a job
id is looked up in its own shard, and `purge` trims each shard up to what it counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis

from tokenq.producer.client import ClientConfig
from tokenq.producer.errors import QueueFull
from tokenq.protocol import (
    DEFAULT_NAMESPACE,
    LANES,
    Keys,
    ProtocolError,
    decode_job,
    lane_of,
    unpack,
)
from tokenq.protocol.connection import Cluster
from tokenq.protocol.keys import Layout
from tokenq.protocol.scripts import source

PAGE = 100  # dead letters read per call while looking for a job id


class NotFound(LookupError):
    """No dead letter by that id or job id."""


class NotReplayable(ValueError):
    """A dead letter that cannot go back on its queue; the message says why."""


@dataclass
class DeadLetter:
    id: str  # its entry id in the dead-letter stream
    job_id: str | None  # None: the entry had no readable job id
    code: str
    message: str
    deliveries: int
    consumer: str
    failed_at: float  # unix seconds
    queue: str | None  # the job stream the entry came from
    entry_id: str  # its id there
    truncated: bool  # `fields` keeps a prefix of each original field only
    fields: dict[bytes, bytes]  # the original entry's fields (v, id, data)
    stream: str = ""  # the dead-letter stream it is in (on a cluster, its shard's)

    @property
    def payload(self) -> Any:
        """The job payload (`data` unpacked), or None when it cannot be read."""
        try:
            return unpack(self.fields[b"data"])
        except Exception:  # missing, truncated or not msgpack: msgpack raises many types
            return None

    def summary(self) -> dict[str, Any]:
        """For listings: everything but the original fields."""
        return {
            "id": self.id,
            "job_id": self.job_id,
            "code": self.code,
            "message": self.message,
            "deliveries": self.deliveries,
            "consumer": self.consumer,
            "failed_at": self.failed_at,
            "queue": self.queue,
            "entry_id": self.entry_id,
            "truncated": self.truncated,
        }

    def to_json(self) -> dict[str, Any]:
        """The summary, plus the original entry (`data` unpacked when it can be)."""
        fields = {
            k.decode(errors="replace"): v.decode(errors="replace")
            for k, v in self.fields.items()
            if k != b"data"
        }
        data = self.fields.get(b"data")
        return {
            **self.summary(),
            "fields": fields,
            "payload": self.payload,
            "data_bytes": None if data is None else len(data),
        }


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", errors="replace")


def parse(entry_id: bytes, raw: dict[bytes, bytes], stream: str = "") -> DeadLetter:
    try:
        fields = unpack(raw[b"fields"]) if b"fields" in raw else {}
    except Exception:  # a dead letter written by something else: show what there is
        fields = {}
    return DeadLetter(
        id=entry_id.decode(),
        job_id=_text(raw.get(b"job_id")) or None,
        code=_text(raw.get(b"code")),
        message=_text(raw.get(b"message")),
        deliveries=int(raw.get(b"deliveries", b"0")),
        consumer=_text(raw.get(b"consumer")),
        failed_at=float(raw.get(b"failed_at", b"0")),
        queue=_text(raw.get(b"stream")) or None,
        entry_id=_text(raw.get(b"entry_id")),
        truncated=raw.get(b"truncated", b"0") == b"1",
        fields=fields if isinstance(fields, dict) else {},
        stream=stream,
    )


def _id_key(letter: DeadLetter) -> tuple[int, int]:
    ms, _, seq = letter.id.partition("-")
    return int(ms), int(seq or 0)


class DeadLetters:
    """The dead letters of one namespace: one stream on one server, one per shard on a
    Redis Cluster (a `Cluster` given)."""

    def __init__(self, conn: redis.Redis | Cluster, namespace: str = DEFAULT_NAMESPACE) -> None:
        if isinstance(conn, Cluster):
            self.redis: Any = conn.redis
            self.layout = conn.layout(namespace)
        else:
            self.redis, self.layout = conn, Layout(namespace)
        self.keys = Keys(namespace)
        self._replay = self.redis.register_script(source("replay"))

    @property
    def streams(self) -> list[str]:
        return [shard.dead for shard in self.layout.shards]

    def count(self) -> int:
        with self.redis.pipeline(transaction=False) as pipe:
            for stream in self.streams:
                pipe.xlen(stream)
            return sum(pipe.execute())

    def newest(self, limit: int) -> list[DeadLetter]:
        letters = [
            parse(eid, raw, stream)
            for stream in self.streams
            for eid, raw in self.redis.xrevrange(stream, "+", "-", count=limit)
        ]
        return sorted(letters, key=_id_key, reverse=True)[:limit]

    def find(self, ref: str) -> DeadLetter:
        """The dead letter with this entry id, else the newest one of this job id."""
        if ref.replace("-", "").isdigit() and ref.count("-") <= 1:
            found = [
                parse(*rows[0], stream)
                for stream in self.streams
                if (rows := self.redis.xrange(stream, ref, ref))
            ]
            if len(found) > 1:  # two shards stamped the same id: the job id tells them apart
                jobs = ", ".join(str(f.job_id) for f in found)
                raise NotFound(f"dead letter id {ref} is in {len(found)} shards (jobs {jobs})")
            if found:
                return found[0]
        stream = self.layout.of(ref).dead if self.layout.sharded else self.keys.dead
        end = "+"
        while True:
            rows = self.redis.xrevrange(stream, end, "-", count=PAGE)
            for eid, raw in rows:
                if raw.get(b"job_id") == ref.encode():
                    return parse(eid, raw, stream)
            if len(rows) < PAGE:
                where = "the dead letters" if self.layout.sharded else self.keys.dead
                raise NotFound(f"no dead letter with id or job id {ref!r} in {where}")
            end = "(" + rows[-1][0].decode()

    def replay(self, letter: DeadLetter, config: ClientConfig | None = None) -> str:
        """Put the job back on its queue (see the module's docstring) under the lane caps
        and job TTL of `config`; returns the queue. Raises NotReplayable, QueueFull."""
        config = config or ClientConfig(namespace=self.keys.namespace)
        k = self.layout.of_key(letter.stream) if letter.stream else self.keys
        if letter.truncated:
            raise NotReplayable(
                f"dead letter {letter.id} is truncated (its entry was too large to keep "
                "whole): it cannot be replayed; submit the job again"
            )
        where = k.parse_queue(letter.queue or "")
        if where is None:
            raise NotReplayable(
                f"dead letter {letter.id} came from {letter.queue or 'no known queue'}, "
                "not a protocol 2 queue: submit the job again"
            )
        try:
            job = decode_job(letter.fields)
        except ProtocolError as exc:
            raise NotReplayable(
                f"dead letter {letter.id}: its entry is still invalid ({exc}); "
                "fix it and submit it again"
            ) from None
        if job.job_id is None or job.job_id != letter.job_id:
            raise NotReplayable(f"dead letter {letter.id} holds no job id to replay under")
        if self.layout.sharded and self.layout.of(job.job_id) != k:
            raise NotReplayable(
                f"dead letter {letter.id}: job {job.job_id} was queued in another shard "
                "than its id names (by hand?): submit the job again"
            )
        model, priority, tenant = where
        # On a cluster each shard's lanes hold their share of a cap, as the client's.
        shares = len(self.layout.shards)
        caps = [math.ceil(config.lane_cap(lane) / shares) for lane in LANES]
        jid = job.job_id
        args = [letter.id, k.prefix, config.job_ttl, *caps, jid, model, priority, tenant]
        args.append(lane_of(priority))
        args += [letter.fields[b"v"], letter.fields[b"data"], job.weight]
        answer = self._replay(
            keys=[k.dead, k.job(jid), k.reply(jid), k.owner(jid), k.cancel(jid)], args=args
        )
        if answer[0] == b"gone":
            raise NotFound(f"dead letter {letter.id} is gone (replayed or purged meanwhile)")
        if answer[0] == b"state":
            raise NotReplayable(
                f"job {jid} is {answer[1].decode()}: it was submitted again since it died; "
                "not replayed"
            )
        if answer[0] == b"full":
            _, lane_b, have, cap, model_b = answer
            raise QueueFull(int(have), int(cap), lane_b.decode(), model_b.decode())
        return k.queue(model, priority, tenant)

    def tops(self) -> dict[str, str]:
        """Each dead-letter stream's newest entry id (streams with none left out): what
        `purge` deletes up to."""
        return {
            stream: rows[0][0].decode()
            for stream in self.streams
            if (rows := self.redis.xrevrange(stream, "+", "-", count=1))
        }

    def purge(self, through: str | Mapping[str, str]) -> int:
        """Delete the dead letters up to and including entry id `through` (what was
        counted before asking; per stream, as `tops` gives it); those added since stay.
        Returns how many went."""
        if isinstance(through, str):
            through = dict.fromkeys(self.streams, through)
        deleted = 0
        for stream, top in through.items():
            ms, _, seq = top.partition("-")
            minid = f"{ms}-{int(seq or 0) + 1}"
            deleted += self.redis.xtrim(stream, minid=minid, approximate=False)
        return deleted
