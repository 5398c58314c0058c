"""tokenq on a real local Redis Cluster (three primaries, three replicas): connecting from
any node, the key layout by shard, jobs end to end, failover, and the load's spread."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import structlog
from redis.cluster import RedisCluster
from redis.crc import key_slot

from tests.cluster_fixtures import redis_cluster  # noqa: F401
from tests.faults import RedisServer, free_port
from tests.test_gateway import GatewayProcess
from tests.waits import wait_for
from tests.webhook_support import Dispatcher, Receiver, receiver  # noqa: F401
from tests.worker_support import (
    CLIENT,
    WorkerThread,
    check_reply,
    fast_config,
    make_engine,
    pending,
    queued,
    reference_run,
    tiny_model,  # noqa: F401
)
from tokenq import cli
from tokenq.bench.local_cluster import LocalCluster
from tokenq.ops.fleet import FleetCollector
from tokenq.producer.client import AsyncClient, Client, ClientConfig, Job, make_request
from tokenq.producer.errors import JobFailed, NotReplicated, QueueFull, RedisUnavailable
from tokenq.protocol import Keys, TokenEvent, decode_event
from tokenq.protocol.acl import ROLES, acl_rules
from tokenq.protocol.connection import Cluster, cluster_seeds, connect, version_tuple
from tokenq.protocol.keys import Layout, shard_tags
from tokenq.protocol.webhooks import COMPLETED_SEQ, DISPATCHERS
from tokenq.server.auth import principal_id
from tokenq.webhooks.whsec import new_secret
from tokenq.worker.config import WorkerConfig
from tokenq.worker.config import connect as worker_connect
from tokenq.worker.scripts import Scripts
from tokenq.worker.shards import ShardedScripts
from tokenq.worker.worker import Worker

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
def cluster_namespace(redis_cluster: LocalCluster) -> Any:  # noqa: F811
    """A namespace of its own on the cluster; its keys are deleted afterwards (every
    primary's), and only those."""
    namespace = f"tqc-{uuid.uuid4().hex[:10]}"
    yield namespace
    for port in redis_cluster.primaries():
        node = redis_cluster.node(port)
        for key in node.scan_iter(match=f"{namespace}:*", count=1000):
            node.delete(key)


class RoleUsers:
    """An ACL user per role (tokenq/protocol/acl.py, `cluster=True`) for one namespace, on
    every node of the cluster: `url(role)` connects as it, `refused()` lists what any node
    refused them."""

    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.cluster = cluster
        self.users = {role: f"tq-{role}-{namespace}" for role in ROLES}
        self.nodes = [cluster.node(port) for port in cluster.ports]
        version = version_tuple(self.nodes[0].info("server")["redis_version"])
        for node in self.nodes:
            for role, user in self.users.items():
                models = ("tiny",) if role == "worker" else ()
                rules = acl_rules(role, namespace, models, version, cluster=True).split()
                node.execute_command("ACL", "SETUSER", user, "on", ">pw", *rules)

    def url(self, role: str) -> str:
        return f"redis://{self.users[role]}:pw@127.0.0.1:{self.cluster.ports[0]}/0"

    def refused(self) -> list[tuple[str, str, str]]:
        return [
            (entry["username"], entry["reason"], entry["object"])
            for node in self.nodes
            for entry in node.acl_log(count=1000)
            if entry.get("username") in self.users.values()
        ]

    def remove(self) -> None:
        for node in self.nodes:
            node.acl_deluser(*self.users.values())


@pytest.fixture
def roles(redis_cluster: LocalCluster, cluster_namespace: str) -> Iterator[RoleUsers]:  # noqa: F811
    users = RoleUsers(redis_cluster, cluster_namespace)
    yield users
    users.remove()


def _check_jobs(
    client: Client, jobs: list[Job], requests: list[dict[str, Any]], model: Path
) -> None:
    """Each job: one terminal event, every token index once, the engine's own tokens; every
    shard's queues empty and nothing pending."""
    expected = reference_run(model, requests)
    for job, (_, final) in zip(jobs, expected, strict=True):
        shard = client._shard(job.id)
        events = [decode_event(i, f) for i, f in shard.redis.xrange(shard.keys.reply(job.id))]
        reply = check_reply(events)
        assert reply.done.token_ids == final.token_ids, job.id
        indices = [
            i for e in events if isinstance(e, TokenEvent)
            for i in range(e.index, e.index + len(e.token_ids))
        ]  # fmt: skip
        assert len(indices) == len(set(indices)), f"{job.id}: a token index twice"
    for shard in client._shards:
        assert queued(shard.redis, shard.keys) == 0
        assert pending(shard.redis, shard.keys) == []


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


def test_a_cluster_url_no_node_of_which_answers_is_one_line_naming_it_without_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"redis+cluster://u:secret@127.0.0.1:{free_port()}/"
    with pytest.raises(redis.ConnectionError, match="no node of the Redis Cluster"):
        connect(url)
    for command in (["inspect"], ["submit", "hi"], ["dlq", "list"]):
        status, out, err = _run(capsys, *command, "--redis-url", url)
        assert status != 0 and out == "" and err.startswith("tokenq: cannot reach Redis at")
        assert "secret" not in err and len(err.splitlines()) == 1


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


def test_jobs_across_every_shard_equal_the_engine_and_leave_nothing_pending(
    tiny_model: Path,  # noqa: F811
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
) -> None:
    client = Client(redis_cluster.url, namespace=cluster_namespace, **CLIENT)
    assert client.layout.count == 3  # one shard per primary, the namespace's setting now
    requests = [{"prompt": f"story {i}", "params": {"max_tokens": 12, **GREEDY}} for i in range(9)]
    jobs = client.submit_many(
        make_request(r["prompt"], job_id=f"job-{i}", **r["params"]) for i, r in enumerate(requests)
    )
    assert {client.layout.index(j.id) for j in jobs} == {0, 1, 2}
    config = fast_config(cluster_namespace)
    worker = Worker(make_engine(tiny_model), worker_connect(redis_cluster.url, config), config)
    with WorkerThread(worker):
        ended = [e for _, e in client.stream_many(jobs, timeout=60) if e.type == "done"]
        assert len(ended) == len(jobs)
        again = client.submit_many([make_request("story 0", job_id=jobs[0].id)])
        assert again[0].duplicate  # the retried id found its shard and its job
    _check_jobs(client, jobs, requests, tiny_model)
    client.close()


def test_a_primary_killed_under_streaming_jobs_loses_and_repeats_nothing(
    tiny_model: Path,  # noqa: F811
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
) -> None:
    """kill -9 of the primary holding shard 0 while jobs of every shard stream: its
    replica takes over; every job submitted durably (acknowledged once a replica held
    it) ends with one terminal event and the engine's tokens, and the client sees each
    token index once."""
    client = Client(redis_cluster.url, namespace=cluster_namespace, durable_submit=True, **CLIENT)
    requests = [{"prompt": f"tale {i}", "params": {"max_tokens": 48, **GREEDY}} for i in range(18)]
    jobs = client.submit_many(
        make_request(r["prompt"], job_id=f"job-{i}", **r["params"]) for i, r in enumerate(requests)
    )
    seen: dict[str, list[Any]] = {j.id: [] for j in jobs}

    def follow() -> None:
        for job, event in client.stream_many(jobs, timeout=90):
            seen[job.id].append(event)

    reader = threading.Thread(target=follow, daemon=True)
    config = fast_config(cluster_namespace, max_backoff_s=0.5)
    worker = Worker(make_engine(tiny_model), worker_connect(redis_cluster.url, config), config)
    victim = client.cluster.primary_of(key_slot(client.layout.shards[0].prefix.encode()))[1]  # type: ignore[union-attr]
    try:
        with WorkerThread(worker):
            reader.start()
            wait_for(lambda: sum(len(v) for v in seen.values()) > 40, timeout=60)
            killed_at = time.monotonic()
            redis_cluster.kill(victim)
            wait_for(lambda: victim not in redis_cluster.primaries() and redis_cluster.healthy())
            recovered = time.monotonic() - killed_at
            reader.join(timeout=90)
            assert not reader.is_alive()
        expected = reference_run(tiny_model, requests)
        for job, (_, final) in zip(jobs, expected, strict=True):
            reply = check_reply(seen[job.id])  # one terminal event, each index once
            assert reply.done.token_ids == final.token_ids, job.id
        for shard in client._shards:
            assert pending(shard.redis, shard.keys) == []
        assert recovered < 20
    finally:
        redis_cluster.start(victim)  # back as a replica of the new primary
        redis_cluster.wait_healthy()
        client.close()


def _commands(node: Any) -> int:
    """Commands a node ran since its stats were reset (those inside scripts included),
    but not the ones this test asks with."""
    stats = node.info("commandstats")
    return sum(
        row["calls"]
        for name, row in stats.items()
        if name not in ("cmdstat_info", "cmdstat_config")
    )


def test_a_uniform_workload_spreads_its_commands_over_the_primaries(
    tiny_model: Path,  # noqa: F811
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
) -> None:
    client = Client(redis_cluster.url, namespace=cluster_namespace, **CLIENT)
    config = fast_config(cluster_namespace)
    worker = Worker(make_engine(tiny_model), worker_connect(redis_cluster.url, config), config)
    nodes = [redis_cluster.node(port) for port in redis_cluster.primaries()]
    for node in nodes:
        node.config_resetstat()
    with WorkerThread(worker):
        jobs = [
            client.submit(f"item {i}", job_id=f"spread-{i}", max_tokens=4, **GREEDY)
            for i in range(240)
        ]
        for _ in client.stream_many(jobs, timeout=120):
            pass
    counts = [_commands(node) for node in nodes]
    mean = sum(counts) / len(counts)
    assert all(abs(c - mean) <= 0.25 * mean for c in counts), counts
    client.close()


def _ids(client: Client, shard: int, count: int, tag: str) -> list[str]:
    ids = (f"{tag}-{n}" for n in range(10_000))
    return [j for j in ids if client.layout.index(j) == shard][:count]


def test_interactive_work_of_a_later_shard_is_taken_beside_batch_work_of_an_earlier_one(
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
) -> None:
    client = Client(redis_cluster.url, namespace=cluster_namespace, **CLIENT)
    for jid in _ids(client, 0, 4, "b"):
        client.submit("batch", job_id=jid, priority=5)
    (urgent,) = _ids(client, 2, 1, "i")
    client.submit("now", job_id=urgent, priority=-1)
    config = WorkerConfig(namespace=cluster_namespace, served_names=("tiny",))
    cluster = worker_connect(redis_cluster.url, config)
    assert isinstance(cluster, Cluster)
    shards = [
        Scripts(cluster.bound(k.prefix), k, "workers", "w", sharded=True)
        for k in client.layout.shards
    ]
    scripts = ShardedScripts(client.layout, shards)
    # Two free seats: shard 0 is asked first (turn 0) and hands out batch work, yet the
    # interactive slots (free seats and batch work the engine would preempt) remain.
    result = scripts.take(["tiny"], [2, 2, 2], [0, 0, 0], 0, b"fence", 60)
    taken = [t.fields[b"id"].decode() for t in result.taken]  # type: ignore[index]
    assert urgent in taken and len(taken) == 3
    scripts.close()
    cluster.close()
    client.close()


def test_a_lane_cap_is_split_over_the_shards(
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
) -> None:
    config = ClientConfig(namespace=cluster_namespace, max_backlog=6, **CLIENT)
    client = Client(redis_cluster.url, config)
    first, second, third = _ids(client, 0, 3, "c")
    client.submit("a", job_id=first)
    client.submit("b", job_id=second)
    with pytest.raises(QueueFull):  # shard 0 holds its share: ceil(6 / 3)
        client.submit("c", job_id=third)
    for jid in _ids(client, 1, 2, "d") + _ids(client, 2, 2, "e"):
        client.submit("x", job_id=jid)  # the other shards still take theirs
    client.close()


def test_a_dead_workers_entries_are_reclaimed_from_every_shard(
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
) -> None:
    client = Client(redis_cluster.url, namespace=cluster_namespace, **CLIENT)
    ids = [j for s in range(3) for j in _ids(client, s, 2, "r")]
    client.submit_many(make_request("x", job_id=j) for j in ids)
    config = WorkerConfig(namespace=cluster_namespace, served_names=("tiny",))
    cluster = worker_connect(redis_cluster.url, config)
    assert isinstance(cluster, Cluster)

    def scripts_of(consumer: str) -> ShardedScripts:
        shards = [
            Scripts(cluster.bound(k.prefix), k, "workers", consumer, sharded=True)
            for k in client.layout.shards
        ]
        return ShardedScripts(client.layout, shards)

    dead, alive = scripts_of("dead"), scripts_of("alive")
    taken = dead.take(["tiny"], [10, 10, 10], [0, 0, 0], 0, b"dead", 60).taken
    assert len(taken) == 6
    reclaimed = alive.reclaim(["tiny"], idle_ms=0, most=100)
    assert sorted(t.fields[b"id"].decode() for t in reclaimed) == sorted(ids)  # type: ignore[index]
    assert {client.layout.index_of_key(t.stream) for t in reclaimed} == {0, 1, 2}
    for scripts in (dead, alive):
        scripts.close()
    cluster.close()
    client.close()


def test_a_durable_submit_returns_once_a_replica_holds_the_job(tmp_path: Path) -> None:
    """One server with a replica (the gateway's AsyncClient; Client does the same on a
    cluster above): the job is on the replica when the submit returns, a retried id too;
    with the replica gone, the submit says so instead of returning."""
    with RedisServer(tmp_path / "p", aof=False) as primary:
        with RedisServer(tmp_path / "r", aof=False) as replica:
            primary.client().config_set("repl-diskless-sync-delay", 0)  # no 5 s wait
            replica.client().replicaof("127.0.0.1", primary.port)
            wait_for(lambda: replica.client().info("replication")["master_link_status"] == "up")

            async def submit() -> None:
                # Each WAIT up to 1 s: a replica on a loaded machine took over 200 ms to ack.
                client = AsyncClient(
                    primary.url, durable_submit=True, durable_wait_ms=1000, retry_for=0.5, **CLIENT
                )
                job = await client.submit("hi", job_id="durable-1")
                assert replica.client().get("tokenq:job:durable-1") == b"queued"
                again = await client.submit("hi", job_id="durable-1")
                assert again.duplicate
                replica.stop(kill=True)
                with pytest.raises(RedisUnavailable) as lost:
                    await client.submit("hi", job_id="durable-2")
                assert isinstance(lost.value.last_error, NotReplicated)
                assert job.id == "durable-1"
                await client.aclose()

            asyncio.run(submit())


def test_the_async_client_spreads_durable_jobs_over_the_shards_and_streams_them_back(
    tiny_model: Path,  # noqa: F811
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
    roles: RoleUsers,
) -> None:
    """`AsyncClient.connect` finds the cluster behind a plain URL; its jobs (each returned
    once a replica holds it) land in every shard and stream back merged, each one's events
    from its own shard. The constructor, which opens no connection, points to `connect`.
    The client and the worker run as their roles' ACL users: no node refuses them."""
    with pytest.raises(ValueError, match="AsyncClient.connect"):
        AsyncClient(redis_cluster.seeds_url)
    requests = [{"prompt": f"fable {i}", "params": {"max_tokens": 8, **GREEDY}} for i in range(6)]
    config = fast_config(cluster_namespace)
    worker = Worker(make_engine(tiny_model), worker_connect(roles.url("worker"), config), config)

    async def run() -> dict[str, list[Any]]:
        client = await AsyncClient.connect(
            roles.url("client"), namespace=cluster_namespace, durable_submit=True, **CLIENT
        )
        assert client.layout.count == 3
        jobs = await client.submit_many(
            make_request(r["prompt"], job_id=f"aj-{i}", **r["params"])
            for i, r in enumerate(requests)
        )
        assert {client.layout.index(j.id) for j in jobs} == {0, 1, 2}
        seen: dict[str, list[Any]] = {j.id: [] for j in jobs}
        async for job, event in client.stream_many(jobs, timeout=60):
            seen[job.id].append(event)
        alone = await jobs[0].result(timeout=10)  # one job's stream, from its own shard
        assert alone.token_ids == check_reply(seen[jobs[0].id]).done.token_ids
        assert await jobs[1].status() == "done"
        assert (await client.submit("again", job_id=jobs[2].id)).duplicate
        await client.aclose()
        return seen

    with WorkerThread(worker):
        seen = asyncio.run(run())
    expected = reference_run(tiny_model, requests)
    for i, (_, final) in enumerate(expected):
        assert check_reply(seen[f"aj-{i}"]).done.token_ids == final.token_ids
    assert roles.refused() == []


def test_the_async_client_follows_a_failover_without_a_restart(
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
) -> None:
    """kill -9 of the primary holding shard 0 under an AsyncClient with open connections:
    its next submit to that shard waits out the failover and lands on the promoted replica,
    and a job submitted durably before the kill (held by that replica) is still there. (A
    durable submit after it waits for the old primary to come back as the new one's
    replica: until then no replica can confirm it.)"""
    victim = 0

    async def run() -> None:
        nonlocal victim
        url, ns = redis_cluster.url, cluster_namespace
        durable = await AsyncClient.connect(url, namespace=ns, durable_submit=True, **CLIENT)
        client = await AsyncClient.connect(url, namespace=ns, **CLIENT)
        before, after = _ids(client, 0, 2, "fo")  # type: ignore[arg-type]
        await durable.submit("before", job_id=before)
        assert await client.job(before).status() == "queued"  # connections to shard 0 open
        slot = key_slot(client.layout.shards[0].prefix.encode())
        victim = client.redis.nodes_manager.get_node_from_slot(slot).port
        redis_cluster.kill(victim)
        job = await client.submit("after", job_id=after)
        assert victim not in redis_cluster.primaries()
        assert await job.status() == "queued"
        assert await client.job(before).status() == "queued"
        await durable.aclose()
        await client.aclose()

    try:
        asyncio.run(run())
    finally:
        if victim:
            redis_cluster.start(victim)  # back as a replica of the new primary
        redis_cluster.wait_healthy()


def test_the_gateway_serves_the_openai_sdk_and_batches_with_per_key_limits_counted_apart(
    tiny_model: Path,  # noqa: F811
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
    roles: RoleUsers,
    tmp_path: Path,
) -> None:
    """Through the official SDK: answers equal the engine's; an Idempotency-Key retry
    attaches to its job; a batch file runs to its end (its keys in one slot, its lines'
    jobs over the shards, metered against the key); a full lane is a 429 whose admission,
    counted in a call of its own on the key's slot, was settled (no tokens or slot left);
    /metrics counts every shard's waiting jobs. The gateway, the worker and the client run
    as their roles' ACL users."""
    key = f"sk-{uuid.uuid4().hex}"
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"{key} - rpm=100 tpm=100000 concurrent=2\n")
    principal = principal_id(hashlib.sha256(key.encode()).digest())
    node = RedisCluster.from_url(redis_cluster.url)
    now = time.time()  # a live "worker" of a model that never takes a job: its lane fills
    ghost = {"names": json.dumps(["ghost"]), "max_model_len": 2048, "host": "g", "pid": 1}
    node.hset(f"{cluster_namespace}:worker:ghost", mapping={**ghost, "heartbeat_at": now})
    node.zadd(f"{cluster_namespace}:workers", {"ghost": int(now * 1000)})
    config = fast_config(cluster_namespace)
    worker = Worker(make_engine(tiny_model), worker_connect(roles.url("worker"), config), config)
    requests = [{"prompt": "a river", "params": {"max_tokens": 6, **GREEDY}}]
    ((_, final),) = reference_run(tiny_model, requests)
    with WorkerThread(worker):
        gateway = GatewayProcess(
            roles.url("gateway"), cluster_namespace, tmp_path / "gw.log",
            "--api-keys-file", str(keys_file), "--max-backlog", "3", "--batch-poll", "0.2",
            "--admin-key", "ops-key",
        )  # fmt: skip
        try:
            sdk = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key=key, max_retries=0)
            extra = {"ignore_eos": True}
            raw = sdk.completions.with_raw_response.create(
                model="tiny", prompt="a river", max_tokens=6, temperature=0, extra_body=extra,
                extra_headers={"Idempotency-Key": "gw-1"},
            )  # fmt: skip
            answer, job_id = raw.parse(), raw.headers["x-tokenq-job-id"]
            client = Client(roles.url("client"), namespace=cluster_namespace, **CLIENT)
            done = client.job(job_id).result(timeout=10)
            assert done.token_ids == final.token_ids and answer.choices[0].text == done.text
            again = sdk.completions.with_raw_response.create(
                model="tiny", prompt="a river", max_tokens=6, temperature=0, extra_body=extra,
                extra_headers={"Idempotency-Key": "gw-1"},
            )  # fmt: skip
            assert again.headers["x-tokenq-job-id"] == job_id
            assert again.parse().choices[0].text == done.text
            streamed = sdk.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                stream=True, extra_body=extra,
            )  # fmt: skip
            assert sum(1 for c in streamed if c.choices and c.choices[0].delta.content) >= 1
            lines = [
                {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "tiny", "max_tokens": 3,
                          "messages": [{"role": "user", "content": f"Say {i}."}]}}
                for i in range(4)
            ]  # fmt: skip
            content = "".join(json.dumps(x) + "\n" for x in lines).encode()
            upload = sdk.files.create(file=("in.jsonl", content), purpose="batch")
            batch = sdk.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            wait_for(lambda: sdk.batches.retrieve(batch.id).status == "completed", timeout=60)
            done_batch = sdk.batches.retrieve(batch.id)
            assert done_batch.request_counts.completed == 4
            output = sdk.files.content(done_batch.output_file_id).text.splitlines()
            assert sorted(json.loads(x)["custom_id"] for x in output) == ["c0", "c1", "c2", "c3"]
            tag = f"{{{cluster_namespace}:hooks:batches}}"
            assert node.exists(f"{cluster_namespace}:{tag}:batch:{batch.id}")
            # Each shard's share of the ghost's default lane (ceil(3 / 3)) is full.
            for shard in range(3):
                client.submit("wait", job_id=_ids(client, shard, 1, "ghost")[0], model="ghost")
            rate = f"{cluster_namespace}:gw:{{{principal}}}:rate"
            running = f"{cluster_namespace}:gw:{{{principal}}}:running"
            wait_for(lambda: node.zcard(running) == 0)  # the earlier requests settled
            before = node.hgetall(rate)
            full = httpx.post(
                f"{gateway.base}/v1/completions",
                json={"model": "ghost", "prompt": "x", "max_tokens": 50},
                headers={"Authorization": f"Bearer {key}", "Idempotency-Key": "full"},
                timeout=30,
            )
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
            tokens = {k: v for k, v in node.hgetall(rate).items() if k.startswith(b"t:")}
            assert tokens == {k: v for k, v in before.items() if k.startswith(b"t:")}
            assert node.zcard(running) == 0
            # The fleet's gauges, read from every shard: the ghost's three waiting jobs.
            ops = {"Authorization": "Bearer ops-key"}
            for path in ("/metrics", "/dashboard/data"):
                assert httpx.get(f"{gateway.base}{path}", headers=ops).status_code == 200
            metrics = httpx.get(f"{gateway.base}/metrics", headers=ops).text
            assert 'tokenq:queue_waiting{lane="default",model="ghost"} 3.0' in metrics
            client.close()
        finally:
            gateway.close()
            node.close()
    assert roles.refused() == []


def _die_on_reclaim(client: Client, job: Job) -> None:
    """Deliver the job's entry to a consumer that never runs it, as if five workers had
    died on it: the next worker to reclaim it dead-letters it (max_deliveries_exceeded)."""
    shard = client._shard(job.id)
    queue = shard.keys.queue("tiny", 0, "-")
    shard.redis.xgroup_create(queue, "workers", id="0")
    ((_, ((entry, _),)),) = shard.redis.xreadgroup("workers", "ghost", {queue: ">"}, count=1)
    shard.redis.xclaim(queue, "workers", "ghost", 0, [entry], retrycount=5, justid=True)


def test_inspect_the_exporter_and_dead_letter_replay_read_every_shard(
    tiny_model: Path,  # noqa: F811
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
    roles: RoleUsers,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two jobs die in two shards and one waits in a third: `inspect` and the exporter
    count them all, `dlq list` shows both dead letters newest first, `dlq replay` runs one
    to its end in its own shard (`result` reads it there), `dlq purge` empties every
    shard's dead letters. The commands run as the admin role's ACL user, the worker as
    the worker's."""
    before = structlog.get_config()  # in-process workers log to stderr, not the output read
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.__stderr__))
    where = ["--redis-url", roles.url("admin"), "--namespace", cluster_namespace]
    client = Client(redis_cluster.url, namespace=cluster_namespace, **CLIENT)  # makes the dead
    doomed = []
    for shard, tag in ((1, "dl-a"), (2, "dl-b")):
        (jid,) = _ids(client, shard, 1, tag)
        doomed.append(client.submit("replay me", job_id=jid, max_tokens=4, **GREEDY))
        _die_on_reclaim(client, doomed[-1])
    (waiting,) = _ids(client, 0, 1, "wait")
    client.submit("later", job_id=waiting, model="other", queue_anyway=True)
    config = fast_config(cluster_namespace)
    worker = Worker(make_engine(tiny_model), worker_connect(roles.url("worker"), config), config)
    try:
        with WorkerThread(worker):
            for job in doomed:
                with pytest.raises(JobFailed, match="max_deliveries_exceeded"):
                    job.result(timeout=30)
            status, out, _ = _run(capsys, "inspect", "--json", *where)
            fleet = json.loads(out)
            assert status == 0 and fleet["dead_letters"] == 2
            other = next(m for m in fleet["models"] if m["name"] == "other")
            assert other["lanes"]["default"]["waiting"] == 1
            assert other["lanes"]["default"]["backlog"] == 1
            assert other["lanes"]["default"]["oldest"]["job_id"] == waiting
            conn = connect(roles.url("admin"))
            gauges = {
                (s.name, s.labels.get("model"), s.labels.get("lane")): s.value
                for family in FleetCollector(conn, cluster_namespace).collect()
                for s in family.samples
            }
            conn.close()
            assert gauges[("tokenq:dead_letters", None, None)] == 2
            assert gauges[("tokenq:queue_waiting", "other", "default")] == 1
            status, out, _ = _run(capsys, "dlq", "list", "--json", *where)
            listing = json.loads(out)
            assert listing["count"] == 2
            letters = listing["dead_letters"]
            assert sorted(d["job_id"] for d in letters) == sorted(j.id for j in doomed)
            # newest first across the shards: the two die in whichever order the reclaims run
            when = [tuple(int(part) for part in d["id"].split("-")) for d in letters]
            assert when == sorted(when, reverse=True)
            status, out, err = _run(capsys, "dlq", "replay", doomed[0].id, *where)
            assert status == 0, err
            assert doomed[0].result(timeout=30).finish_reason == "length"
            status, out, _ = _run(capsys, "result", doomed[0].id, *where)
            assert (status, out) == (0, doomed[0].result().text + "\n")
        status, out, _ = _run(capsys, "dlq", "purge", "--yes", *where)
        assert (status, out) == (0, "deleted 1 dead letter(s)\n")
        status, out, _ = _run(capsys, "inspect", "--json", *where)
        assert json.loads(out)["dead_letters"] == 0
    finally:
        client.close()
        structlog.configure(**before)
    assert roles.refused() == []


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The `tokenq` command in-process: (exit status, stdout, stderr)."""
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_webhook_dispatcher_delivers_every_shards_events_in_order_per_job(
    tiny_model: Path,  # noqa: F811
    redis_cluster: LocalCluster,  # noqa: F811
    cluster_namespace: str,
    receiver: Callable[..., Receiver],  # noqa: F811
    roles: RoleUsers,
    tmp_path: Path,
) -> None:
    """Jobs of every shard with a webhook: each shard's event stream is read by a loop of
    its own, each job's events arrive once and in order, and the job's state (`done`) is
    kept in its shard, where PUBLISH keeps `last`. The dispatcher, the worker and the
    client run as their roles' ACL users."""
    secret = new_secret()
    hook = receiver(secret)
    client = Client(roles.url("client"), namespace=cluster_namespace, **CLIENT)
    config = fast_config(cluster_namespace)
    worker = Worker(make_engine(tiny_model), worker_connect(roles.url("worker"), config), config)
    extra = ("--first-backoff", "0.05", "--allow-private-webhooks")
    events = ["start", "completed"]
    with WorkerThread(worker):
        log = tmp_path / "d.log"
        with Dispatcher(roles.url("dispatcher"), cluster_namespace, secret, log, *extra):
            jobs = [
                client.submit(f"hook {s}", job_id=_ids(client, s, 1, "wh")[0], max_tokens=3,
                              webhook=hook.url, webhook_events_filter=events, **GREEDY)
                for s in range(3)
            ]  # fmt: skip
            wait_for(lambda: len(hook.completed()) == 3, timeout=30)
    assert not hook.bad and roles.refused() == []
    node = RedisCluster.from_url(redis_cluster.url)  # the default user, to look
    for job in jobs:
        assert hook.completed()[job.id]["data"]["text"] == job.result(timeout=5).text
        mine = [w for w in hook.order if w.startswith(f"msg_{job.id}_")]
        assert mine == [f"msg_{job.id}_job.started", f"msg_{job.id}_job.completed"]
        state = node.hgetall(f"{client.keys_of(job.id).prefix}:hook:{job.id}")
        assert state[b"done"] == state[b"last"] == str(COMPLETED_SEQ).encode()
    for stream in node.smembers(client.keys.hook_streams):
        assert node.xlen(stream) == 0  # delivered: acknowledged and deleted
        assert node.xpending(stream, DISPATCHERS)["pending"] == 0
    node.close()
    client.close()


def test_the_webhooks_commands_keep_a_namespaces_endpoints_on_a_cluster(
    roles: RoleUsers, cluster_namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tokenq webhooks add/list/remove` through any node, as the admin role: the
    namespace's endpoints are one key, which the cluster routes."""
    where = ["--redis-url", roles.url("admin"), "--namespace", cluster_namespace]
    secret = ["--webhook-secret", new_secret()]
    add = ["webhooks", "add", "https://hooks.example.com/tq", *where, *secret]
    assert cli.main(add) == 0, capsys.readouterr().err
    endpoint = json.loads(capsys.readouterr().out)
    assert cli.main(["webhooks", "list", *where]) == 0
    assert [e["id"] for e in json.loads(capsys.readouterr().out)] == [endpoint["id"]]
    assert cli.main(["webhooks", "remove", endpoint["id"], *where]) == 0
    assert cli.main(["webhooks", "list", *where]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert roles.refused() == []
