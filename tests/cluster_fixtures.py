"""A real local Redis Cluster for the tests (tokenq/bench/local_cluster.py), started once
per session, only by the tests that ask for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenq.bench.local_cluster import LocalCluster, start_cluster


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()
