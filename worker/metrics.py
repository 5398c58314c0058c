"""Per-worker metrics under vLLM's names, flattened for a Redis hash.

Histograms keep Prometheus-style cumulative buckets plus count and sum, so the hashes of
several workers can be summed into fleet-wide figures without raw samples.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenq.engine.outputs import EngineStats, RequestDelta

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0,
)  # fmt: skip


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break

    def fields(self, name: str) -> dict[str, float]:
        out: dict[str, float] = {f"{name}_count": self.count, f"{name}_sum": round(self.sum, 6)}
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out[f'{name}_bucket{{le="{bound}"}}'] = running
        out[f'{name}_bucket{{le="+Inf"}}'] = self.count
        return out


@dataclass
class WorkerMetrics:
    time_to_first_token_seconds: Histogram = field(default_factory=Histogram)
    inter_token_latency_seconds: Histogram = field(default_factory=Histogram)
    e2e_request_latency_seconds: Histogram = field(default_factory=Histogram)
    request_queue_time_seconds: Histogram = field(default_factory=Histogram)
    generation_tokens_total: int = 0
    prompt_tokens_total: int = 0
    request_success_total: Counter[str] = field(default_factory=Counter)  # by finish reason
    request_error_total: Counter[str] = field(default_factory=Counter)  # by error code

    def finished(self, out: RequestDelta, skipped_tokens: int = 0) -> None:
        """Account one finished request; `skipped_tokens` were generated (and counted) by
        an earlier run of the same job."""
        m = out.metrics
        self.request_success_total[out.finish_reason or "unknown"] += 1
        self.prompt_tokens_total += out.prompt_tokens
        self.generation_tokens_total += max(0, out.completion_tokens - skipped_tokens)
        if m.queue_time is not None:
            self.request_queue_time_seconds.observe(m.queue_time)
        if m.ttft is not None:
            self.time_to_first_token_seconds.observe(m.ttft)
        if m.e2e is not None:
            self.e2e_request_latency_seconds.observe(m.e2e)
        for gap in m.inter_token_latencies():
            self.inter_token_latency_seconds.observe(gap)

    def failed(self, code: str) -> None:
        self.request_error_total[code] += 1

    def snapshot(self, stats: EngineStats) -> dict[str, float]:
        """The flat name -> number map written to ``<ns>:metrics:<consumer>``."""
        out: dict[str, float] = {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage_perc": round(stats.kv_cache_usage, 6),
            "generation_tokens_total": self.generation_tokens_total,
            "prompt_tokens_total": self.prompt_tokens_total,
        }
        for reason, n in sorted(self.request_success_total.items()):
            out[f'request_success_total{{finished_reason="{reason}"}}'] = n
        for code, n in sorted(self.request_error_total.items()):
            out[f'request_error_total{{code="{code}"}}'] = n
        for name in (
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
        ):
            out.update(getattr(self, name).fields(name))
        return out

    def summary(self, stats: EngineStats) -> dict[str, float]:
        """The headline numbers for the periodic log line (no buckets)."""
        return {k: v for k, v in self.snapshot(stats).items() if "_bucket" not in k}
