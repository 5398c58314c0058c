"""`tokenq bench webhooks`: the dispatcher (`tokenq webhooks run`) against plain HTTP posts.

Both sides send the same bodies to the same local receiver (uvicorn, in a process of its
own) at the same concurrency: the dispatcher reads each event from its Redis stream,
resolves and checks the address, signs it, posts it and acknowledges it; the reference
only posts. Reported: deliveries per second of each and their ratio, and the time from an
event's write (the call that ends its job writes it) to its receipt, p50 and p99, with
events written one at a time at a steady rate."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import socket
import threading
import time
import uuid
from typing import Any

import httpx
import redis
import redis.asyncio as aioredis

from tokenq.protocol import Keys, pack
from tokenq.protocol.connection import DEFAULT_REDIS_URL
from tokenq.protocol.webhooks import COMPLETED_SEQ, JOB_COMPLETED, HookEvent, job_data
from tokenq.webhooks.dispatcher import Dispatcher, DispatcherConfig
from tokenq.webhooks.signing import headers
from tokenq.webhooks.whsec import new_secret

TEXT = "word " * 50  # a short completion's text


def _receiver(port: int, ready: Any) -> None:
    """A local receiver: answers 204 and keeps (webhook-id, receipt time); GET /count says
    how many, /seen gives them, /reset gives them and forgets them."""
    import uvicorn

    seen: list[tuple[str, float]] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        body = b""
        if scope["method"] == "POST":
            wid = dict(scope["headers"]).get(b"webhook-id", b"").decode()
            seen.append((wid, time.time()))
        elif scope["path"] == "/count":
            body = str(len(seen)).encode()
        else:
            body = json_of(seen)
            if scope["path"] == "/reset":
                seen.clear()
        await send({"type": "http.response.start", "status": 204 if not body else 200})
        await send({"type": "http.response.body", "body": body})

    ready.set()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def json_of(seen: list[tuple[str, float]]) -> bytes:
    return json.dumps(seen).encode()


def percentile(values: list[float], q: float) -> float:
    """Nearest rank, as `tokenq bench queue` reports it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _event(i: int, url: str) -> HookEvent:
    jid = f"bench-{i}"
    data = job_data(jid, "bench", "done", text=TEXT, finish_reason="length", metadata=None)
    return HookEvent(jid, COMPLETED_SEQ, JOB_COMPLETED, data, time.time(), url)


def _write(conn: redis.Redis, stream: str, event: HookEvent) -> None:
    fields = {"job": event.subject, "seq": event.seq, "prev": -1, "data": pack(event.payload())}
    conn.xadd(stream, fields)


class Running:
    """A dispatcher on a thread of its own, with its own event loop."""

    def __init__(self, url: str, config: DispatcherConfig) -> None:
        self.url, self.config = url, config
        self.loop = asyncio.new_event_loop()
        self.dispatcher: Dispatcher | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        async def main() -> None:
            conn = aioredis.Redis.from_url(self.url)
            self.dispatcher = Dispatcher(conn, self.config)
            await self.dispatcher.run()
            await conn.aclose()

        self.loop.run_until_complete(main())

    def stop(self) -> None:
        while self.dispatcher is None:
            time.sleep(0.01)
        self.loop.call_soon_threadsafe(self.dispatcher.stop)
        self.thread.join(timeout=30)


def _count(poll: httpx.Client, base: str) -> int:
    return int(poll.get(f"{base}/count", timeout=30).text)


def _seen(poll: httpx.Client, base: str, reset: bool = False) -> list[tuple[str, float]]:
    """What the receiver got (one client, kept: making one costs a TLS context, 0.17 s of
    CPU here, taken from the dispatcher's thread)."""
    return poll.get(f"{base}/{'reset' if reset else 'seen'}", timeout=30).json()


async def _plain(url: str, bodies: list[bytes], concurrency: int, secret: str) -> float:
    """The reference: the same bodies posted at the same concurrency, headers made once."""
    sent = headers(secret, "msg_bench", int(time.time()), bodies[0])
    todo = iter(bodies)
    async with httpx.AsyncClient(
        limits=httpx.Limits(max_connections=concurrency), trust_env=False
    ) as http:

        async def lane() -> None:
            for body in todo:
                (await http.post(url, content=body, headers=sent)).raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tokenq bench webhooks", description=__doc__)
    ap.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    ap.add_argument("--events", type=int, default=2000, help="events for the throughput run")
    ap.add_argument("--concurrency", type=int, default=4, help="attempts at once, both sides")
    ap.add_argument("--rate", type=float, default=20.0, help="events/s for the latency run")
    ap.add_argument("--latency-events", type=int, default=300)
    args = ap.parse_args(argv)

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    receiver = ctx.Process(target=_receiver, args=(port, ready), daemon=True)
    receiver.start()
    ready.wait(30)
    poll = httpx.Client(trust_env=False)
    while True:
        try:
            _seen(poll, base)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    conn = redis.Redis.from_url(args.redis_url)
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    stream = keys.hooks(keys.queue("bench", 0, "-"))
    conn.sadd(keys.hook_streams, stream)
    secret = new_secret()
    hook = f"{base}/hook"
    config = DispatcherConfig(
        secret=secret,
        namespace=namespace,
        allow_private=True,
        per_endpoint=args.concurrency,  # its own bound on attempts at once to one endpoint
    )
    try:
        # Throughput: a backlog of events, drained.
        events = [_event(i, hook) for i in range(args.events)]
        with conn.pipeline(transaction=False) as pipe:
            for event in events:
                _write(pipe, stream, event)  # type: ignore[arg-type]
            pipe.execute()
        start = time.perf_counter()
        running = Running(args.redis_url, config)
        while _count(poll, base) < args.events:
            time.sleep(0.2)
        dispatched = time.perf_counter() - start
        bodies = [e.body() for e in events]
        _seen(poll, base, reset=True)
        plain = asyncio.run(_plain(hook, bodies, args.concurrency, secret))
        _seen(poll, base, reset=True)
        # Latency: one event at a time, at a steady rate, each timed from its write.
        written: dict[str, float] = {}
        gap = 1.0 / args.rate
        next_at = time.perf_counter()
        for i in range(args.latency_events):
            event = _event(args.events + i, hook)
            written[event.webhook_id] = event.created
            _write(conn, stream, event)
            next_at += gap
            time.sleep(max(0.0, next_at - time.perf_counter()))
        while _count(poll, base) < args.latency_events:
            time.sleep(0.2)
        lags = [at - written[wid] for wid, at in _seen(poll, base) if wid in written]
        running.stop()
    finally:
        leftover = list(conn.scan_iter(match=f"{namespace}:*", count=1000))
        if leftover:
            conn.delete(*leftover)
        receiver.kill()
    d_rate, p_rate = args.events / dispatched, args.events / plain
    print(
        f"{args.events} events, {args.concurrency} at once, to a local receiver (uvicorn, "
        f"its own process); {os.cpu_count()} CPUs"
    )
    print(f"  dispatcher (Redis, checks, signature, ack)  {d_rate:8.0f} deliveries/s")
    print(f"  plain posts (httpx, same bodies)            {p_rate:8.0f} posts/s")
    print(f"  ratio dispatcher / plain                    {d_rate / p_rate:8.2f}")
    print(
        f"from an event's write to its receipt, {args.latency_events} events at "
        f"{args.rate:g}/s: p50 {percentile(lags, 50) * 1000:.1f} ms, "
        f"p99 {percentile(lags, 99) * 1000:.1f} ms"
    )
