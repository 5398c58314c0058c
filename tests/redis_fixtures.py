"""A real Redis server for the tests, and a private namespace per test.

`redis_url`: ``TOKENQ_TEST_REDIS_URL`` if set, else the server on 127.0.0.1:6379 if it
answers, else a throwaway ``redis-server`` on a free port for the session. Never a skip:
these tests are the queue's guarantees and must run in CI.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

LOCAL_URL = "redis://127.0.0.1:6379/0"
TEST_MODEL = "tiny"  # the name the test workers serve and the test clients ask for
# Test clients name their model and queue before any worker runs (as producers may).
CLIENT = {"model": TEST_MODEL, "require_worker": False}


def queue_of(namespace: str, priority: int = 0, tenant: str = "-") -> str:
    """The key of one of the test model's queues (see tokenq.protocol.Keys)."""
    return f"{namespace}:jobs:{TEST_MODEL}:{priority}:{tenant}"


def _answers(url: str) -> bool:
    try:
        conn = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(conn.ping())
        finally:
            conn.close()
    except redis.RedisError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    env = os.environ.get("TOKENQ_TEST_REDIS_URL")
    if env:
        yield env
        return
    if _answers(LOCAL_URL):
        yield LOCAL_URL
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("no Redis: set TOKENQ_TEST_REDIS_URL or install redis-server")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while not _answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server on port {port} did not start")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def redis_namespace(redis_url: str) -> Iterator[str]:
    """A namespace no other test uses; its keys are deleted afterwards, and only those."""
    namespace = f"tqtest-{uuid.uuid4().hex[:12]}"
    yield namespace
    conn = redis.Redis.from_url(redis_url)
    try:
        keys = list(conn.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            conn.delete(*keys)
    finally:
        conn.close()


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_url)
    yield conn
    conn.close()
