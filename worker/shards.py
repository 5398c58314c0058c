"""A worker's scripts over every shard of a Redis Cluster, with the interface of one
server's `Scripts`: each call goes to the shards it concerns, one script call per shard
(a script touches one slot), and the answers come back in the caller's order
(docs/protocol.md, "Redis Cluster")."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
from dataclasses import replace
from typing import Any

from tokenq.protocol import LANES, lane_of
from tokenq.protocol.keys import Layout
from tokenq.worker.scripts import Item, Scripts, StartResult, Taken, TakeResult


class ShardedScripts:
    """`Scripts` of each shard, as one. TAKE asks the shards in turn from a rotating start
    with what the engine still admits; RECLAIM, OWN, START, PUBLISH and KEEP split their
    work by shard. Idle, the intake blocks on every shard's doorbells at once: a blocking
    read per shard on a thread of its own (one XREAD cannot name keys of several slots)."""

    def __init__(self, layout: Layout, shards: list[Scripts]) -> None:
        self.layout = layout
        self.shards = shards
        self.keys = layout.keys
        self._bells = futures.ThreadPoolExecutor(len(shards), thread_name_prefix="tokenq-bell")
        self._reading: dict[int, futures.Future[list[tuple[bytes, Any]]]] = {}

    def _of(self, key: bytes | str) -> int:
        return self.layout.index_of_key(key)

    def start(
        self, token: bytes, owner_ttl_s: int, jobs: Sequence[tuple[str, bool]]
    ) -> list[StartResult]:
        by_shard: dict[int, list[int]] = {}
        for n, (jid, _) in enumerate(jobs):
            by_shard.setdefault(self.layout.index(jid), []).append(n)
        out: list[StartResult | None] = [None] * len(jobs)
        for index, positions in by_shard.items():
            answers = self.shards[index].start(token, owner_ttl_s, [jobs[n] for n in positions])
            for n, answer in zip(positions, answers, strict=True):
                out[n] = answer
        return out  # type: ignore[return-value]

    def take(
        self,
        names: Sequence[str],
        slots: Sequence[int],
        max_wait_ms: Sequence[int],
        turn: int,
        token: bytes,
        owner_ttl_s: int,
    ) -> TakeResult:
        """Each shard in turn gets the slots left. An entry taken uses a slot of its own
        lane and of the lanes below (the engine would not preempt it for them), not of the
        lanes above: batch work taken from one shard leaves the room interactive work of
        the next shard has. A shard not asked (no slots left) counts as not drained."""
        left = list(slots)
        taken: list[Taken] = []
        drained = [True, True, True]
        rings: dict[str, bytes] = {}
        count = len(self.shards)
        for step in range(count):
            if max(left) <= 0:
                drained = [False, False, False]
                break
            shard = self.shards[(turn + step) % count]
            result = shard.take(names, left, max_wait_ms, turn, token, owner_ttl_s)
            for entry in result.taken:
                lane = _lane_index(shard, entry.stream)
                for below in range(lane, len(LANES)):
                    left[below] = max(0, left[below] - 1)
            taken += result.taken
            drained = [a and b for a, b in zip(drained, result.drained, strict=True)]
            rings.update(result.rings)
        return TakeResult(taken, (drained[0], drained[1], drained[2]), rings)

    def bell_keys(self, names: Sequence[str]) -> list[str]:
        return [key for shard in self.shards for key in shard.bell_keys(names)]

    def wait_bells(self, bells: dict[str, bytes], block_ms: int) -> list[tuple[bytes, Any]]:
        """Every shard's doorbells at once; a read still blocked from an earlier wait goes
        on (its answer may be a ring already seen: one TAKE more, nothing missed)."""
        by_shard: dict[int, dict[str, bytes]] = {}
        for key, last in bells.items():
            by_shard.setdefault(self._of(key), {})[key] = last
        for index, own in by_shard.items():
            if index not in self._reading:
                shard = self.shards[index]
                self._reading[index] = self._bells.submit(shard.wait_bells, own, block_ms)
        futures.wait(
            self._reading.values(), timeout=block_ms / 1000, return_when=futures.FIRST_COMPLETED
        )
        rang: list[tuple[bytes, Any]] = []
        for index, reading in list(self._reading.items()):
            if reading.done():
                del self._reading[index]
                rang += reading.result()
        return rang

    def reclaim(self, names: Sequence[str], idle_ms: int, most: int) -> list[Taken]:
        out: list[Taken] = []
        for shard in self.shards:
            if most - len(out) <= 0:
                break
            out += shard.reclaim(names, idle_ms, most - len(out))
        return out

    def own(self, names: Sequence[str], replay: bool) -> list[Taken]:
        return [t for shard in self.shards for t in shard.own(names, replay)]

    def publish(
        self,
        token: bytes,
        items: Sequence[Item],
        running_ttl_s: int,
        reply_ttl_s: int,
        dead_maxlen: int,
        hook_ttl_s: int = 90_000,
    ) -> list[tuple[str, bool]]:
        by_shard: dict[int, list[int]] = {}
        # Each job's events are checked for a gap a failover left (PUBLISH's "check").
        items = [replace(it, mode="check") if it.mode == "run" else it for it in items]
        for n, item in enumerate(items):
            by_shard.setdefault(self._of(item.stream), []).append(n)
        out: list[tuple[str, bool] | None] = [None] * len(items)
        for index, positions in by_shard.items():
            answers = self.shards[index].publish(
                token,
                [items[n] for n in positions],
                running_ttl_s,
                reply_ttl_s,
                dead_maxlen,
                hook_ttl_s,
            )
            for n, answer in zip(positions, answers, strict=True):
                out[n] = answer
        return out  # type: ignore[return-value]

    def keep(self, entries: Sequence[tuple[bytes, bytes]], idle_ms: int = 0) -> set[bytes]:
        by_shard: dict[int, list[tuple[bytes, bytes]]] = {}
        for stream, eid in entries:
            by_shard.setdefault(self._of(stream), []).append((stream, eid))
        gone: set[bytes] = set()
        for index, own in by_shard.items():
            gone |= self.shards[index].keep(own, idle_ms)
        return gone

    def close(self) -> None:
        self._bells.shutdown(wait=False, cancel_futures=True)


def _lane_index(shard: Scripts, stream: bytes) -> int:
    queue = shard.keys.parse_queue(stream.decode())
    return LANES.index(lane_of(queue[1] if queue else 0))
