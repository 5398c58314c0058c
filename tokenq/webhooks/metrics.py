"""The dispatcher's Prometheus metrics: attempts by outcome, their time, and the time
from an event's making (a job's end) to its delivery."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)


class DispatcherMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.deliveries = Counter(
            "tokenq_webhook_deliveries",
            "Delivery attempts by outcome: delivered, failed (retried), gone (410: endpoint "
            "disabled), refused (address or redirect), expired (retry time spent)",
            ["outcome"],
            registry=r,
        )
        self.attempt_seconds = Histogram(
            "tokenq_webhook_attempt_seconds",
            "Time of one HTTP attempt",
            buckets=BUCKETS,
            registry=r,
        )
        self.lag_seconds = Histogram(
            "tokenq_webhook_delivery_lag_seconds",
            "From the event's making (a job's end) to its delivery",
            buckets=BUCKETS,
            registry=r,
        )
        self.held = Gauge("tokenq_webhook_events_held", "Events this dispatcher holds", registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr, registry=self.registry)
