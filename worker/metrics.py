"""A worker's Prometheus metrics: vLLM's names with a `tokenq:` prefix.

Each worker owns a `CollectorRegistry` (never prometheus_client's global one, so a process
may hold several workers: the tests do) and serves it over HTTP when given a port
(`--metrics-port`). Per-request metrics are labelled by model (the worker's served name)
and lane (from the job's priority); the engine's gauges and counters are read from the
driver's latest `EngineStats` at scrape time, so a scrape never waits on the engine.

A small summary of the same figures also goes to the Redis hash `<ns>:metrics:<consumer>`
and the periodic log line: `tokenq inspect` shows each worker's load from it without
scraping anything.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from tokenq.engine.outputs import EngineStats, RequestDelta

PREFIX = "tokenq:"
# Seconds, from a fast GPU's inter-token gap to a batch job that waited minutes.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time from the job entering its queue to its first token.",
    "inter_token_latency_seconds": "Time between two tokens of one request.",
    "e2e_request_latency_seconds": "Time from the job entering its queue to its end.",
    "request_queue_time_seconds": "Time from the job entering its queue to its first step.",
}
NO_LANE = "unknown"  # an entry whose queue names no lane (protocol 1's stream)


class _EngineCollector(Collector):
    """The engine's own figures, read from its latest stats snapshot at each scrape."""

    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self.model = model
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for name, help, value in (
            ("num_requests_running", "Requests in the running batch", stats.num_running),
            ("num_requests_waiting", "Requests admitted, waiting for a slot", stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)", stats.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, help, labels=["model"])
            gauge.add_metric([self.model], value)
            yield gauge
        counters = stats.counters
        preemptions = CounterMetricFamily(
            PREFIX + "num_preemptions",
            "Requests preempted (recomputed later), by cause: kv_cache or priority.",
            labels=["model", "cause"],
        )
        for cause in ("kv_cache", "priority"):
            preemptions.add_metric([self.model, cause], counters.get(f"preemptions_{cause}", 0))
        yield preemptions
        hits = counters.get("prefix_cache_hit_tokens", 0)
        for name, help, value in (
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits),
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (found or computed); "
                "hit rate = rate(hits) / rate(queries).",
                hits + counters.get("prompt_tokens", 0),
            ),
        ):
            counter = CounterMetricFamily(PREFIX + name, help, labels=["model"])
            counter.add_metric([self.model], value)
            yield counter
        yield from self._structured(counters)

    def _structured(self, counters: dict[str, int]) -> Iterator[Metric]:
        """Structured outputs: requests, grammar compile and mask times, refusals."""
        requests = CounterMetricFamily(
            PREFIX + "structured_requests",
            "Requests with structured_outputs (JSON Schema, regex, choice, grammar).",
            labels=["model"],
        )
        requests.add_metric([self.model], counters.get("structured_requests", 0))
        yield requests
        compile_time = SummaryMetricFamily(
            PREFIX + "structured_compile_seconds",
            "Time to build a request's grammar matcher: cold (compiled) or cached (copied).",
            labels=["model", "cache"],
        )
        for cache in ("cold", "cached"):
            compile_time.add_metric(
                [self.model, cache],
                counters.get(f"structured_compile_{cache}", 0),
                counters.get(f"structured_compile_{cache}_us", 0) / 1e6,
            )
        yield compile_time
        mask = SummaryMetricFamily(
            PREFIX + "structured_mask_seconds",
            "Time per step to fill the token masks of its constrained requests (while the "
            "forward pass runs).",
            labels=["model"],
        )
        mask.add_metric(
            [self.model],
            counters.get("structured_mask_steps", 0),
            counters.get("structured_mask_us", 0) / 1e6,
        )
        yield mask
        refused = CounterMetricFamily(
            PREFIX + "structured_rejections",
            "Requests ended with invalid_params by the worker because their grammar did not "
            "compile (reason compile) or compiled past the time limit (timeout).",
            labels=["model", "reason"],
        )
        for reason in ("compile", "timeout"):
            value = counters.get(f"structured_refused_{reason}", 0)
            refused.add_metric([self.model, reason], value)
        yield refused


def observe_many(hist: Histogram, values: Iterable[float]) -> None:
    """``hist.observe(v)`` for each value, one locked add per bucket touched: per value, a
    job's inter-token gaps took a quarter of the Redis side's time under the interpreter
    lock. Falls back to ``observe`` on another prometheus_client's layout."""
    values = list(values)
    bounds = getattr(hist, "_upper_bounds", None)
    buckets = getattr(hist, "_buckets", None)
    if bounds is None or buckets is None or not hasattr(hist, "_sum"):
        for v in values:
            hist.observe(v)
        return
    if not values:
        return
    hist._sum.inc(sum(values))
    for index, n in Tally(bisect_left(bounds, v) for v in values).items():
        buckets[index].inc(n)  # bisect_left: the first bound >= v, as observe picks


class WorkerMetrics:
    """Everything one worker measures. Called from its intake and publisher threads
    (prometheus_client's metrics are thread-safe); scraped from the HTTP server's."""

    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self.model = model
        self.stats = stats
        self.registry = CollectorRegistry()
        self._server: WSGIServer | None = None
        r = self.registry
        labels = ["model", "lane"]
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens",
            "Tokens generated (a re-run after a crash counts only its new ones).",
            labels,
            registry=r,
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Requests that ended normally, by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            PREFIX + "request_error",
            "Requests that ended with an error event or a dead letter, by error code.",
            [*labels, "code"],
            registry=r,
        )
        self.histograms = {
            name: Histogram(PREFIX + name, help, labels, buckets=LATENCY_BUCKETS, registry=r)
            for name, help in HISTOGRAMS.items()
        }
        r.register(_EngineCollector(model, stats))
        # The summary's totals (Redis hash, log line, tests), kept beside the labelled
        # counters so that reading them needs no walk over the registry.
        self.request_success_total: Tally[str] = Tally()  # by finish reason
        self.request_error_total: Tally[str] = Tally()  # by error code
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # TTFT of finished requests, as a sum and a count: the registry entry carries them
        # so that a reader can take the mean over any interval (the gateway's /dashboard).
        self.ttft_sum_s = 0.0
        self.ttft_count = 0

    def finished(self, out: RequestDelta, lane: str, skipped_tokens: int = 0) -> None:
        """Account one finished request; `skipped_tokens` were generated (and counted) by
        an earlier run of the same job."""
        reason = out.finish_reason or "unknown"
        completion = sum(o.completion_tokens for o in out.outputs or [out])  # all n outputs
        generated = max(0, completion - skipped_tokens)
        self.request_success_total[reason] += 1
        self.prompt_tokens_total += out.prompt_tokens
        self.generation_tokens_total += generated
        self.success.labels(self.model, lane, reason).inc()
        self.prompt_tokens.labels(self.model, lane).inc(out.prompt_tokens)
        self.generation_tokens.labels(self.model, lane).inc(generated)
        m = out.metrics
        h = {name: hist.labels(self.model, lane) for name, hist in self.histograms.items()}
        for name, value in (
            ("request_queue_time_seconds", m.queue_time),
            ("time_to_first_token_seconds", m.ttft),
            ("e2e_request_latency_seconds", m.e2e),
        ):
            if value is not None:
                h[name].observe(value)
        if m.ttft is not None:
            self.ttft_sum_s += m.ttft
            self.ttft_count += 1
        observe_many(h["inter_token_latency_seconds"], m.inter_token_latencies())

    def cancelled(self, lane: str) -> None:
        """A job cancelled before it started: it ends with finish reason `cancelled`."""
        self.request_success_total["cancelled"] += 1
        self.success.labels(self.model, lane, "cancelled").inc()

    def failed(self, code: str, lane: str | None) -> None:
        self.request_error_total[code] += 1
        self.errors.labels(self.model, lane or NO_LANE, code).inc()

    def summary(self) -> dict[str, float]:
        """The headline numbers: the Redis hash `<ns>:metrics:<consumer>` and the log line."""
        stats = self.stats()
        out: dict[str, float] = {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage_perc": round(stats.kv_cache_usage, 6),
            "num_preemptions_total": stats.counters.get("preemptions", 0),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
        }
        for reason, n in sorted(self.request_success_total.items()):
            out[f'request_success_total{{finished_reason="{reason}"}}'] = n
        for code, n in sorted(self.request_error_total.items()):
            out[f'request_error_total{{code="{code}"}}'] = n
        return out

    def live(self) -> dict[str, float]:
        """What the registry entry carries on every heartbeat, for fleet views that rate
        it between heartbeats: the batch now, tokens sampled so far (counted as the engine
        samples them, not when requests finish), TTFT's sum and count."""
        stats = self.stats()
        return {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "tokens_generated": stats.counters.get("generation_tokens", 0),
            "ttft_sum_s": round(self.ttft_sum_s, 6),
            "ttft_count": self.ttft_count,
        }

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve the registry at http://addr:port/metrics from a daemon thread; port 0
        serves nothing (metrics stay in the summary)."""
        if port:
            self._server, _ = start_http_server(port, addr, registry=self.registry)

    def close(self) -> None:
        """Stop serving (the worker stops: its port is free again)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
