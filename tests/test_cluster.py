"""tokenq on a real local Redis Cluster (three primaries, three replicas): connecting from
any node, the key layout by shard, jobs end to end, failover, and the load's spread."""

from __future__ import annotations

import uuid

import pytest
from redis.cluster import RedisCluster
from redis.crc import key_slot

from tests.cluster_fixtures import LocalCluster, redis_cluster  # noqa: F401
from tokenq.protocol import Keys
from tokenq.protocol.connection import Cluster, cluster_seeds, connect
from tokenq.protocol.keys import Layout, shard_tags


def test_a_plain_url_of_any_node_is_found_to_be_a_cluster(
    redis_cluster: LocalCluster,  # noqa: F811
) -> None:
    for url in (redis_cluster.url, f"redis://127.0.0.1:{redis_cluster.ports[-1]}/0"):
        conn = connect(url)
        assert isinstance(conn, Cluster)
        assert len(conn.primaries()) == 3
        conn.close()


def test_a_cluster_url_lists_seeds_and_forces_cluster_mode(
    redis_cluster: LocalCluster,  # noqa: F811
) -> None:
    dead = f"127.0.0.1:{redis_cluster.ports[0] + 40000 - 65535 % 7}"
    url = redis_cluster.seeds_url.replace("redis+cluster://", f"redis+cluster://u:pw@{dead},")
    plain, seeds = cluster_seeds(url)  # type: ignore[misc]
    assert plain.startswith("redis://u:pw@") and len(seeds) == 7
    conn = connect(redis_cluster.seeds_url)
    assert isinstance(conn.redis, RedisCluster)
    conn.close()


def test_shard_tags_spread_over_the_slot_ranges_and_keep_one_slot_per_shard() -> None:
    for count in (1, 3, 6, 9):
        tags = shard_tags(count)
        width = 16384 / count
        assert [int(key_slot(t.encode()) // width) for t in tags] == list(range(count))
    layout = Layout("ns", 6)
    ids = [uuid.uuid4().hex for _ in range(600)]
    for jid in ids[:50]:
        keys = layout.of(jid)
        slots = {
            key_slot(k.encode())
            for k in (keys.job(jid), keys.reply(jid), keys.owner(jid), keys.cancel(jid),
                      keys.entry(jid), keys.queue("m", 0, "-"), keys.queues("m"),
                      keys.backlog("m", "default"), keys.bell("m"), keys.dead,
                      f"{keys.prefix}:webhooks")
        }  # fmt: skip
        assert len(slots) == 1
        assert layout.of_key(keys.reply(jid)) == keys
    counts = [sum(layout.index(j) == i for j in ids) for i in range(6)]
    assert min(counts) > 60  # 100 each on average


def test_one_server_keeps_its_key_names() -> None:
    layout = Layout("tokenq")
    assert layout.of("abc") == Keys("tokenq")
    assert Keys("tokenq").queue("m", 0, "-") == "tokenq:jobs:m:0:-"
    assert Keys("tokenq").reply("abc") == "tokenq:reply:abc"
