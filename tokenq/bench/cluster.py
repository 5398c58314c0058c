"""`tokenq bench cluster`: tokenq on a local Redis Cluster (three primaries, three
replicas, started in a temporary folder).

`sizing`: what one shard costs its primary, engine-free: jobs submitted (SUBMIT), jobs
taken and settled (TAKE, then PUBLISH of a final event), token events published (PUBLISH
of one event per running job), each as operations per second from one client process and
as the primary's CPU per operation (INFO cpu), which is what sizes a fleet's primaries.

`failover`: N jobs streaming across every shard through one worker, `kill -9` of the
primary holding shard 0 once they stream, its replica promoted: per job, terminal events,
token indices seen twice, restarts, tokens against the engine alone; the time the cluster
took to serve again; jobs lost (submitted and acknowledged, never ended)."""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tokenq.bench.local_cluster import LocalCluster, start_cluster
from tokenq.producer.client import Client, make_request
from tokenq.protocol import DoneEvent, ErrorEvent, RestartEvent, TokenEvent
from tokenq.protocol.connection import Cluster, connect

MODEL = "bench"
GREEDY = {"temperature": 0, "ignore_eos": True}


def _cpu(node: Any) -> float:
    info = node.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _ids_in_shard(client: Client, shard: int, count: int, tag: str) -> list[str]:
    ids: list[str] = []
    n = 0
    while len(ids) < count:
        jid = f"{tag}-{n}"
        if client.layout.index(jid) == shard:
            ids.append(jid)
        n += 1
    return ids


def sizing(cluster: LocalCluster, jobs: int, running: int, rounds: int) -> dict[str, Any]:
    from tokenq.worker.scripts import Item, Scripts, event_arg

    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    client = Client(cluster.url, namespace=namespace, model=MODEL, require_worker=False)
    shard = client._shards[0]
    conn = client.cluster.bound(shard.keys.prefix)  # type: ignore[union-attr]
    host, port = client.cluster.primary_of(  # type: ignore[union-attr]
        client.cluster.redis.keyslot(shard.keys.prefix)  # type: ignore[union-attr]
    )
    primary = cluster.node(port)
    scripts = Scripts(conn, shard.keys, "workers", "bench", sharded=True)
    token = b"bench:fence"
    out: dict[str, Any] = {"primary": f"{host}:{port}", "shards": client.layout.count}

    def measure(name: str, count: int, work: Any) -> None:
        cpu, began = _cpu(primary), time.perf_counter()
        work()
        wall, used = time.perf_counter() - began, _cpu(primary) - cpu
        out[name] = {"ops": count, "per_s": count / wall, "primary_cpu_us": 1e6 * used / count}

    ids = _ids_in_shard(client, 0, jobs, "s")
    measure("submit", jobs, lambda: [client.submit("hi", job_id=j, max_tokens=4) for j in ids])

    def take_and_settle() -> None:
        left = jobs
        while left > 0:
            taken = scripts.take([MODEL], [64, 64, 64], [0, 0, 0], 0, token, 60).taken
            items = []
            for t in taken:
                jid = t.fields[b"id"].decode()  # type: ignore[index]
                done = event_arg(DoneEvent("x", "length", [1]))
                backlog = shard.keys.backlog(MODEL, "default")
                items.append(
                    Item("check", t.stream, t.entry_id, jid, 1, "done", [done], backlog=backlog)
                )
            scripts.publish(token, items, 3600, 3600, 10000)
            left -= len(taken)

    measure("take_and_settle", jobs, take_and_settle)

    live = _ids_in_shard(client, 0, running, "r")
    for jid in live:
        client.submit("hi", job_id=jid, max_tokens=4)
    taken = scripts.take([MODEL], [running] * 3, [0, 0, 0], 0, token, 60).taken

    def stream_tokens() -> None:
        for r in range(rounds):
            items = [
                Item(
                    "check", t.stream, t.entry_id, t.fields[b"id"].decode(),  # type: ignore[index]
                    r + 1, "running" if r == 0 else "",
                    [event_arg(TokenEvent(r, [7], "x"))],
                )
                for t in taken
            ]  # fmt: skip
            scripts.publish(token, items, 3600, 3600, 10000)

    measure("token_events", running * rounds, stream_tokens)
    client.close()
    return out


def failover(
    cluster: LocalCluster, model: str, jobs: int, max_tokens: int, durable: bool, after: int
) -> dict[str, Any]:
    from tokenq.bench.local_cluster import _until
    from tokenq.engine import EngineConfig, LLMEngine
    from tokenq.worker.config import WorkerConfig
    from tokenq.worker.config import connect as worker_connect
    from tokenq.worker.worker import Worker

    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    client = Client(
        cluster.url, namespace=namespace, model=MODEL, require_worker=False,
        durable_submit=durable, retry_for=60,
    )  # fmt: skip
    engine_options = {"device": "cpu", "dtype": "float32", "max_num_seqs": 64}
    config = WorkerConfig(
        namespace=namespace, served_names=(MODEL,), claim_idle_ms=2000, max_backoff_s=0.5
    )
    engine = LLMEngine(EngineConfig(model=model, **engine_options))  # type: ignore[arg-type]
    worker = Worker(engine, worker_connect(cluster.url, config), config)
    prompts = [f"report number {i}" for i in range(jobs)]
    serving = threading.Thread(target=worker.run, daemon=True)
    serving.start()
    began = time.monotonic()
    handles = client.submit_many(make_request(p, max_tokens=max_tokens, **GREEDY) for p in prompts)
    submitted_s = time.monotonic() - began
    seen: dict[str, list[Any]] = {j.id: [] for j in handles}
    first_after: list[float] = []
    killed_at: list[float] = []
    cut = client.cluster.primary_of(  # type: ignore[union-attr]
        client.cluster.redis.keyslot(client.layout.shards[0].prefix)  # type: ignore[union-attr]
    )[1]

    def follow() -> None:
        for job, event in client.stream_many(handles, timeout=600):
            seen[job.id].append(event)
            if killed_at and not first_after and client.layout.index(job.id) == 0:
                first_after.append(time.monotonic() - killed_at[0])

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    _until(lambda: sum(len(v) for v in seen.values()) >= after, 300, "no events")
    killed_at.append(time.monotonic())
    cluster.kill(cut)
    _until(lambda: cut not in cluster.primaries() and cluster.healthy(), 60, "no failover")
    promoted_s = time.monotonic() - killed_at[0]
    reader.join(timeout=600)
    total_s = time.monotonic() - began
    worker.stop(grace=0)
    serving.join(timeout=60)
    reference = _reference(model, engine_options, prompts, max_tokens)
    ended_once = twice = restarts = wrong = unfinished = 0
    for job, want in zip(handles, reference, strict=True):
        events = seen[job.id]
        ends = [e for e in events if isinstance(e, DoneEvent | ErrorEvent)]
        restarts += sum(isinstance(e, RestartEvent) for e in events)
        indices: list[int] = []
        for e in events:
            if isinstance(e, RestartEvent):
                indices = []
            elif isinstance(e, TokenEvent):
                indices += range(e.index, e.index + len(e.token_ids))
        twice += len(indices) - len(set(indices))
        if len(ends) == 1:
            ended_once += 1
            if not isinstance(ends[0], DoneEvent) or ends[0].token_ids != want:
                wrong += 1
        elif not ends:
            unfinished += 1
    cluster.start(cut)
    cluster.wait_healthy(60)
    client.close()
    return {
        "jobs": jobs,
        "durable_submit": durable,
        "submit_s": round(submitted_s, 2),
        "ended_with_one_terminal_event": ended_once,
        "never_ended_lost": unfinished,
        "tokens_differing_from_engine": wrong,
        "token_indices_seen_twice": twice,
        "restart_events": restarts,
        "replica_promoted_s": round(promoted_s, 2),
        "first_event_of_shard_0_after_kill_s": round(first_after[0], 2) if first_after else None,
        "run_s": round(total_s, 1),
    }


def _reference(
    model: str, options: dict[str, Any], prompts: list[str], max_tokens: int
) -> list[list[int]]:
    from tokenq.engine import LLM, SamplingParams

    llm = LLM(model=model, **options)
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tokenq bench cluster", description=__doc__)
    ap.add_argument("mode", choices=("sizing", "failover"))
    ap.add_argument("--model", help="failover: the model folder the worker serves")
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--running", type=int, default=64, help="sizing: jobs streaming tokens")
    ap.add_argument("--rounds", type=int, default=200, help="sizing: token events per job")
    ap.add_argument("--durable-submit", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--kill-after-events", type=int, default=1000, help="failover: events seen before kill"
    )
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tokenq-cluster-") as folder:
        cluster = start_cluster(Path(folder))
        try:
            conn = connect(cluster.url)
            assert isinstance(conn, Cluster)
            conn.close()
            if args.mode == "sizing":
                result = sizing(cluster, args.jobs, args.running, args.rounds)
            else:
                if not args.model:
                    ap.error("failover needs --model")
                result = failover(
                    cluster, args.model, args.jobs, args.max_tokens, args.durable_submit,
                    args.kill_after_events,
                )  # fmt: skip
        finally:
            cluster.stop()
    for key, value in result.items():
        print(f"{key}: {value}")
