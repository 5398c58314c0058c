"""The gateway's operator endpoints: the fleet's Prometheus gauges at /metrics, and
/dashboard, a live page of workers, lanes, tokens per second, TTFT and dead letters.

Everything comes from Redis (`tokenq/ops/fleet.py`, `tokenq/ops/dlq.py`): the gateway asks no
worker. Tokens per second and TTFT come from the counters each worker's registry entry
carries on every heartbeat (`tokens_generated`, `ttft_sum_s`, `ttft_count`): a worker's
tokens per second are their change between its last two heartbeats, the fleet's the sum
over the workers still reporting; TTFT is the mean over the requests finished in the last
minute. This process keeps ten minutes of these figures in memory, sampled when the page
asks (at most once a second, shared by every viewer): a page opened later draws what
earlier viewers saw, and nothing is kept while nobody looks.

Redis is read with blocking redis-py calls, so the endpoints run them in Starlette's
thread pool, never on the event loop; the connection they are given needs socket timeouts
so that a Redis that does not answer costs a request seconds, not forever.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import redis
from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool

from tokenq.ops.dlq import DeadLetters
from tokenq.ops.fleet import DEFAULT_STALE_S, Fleet, FleetCollector, FleetReader, RegisteredWorker
from tokenq.protocol import DEFAULT_NAMESPACE, LANES
from tokenq.protocol.connection import Cluster

HISTORY_S = 600.0  # how far back the charts go
SAMPLE_S = 1.0  # at most one chart point per this many seconds, however many viewers
TTFT_WINDOW_S = 60.0  # TTFT is the mean over the requests finished this long back
DEAD_LETTERS_SHOWN = 20  # the newest ones; `tokenq dlq list` shows more
PAGE = resources.files("tokenq.server").joinpath("dashboard.html").read_text("utf-8")


@dataclass
class Beat:
    """A worker's counters as one heartbeat carried them."""

    at: float  # its heartbeat time, unix seconds
    started_at: float | None
    tokens: float
    ttft_sum: float
    ttft_count: float


@dataclass
class Interval:
    """A worker's counters' change between two heartbeats."""

    start: float
    end: float
    tokens: float
    ttft_sum: float
    ttft_count: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.end - self.start)


def _beat(worker: RegisteredWorker) -> Beat | None:
    f = worker.figures
    if "tokens_generated" not in f:
        return None  # a worker from before the registry carried its load
    return Beat(
        worker.heartbeat_at,
        worker.started_at,
        f["tokens_generated"],
        f.get("ttft_sum_s", 0.0),
        f.get("ttft_count", 0.0),
    )


class Rates:
    """Tokens per second and TTFT, per worker and for the fleet, with a short history.

    Tokens per second are a worker's last interval between heartbeats (what it does now);
    TTFT is the mean over the requests finished in the last `ttft_window_s` (a request
    finishes now and then: one interval's mean would be blank most of the time)."""

    def __init__(
        self,
        history_s: float = HISTORY_S,
        sample_s: float = SAMPLE_S,
        ttft_window_s: float = TTFT_WINDOW_S,
    ) -> None:
        self.history_s = history_s
        self.sample_s = sample_s
        self.ttft_window_s = ttft_window_s
        self._last: dict[str, Beat] = {}
        self._intervals: dict[str, deque[Interval]] = {}  # the last ttft_window_s, per worker
        # (Redis time, fleet tokens/s, fleet mean TTFT over ttft_window_s or None)
        self.points: deque[tuple[float, float, float | None]] = deque()

    def observe(self, fleet: Fleet) -> None:
        """Take the heartbeats that are new since the last call; add a chart point."""
        registered = set()
        for worker in fleet.workers:
            registered.add(worker.consumer)
            beat = _beat(worker)
            prev = self._last.get(worker.consumer)
            if beat is None or (prev is not None and beat.at <= prev.at):
                continue
            self._last[worker.consumer] = beat
            if prev is None:
                continue
            intervals = self._intervals.setdefault(worker.consumer, deque())
            if (
                beat.started_at != prev.started_at
                or beat.tokens < prev.tokens
                or beat.ttft_count < prev.ttft_count
            ):
                intervals.clear()  # restarted: its counters began again
                continue
            intervals.append(
                Interval(
                    prev.at,
                    beat.at,
                    beat.tokens - prev.tokens,
                    beat.ttft_sum - prev.ttft_sum,
                    beat.ttft_count - prev.ttft_count,
                )
            )
            while intervals[0].end < beat.at - self.ttft_window_s:
                intervals.popleft()
        for gone in set(self._last) - registered:
            self._last.pop(gone)
            self._intervals.pop(gone, None)
        if self.points and fleet.at - self.points[-1][0] < self.sample_s:
            return
        self.points.append((fleet.at, self.tokens_per_s(fleet.workers), self.ttft(fleet.workers)))
        while self.points and self.points[0][0] < fleet.at - self.history_s:
            self.points.popleft()

    def current(self, worker: RegisteredWorker) -> Interval | None:
        """The worker's last interval while it still reports: a worker whose next
        heartbeat is overdue (twice its interval and a second) has stopped."""
        intervals = self._intervals.get(worker.consumer)
        if not intervals or not worker.live:
            return None
        last = intervals[-1]
        if worker.heartbeat_age_s > 2 * (last.end - last.start) + 1:
            return None
        return last

    def tokens_per_s(self, workers: list[RegisteredWorker]) -> float:
        """The sum of the workers' rates now (stopped ones count 0)."""
        return sum(i.tokens_per_s for i in map(self.current, workers) if i is not None)

    def ttft(self, workers: list[RegisteredWorker]) -> float | None:
        """Mean TTFT of the requests these workers finished in the last ttft_window_s
        (of their heartbeats: none when none finished)."""
        recent = [i for w in workers for i in self._recent(w)]
        count = sum(i.ttft_count for i in recent)
        return sum(i.ttft_sum for i in recent) / count if count else None

    def _recent(self, worker: RegisteredWorker) -> list[Interval]:
        intervals = self._intervals.get(worker.consumer, ())
        since = worker.heartbeat_at + worker.heartbeat_age_s - self.ttft_window_s
        return [i for i in intervals if i.end >= since]


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


class FleetView:
    """What /dashboard/data answers: the fleet now, and the rates' history. Thread-safe
    (the endpoints call it from the thread pool, one viewer's poll beside another's)."""

    def __init__(
        self,
        conn: redis.Redis | Cluster,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        stale_s: float = DEFAULT_STALE_S,
        history_s: float = HISTORY_S,
        sample_s: float = SAMPLE_S,
        dead_letters: int = DEAD_LETTERS_SHOWN,
    ) -> None:
        self.reader = FleetReader(conn, namespace, stale_s=stale_s)
        self.dead = DeadLetters(conn, namespace)
        self.rates = Rates(history_s, sample_s)
        self.dead_letters = dead_letters
        self._lock = threading.Lock()

    def data(self) -> dict[str, Any]:
        with self._lock:
            fleet = self.reader.read(entries=0)
            letters = self.dead.newest(self.dead_letters) if fleet.dead_letters else []
            self.rates.observe(fleet)
            tokens = self.rates.tokens_per_s(fleet.workers)
            ttft = self.rates.ttft(fleet.workers)
            points = [[t, _round(v), _round(s, 4)] for t, v, s in self.rates.points]
        workers = [self._worker(w) for w in fleet.workers]
        live = [w for w in workers if w["live"]]
        return {
            "namespace": fleet.namespace,
            "at": fleet.at,
            "totals": {
                "live_workers": len(live),
                "running": sum(w["running"] or 0 for w in live),
                "waiting": sum(w["waiting"] or 0 for w in live),
                "tokens_per_s": round(tokens, 3),
                "ttft_s": _round(ttft, 4),
                "ttft_window_s": self.rates.ttft_window_s,
            },
            "workers": workers,
            "models": [
                {
                    "name": m.name,
                    "workers": m.workers,
                    "lanes": {
                        lane: {
                            "backlog": m.lanes[lane].backlog,
                            "waiting": m.lanes[lane].waiting,
                            "pending": m.lanes[lane].pending,
                            "oldest_age_s": m.lanes[lane].oldest.age_s
                            if m.lanes[lane].oldest
                            else None,
                        }
                        for lane in LANES
                    },
                }
                for m in fleet.models
            ],
            "dead_letters": {
                "count": fleet.dead_letters,
                "newest": [
                    {
                        "id": d.id,
                        "job_id": d.job_id,
                        "code": d.code,
                        "message": d.message,
                        "age_s": round(max(0.0, fleet.at - d.failed_at), 1),
                    }
                    for d in letters
                ],
            },
            "webhooks": asdict(fleet.webhooks),
            "history": {"window_s": self.rates.history_s, "points": points},
        }

    def _worker(self, w: RegisteredWorker) -> dict[str, Any]:
        interval = self.rates.current(w)
        ttft = self.rates.ttft([w])
        running = w.figures.get("num_requests_running", w.load.get("num_requests_running"))
        waiting = w.figures.get("num_requests_waiting", w.load.get("num_requests_waiting"))
        return {
            "consumer": w.consumer,
            "live": w.live,
            "model": w.names[0] if w.names else None,
            "names": w.names,
            "host": w.host,
            "pid": w.pid,
            "heartbeat_age_s": round(w.heartbeat_age_s, 1),
            "running": None if running is None else int(running),
            "waiting": None if waiting is None else int(waiting),
            "kv_cache_usage": w.load.get("kv_cache_usage_perc"),
            "tokens_per_s": None if interval is None else round(interval.tokens_per_s, 3),
            "ttft_s": _round(ttft, 4),
        }


def dashboard_router(
    conn: redis.Redis | Cluster,
    namespace: str = DEFAULT_NAMESPACE,
    *,
    stale_s: float = DEFAULT_STALE_S,
) -> APIRouter:
    """GET /metrics (the fleet's gauges), /dashboard (the page) and /dashboard/data (its
    JSON). `conn`: a synchronous client with socket timeouts (see the module's docstring)."""
    view = FleetView(conn, namespace, stale_s=stale_s)
    registry = CollectorRegistry()
    registry.register(FleetCollector(conn, namespace, stale_s=stale_s))
    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body = await run_in_threadpool(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/data", include_in_schema=False)
    async def data() -> JSONResponse:
        try:
            body = await run_in_threadpool(view.data)
        except redis.RedisError as exc:
            message = f"Redis did not answer: {exc}"
            return JSONResponse(
                {"error": {"message": message, "at": round(time.time(), 3)}}, status_code=503
            )
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    return router
