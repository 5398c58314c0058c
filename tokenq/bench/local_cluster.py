"""A real local Redis Cluster: three primaries and three replicas, AOF on, on free ports in
a folder, created with `redis-cli --cluster create`; for the tests (a session fixture) and
the cluster benchmarks (`tokenq bench cluster`)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

NODE_TIMEOUT_MS = 1000  # a dead primary's replica takes over within a few seconds


@dataclass
class LocalCluster:
    folder: Path
    ports: list[int]
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """A plain URL naming one node: tokenq finds the cluster from it."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    @property
    def seeds_url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + "/"

    def start(self, port: int) -> None:
        node = self.folder / str(port)
        node.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [
                "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--appendonly", "yes",
                # a replica may always take over (its data is as fresh as replication made it)
                "--cluster-replica-validity-factor", "0",
                "--save", "", "--dir", str(node), "--logfile", "redis.log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=1)

    def primaries(self) -> list[int]:
        """The ports of the nodes that are primaries now (as the live nodes see it)."""
        for port in self.ports:
            if self.procs[port].poll() is None:
                try:
                    nodes = self.node(port).cluster("nodes")
                except redis.RedisError:
                    continue
                return sorted(
                    int(addr.split(":")[1].split("@")[0])
                    for addr, info in nodes.items()
                    if "master" in info["flags"] and "fail" not in info["flags"]
                )
        return []

    def healthy(self) -> bool:
        for port in self.ports:
            if self.procs[port].poll() is None:
                try:
                    info = self.node(port).cluster("info")
                except redis.RedisError:
                    return False
                if info.get("cluster_state") != "ok":
                    return False
        return True

    def wait_healthy(self, timeout: float = 30) -> None:
        """Until every live node says ok and three primaries each have a synced replica."""
        _until(lambda: self.healthy() and _replicas_synced(self), timeout, "cluster not healthy")

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            proc.wait(timeout=10)


def _free_ports(count: int) -> list[int]:
    """Ports free with their cluster bus port (port + 10000, so below 55536)."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(20000, 45000)
        if port in ports or port + 10000 in ports or port - 10000 in ports:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        ports.append(port)
    return ports


def _up(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.3).ping())
    except redis.RedisError:
        return False


def start_cluster(folder: Path) -> LocalCluster:
    """Six nodes started and made a cluster, each primary with a synced replica."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RuntimeError("no redis-server / redis-cli: install Redis")
    cluster = LocalCluster(folder, _free_ports(6))
    try:
        for port in cluster.ports:
            cluster.start(port)
        _until(lambda: all(_up(p) for p in cluster.ports), 10, "cluster nodes did not start")
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        cluster.wait_healthy()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _until(done: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.05)


def _replicas_synced(cluster: LocalCluster) -> bool:
    primaries = cluster.primaries()
    if len(primaries) != 3:
        return False
    for port in primaries:
        info = cluster.node(port).info("replication")
        if info.get("connected_slaves", 0) < 1:
            return False
    return True
