"""The producer against a Redis that goes away: restarts, outages, lost replies, a frozen
server, and many callers streaming through one client.

Faults are injected into private servers (tests/faults.py), never into the shared one. The
test plays the worker: it appends reply events with XADD, with explicit entry ids so that
a retried XADD whose first try landed is refused instead of repeated.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.faults import RedisServer, TcpProxy
from tests.redis_fixtures import CLIENT, queue_of
from tests.waits import blocked_in_xread, named, wait_for
from tokenq.producer.client import AsyncClient, Client, ClientConfig
from tokenq.producer.errors import RedisUnavailable
from tokenq.protocol import DoneEvent, Event, Keys, TokenEvent, encode_event

NS = "t"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as srv:
        yield srv


def reply(n_tokens: int) -> list[Event]:
    tokens: list[Event] = [TokenEvent(i, [i], f"t{i} ") for i in range(n_tokens)]
    text = "".join(f"t{i} " for i in range(n_tokens))
    return [*tokens, DoneEvent(text, "length", list(range(n_tokens)))]


def entry_id(n: int) -> str:
    return f"{n}-1"


def raw_conn(port: int) -> redis.Redis:
    """The test's own connection: no retries of redis-py's, short timeouts."""
    return redis.Redis(
        port=port, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )


class Writer(threading.Thread):
    """Plays the worker: appends `events` to the reply streams of `job_ids` round by round
    (every job's first event, then every job's second...), riding out outages itself."""

    def __init__(
        self, port: int, job_ids: list[str], events: list[Event], pause: float = 0.0
    ) -> None:
        super().__init__(daemon=True)
        self.conn = raw_conn(port)
        self.keys = Keys(NS)
        self.job_ids = job_ids
        self.events = events
        self.pause = pause
        self.outage_hits = 0  # tries that met a Redis that was not there
        self.max_clients = 0  # the most connections the server had, sampled every round

    def run(self) -> None:
        for n, event in enumerate(self.events, 1):
            fields = encode_event(event)
            for job_id in self.job_ids:
                self._append(self.keys.reply(job_id), fields, entry_id(n))
            clients = self._retry(lambda: self.conn.info("clients")["connected_clients"])
            self.max_clients = max(self.max_clients, clients)
            time.sleep(self.pause)  # a worker's pace between steps

    def _append(self, key: str, fields: dict, eid: str) -> None:
        try:
            self._retry(lambda: self.conn.xadd(key, fields, id=eid))
        except redis.ResponseError as exc:  # the try that lost its reply had landed
            assert "equal or smaller" in str(exc)

    def _retry(self, call):  # type: ignore[no-untyped-def]
        while True:
            try:
                return call()
            except (redis.ConnectionError, redis.TimeoutError):
                self.outage_hits += 1
                time.sleep(0.02)  # a retry's pause while Redis is away


def assert_whole_reply(events: list[Event], n_tokens: int) -> None:
    """Every event exactly once, in order."""
    assert [e.event_id for e in events] == [entry_id(n) for n in range(1, n_tokens + 2)]
    assert [e.index for e in events[:-1]] == list(range(n_tokens))
    assert events[-1].type == "done"


# --- restarts and outages --------------------------------------------------------------


# A caller that follows alone reads on its own thread unless its deadline could come
# before its socket calls time out (then the reader's thread reads): both ride it out.
READERS = pytest.mark.parametrize("timeout", [20, None], ids=["reader-thread", "caller-thread"])


@READERS
def test_stream_rides_out_a_restart_without_gap_or_repeat(
    server: RedisServer, timeout: float | None
) -> None:
    client = Client(server.url, namespace=NS, **CLIENT)
    writer = Writer(server.port, ["j"], reply(40), pause=0.02)
    restart = threading.Timer(0.3, server.restart, kwargs={"down_for": 0.5})
    writer.start()
    restart.start()
    events = list(client.job("j").stream(timeout=timeout))
    restart.join()
    writer.join()
    assert writer.outage_hits > 0  # the restart came while the reply was being written
    assert_whole_reply(events, 40)
    client.close()


def test_async_stream_rides_out_a_restart(server: RedisServer) -> None:
    async def scenario() -> list[Event]:
        async with AsyncClient(server.url, namespace=NS, **CLIENT) as client:
            return [e async for e in client.job("j").stream(timeout=20)]

    writer = Writer(server.port, ["j"], reply(40), pause=0.02)
    restart = threading.Timer(0.3, server.restart, kwargs={"down_for": 0.5})
    writer.start()
    restart.start()
    events = asyncio.run(scenario())
    restart.join()
    writer.join()
    assert writer.outage_hits > 0
    assert_whole_reply(events, 40)


def test_submit_waits_out_an_outage_and_queues_once(server: RedisServer) -> None:
    client = Client(server.url, namespace=NS, **CLIENT)
    client.submit("before")  # leaves a pooled connection that the restart kills
    server.stop()
    threading.Timer(1.0, server.start).start()
    start = time.monotonic()
    job = client.submit("during", job_id="during")
    assert 0.9 <= time.monotonic() - start < 5
    assert not job.duplicate and job.status() == "queued"
    check = raw_conn(server.port)
    ids = [fields[b"id"] for _, fields in check.xrange(queue_of(NS))]
    assert len(ids) == 2 and ids.count(b"during") == 1
    client.close()


def test_async_submit_waits_out_an_outage(server: RedisServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.url, namespace=NS, **CLIENT) as client:
            await client.submit("before")
            server.stop()
            threading.Timer(1.0, server.start).start()
            job = await client.submit("during", job_id="during")
            assert not job.duplicate and await job.status() == "queued"

    asyncio.run(scenario())
    assert raw_conn(server.port).xlen(queue_of(NS)) == 2


def test_a_submit_whose_reply_was_lost_is_queued_once(server: RedisServer) -> None:
    with TcpProxy(server.port) as proxy:
        client = Client(proxy.url, namespace=NS, **CLIENT)
        client.submit("x", job_id="warm-up")  # the submit script is loaded from here on
        proxy.cut_reply(b"EVALSHA")
        job = client.submit("x", job_id="cut")
        assert proxy.cuts_done == 1
        # The retry found the job its own lost submit had queued: a normal handle, flagged.
        assert job.id == "cut" and job.duplicate
        assert raw_conn(server.port).xlen(queue_of(NS)) == 2
        client.close()


def test_retry_for_runs_out_with_a_clear_error(server: RedisServer) -> None:
    client = Client(server.url, namespace=NS, **CLIENT, retry_for=1.0)
    job = client.submit("x")
    server.stop()
    for call in (lambda: client.submit("y"), job.result):
        start = time.monotonic()
        with pytest.raises(RedisUnavailable) as info:
            call()
        assert 0.9 <= time.monotonic() - start < 2.0
        assert isinstance(info.value, redis.ConnectionError)
        assert f"127.0.0.1:{server.port}" in str(info.value) and "retried for 1." in str(info.value)
        assert isinstance(info.value.last_error, redis.ConnectionError)
    impatient = Client(server.url, namespace=NS, **CLIENT, retry_for=0).job(job.id)  # no retries
    start = time.monotonic()
    with pytest.raises(RedisUnavailable):
        impatient.cancel()
    with pytest.raises(RedisUnavailable):
        impatient.status()
    assert time.monotonic() - start < 0.5
    client.close()


def test_timeout_and_retry_for_whichever_comes_first(server: RedisServer) -> None:
    server.stop()
    patient = Client(server.url, namespace=NS, **CLIENT, retry_for=5)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        patient.job("j").result(timeout=0.5)
    assert type(info.value) is TimeoutError and 0.45 <= time.monotonic() - start < 0.8
    hasty = Client(server.url, namespace=NS, **CLIENT, retry_for=0.5)
    start = time.monotonic()
    with pytest.raises(RedisUnavailable):
        hasty.job("j").result(timeout=5)
    assert 0.45 <= time.monotonic() - start < 1.0


def test_async_retry_for_and_timeout(server: RedisServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.url, namespace=NS, **CLIENT, retry_for=0.5) as client:
            job = await client.submit("x")
            server.stop()
            for call in (lambda: client.submit("y"), job.result, job.status):
                start = time.monotonic()
                with pytest.raises(RedisUnavailable):
                    await call()
                assert 0.45 <= time.monotonic() - start < 1.5
            start = time.monotonic()
            with pytest.raises(TimeoutError) as info:
                await job.result(timeout=0.2)
            assert type(info.value) is TimeoutError and time.monotonic() - start < 0.4

    asyncio.run(scenario())


# --- a frozen server: the caller's timeout still holds ---------------------------------


@pytest.mark.parametrize("own_connection", [True, False], ids=["url", "users-redis"])
def test_result_timeout_holds_with_redis_frozen(server: RedisServer, own_connection: bool) -> None:
    # A redis.Redis passed in keeps its settings, even no socket timeout at all.
    conn = server.url if own_connection else server.client(socket_timeout=None)
    client = Client(conn, namespace=NS, **CLIENT)
    job = client.submit("x")
    server.freeze()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            job.result(timeout=2)
        elapsed = time.monotonic() - start
    finally:
        server.thaw()
    assert type(info.value) is TimeoutError  # the builtin, not redis.TimeoutError
    assert 1.8 <= elapsed < 2.8
    client.close()


def test_async_result_timeout_holds_with_redis_frozen(server: RedisServer) -> None:
    async def scenario() -> float:
        async with AsyncClient(server.url, namespace=NS, **CLIENT) as client:
            job = await client.submit("x")
            server.freeze()
            try:
                start = time.monotonic()
                with pytest.raises(TimeoutError) as info:
                    await job.result(timeout=2)
                assert type(info.value) is TimeoutError
                return time.monotonic() - start
            finally:
                server.thaw()

    assert 1.8 <= asyncio.run(scenario()) < 2.8


# --- many callers, one connection ------------------------------------------------------


@READERS
def test_120_sync_readers_share_one_connection(tmp_path: Path, timeout: float | None) -> None:
    with RedisServer(tmp_path, aof=False) as server:
        client = Client(server.url, namespace=NS, **CLIENT)
        job_ids = [f"j{i}" for i in range(120)]
        got: dict[str, list[Event]] = {}
        failures: list[BaseException] = []

        def read(job_id: str) -> None:
            try:
                got[job_id] = list(client.job(job_id).stream(timeout=timeout))
            except BaseException as exc:
                failures.append(exc)

        readers = [threading.Thread(target=read, args=(j,)) for j in job_ids]
        for thread in readers:
            thread.start()
        writer = Writer(server.port, job_ids, reply(5), pause=0.02)
        writer.start()
        for thread in readers:
            thread.join(30)
        writer.join()
        assert not failures
        for job_id in job_ids:
            assert_whole_reply(got[job_id], 5)
        # The client's one reader, the writer's connection; no more.
        assert writer.max_clients <= 2
        client.close()


def test_200_async_readers_share_one_connection(tmp_path: Path) -> None:
    with RedisServer(tmp_path, aof=False) as server:
        job_ids = [f"j{i}" for i in range(200)]
        writer = Writer(server.port, job_ids, reply(5), pause=0.02)

        async def scenario() -> list[list[Event]]:
            async with AsyncClient(server.url, namespace=NS, **CLIENT) as client:

                async def read(job_id: str) -> list[Event]:
                    return [e async for e in client.job(job_id).stream(timeout=20)]

                tasks = [asyncio.create_task(read(j)) for j in job_ids]
                await asyncio.sleep(0)  # a turn of the loop: each task starts its stream
                writer.start()
                return await asyncio.gather(*tasks)

        for events in asyncio.run(scenario()):
            assert_whole_reply(events, 5)
        writer.join()
        assert writer.max_clients <= 2


def test_a_new_follower_does_not_wait_for_the_others(redis_url: str, redis_namespace: str) -> None:
    """One XREAD serves every follower; one joining while it blocks is read within about
    block_ms, not after the others' events or a long BLOCK."""
    name = f"{redis_namespace}-idle"
    client = Client(named(redis_url, name), namespace=redis_namespace, **CLIENT)
    conn = redis.Redis.from_url(redis_url)
    idle = client.job("idle").stream(timeout=10)
    blocked = threading.Thread(target=lambda: next(idle, None), daemon=True)
    blocked.start()
    wait_for(lambda: blocked_in_xread(conn, name), timeout=10)  # on the idle stream
    late = client.submit("x")
    conn.xadd(client.keys.reply(late.id), encode_event(reply(0)[0]))
    start = time.monotonic()
    assert late.result(timeout=5).finish_reason == "length"
    assert time.monotonic() - start < 0.5
    conn.xadd(client.keys.reply("idle"), encode_event(reply(0)[0]))
    blocked.join(5)
    client.close()
    conn.close()


def test_followers_of_one_stream_each_get_their_own_part(
    redis_url: str, redis_namespace: str
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn = redis.Redis.from_url(redis_url)
    key = client.keys.reply("shared")
    events = reply(3)
    ids = [conn.xadd(key, encode_event(events[0])).decode()]
    got: dict[str, list[str]] = {}

    def follow(name: str, after: str) -> None:
        got[name] = [e.event_id for e in client.job("shared").stream(after=after, timeout=10)]

    threads = [
        threading.Thread(target=follow, args=("from-start", "0-0")),
        threading.Thread(target=follow, args=("from-first", ids[0])),
    ]
    for thread in threads:
        thread.start()
    for event in events[1:]:
        time.sleep(0.05)  # events come while both follow, as a worker writes them
        ids.append(conn.xadd(key, encode_event(event)).decode())
    for thread in threads:
        thread.join(10)
    assert got == {"from-start": ids, "from-first": ids[1:]}
    client.close()
    conn.close()


def test_config_refuses_a_block_that_never_returns() -> None:
    with pytest.raises(ValueError, match="block_ms"):
        ClientConfig(block_ms=0)
    with pytest.raises(ValueError, match="retry_for"):
        ClientConfig(retry_for=-1)


def test_submits_ride_out_a_failover_that_left_them_on_a_replica(tmp_path: Path) -> None:
    """The server behind the URL is a replica for a moment (READONLY, as after a failover,
    until the name points at the new primary): both clients' submits wait it out within
    retry_for, instead of failing at once; the refused tries queued nothing."""
    with (
        RedisServer(tmp_path / "primary", aof=False) as primary,
        RedisServer(tmp_path / "server", aof=False) as server,
    ):
        admin = server.client()
        admin.replicaof("127.0.0.1", primary.port)

        def promote_soon() -> threading.Timer:
            timer = threading.Timer(0.5, lambda: admin.replicaof("NO", "ONE"))
            timer.start()
            return timer

        client = Client(server.url, namespace="failover", model="m", retry_for=10)
        promote_soon()
        started = time.monotonic()
        job = client.submit("hi", queue_anyway=True)
        assert 0.4 < time.monotonic() - started < 10
        assert job.status() == "queued" and not job.duplicate
        queue = client.keys.queue("m", 0, "-")
        assert admin.xlen(queue) == 1

        async def submit_async() -> str:
            aclient = AsyncClient(server.url, namespace="failover", model="m", retry_for=10)
            try:
                return (await aclient.submit("hi again", queue_anyway=True)).id
            finally:
                await aclient.aclose()

        admin.replicaof("127.0.0.1", primary.port)
        promote_soon()
        second = asyncio.run(submit_async())
        assert client.job(second).status() == "queued"
        client.close()
