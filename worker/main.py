"""`tokenq worker`: build the engine, connect, serve until SIGTERM/SIGINT.

One process per device, no fork: CUDA does not survive forking, and one engine already
batches everything the device can hold.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from types import FrameType

import redis
import structlog
from tokenq.producer.cli import engine_kwargs
from tokenq.worker.config import WorkerConfig, default_consumer
from tokenq.worker.logs import configure_logging


def served_names(model: str) -> frozenset[str]:
    """What a job's `model` field may say to reach this worker: the alias or path as
    given, and the file or folder name."""
    return frozenset({model, Path(model).name})


def run_worker(args: argparse.Namespace) -> int:
    from tokenq.engine import EngineConfig, LLMEngine
    from tokenq.worker.loop import Worker

    configure_logging(json=args.log_format == "json", level=args.log_level)
    log = structlog.get_logger("tokenq.worker")
    engine_options = engine_kwargs(args)
    log.info("loading model", **engine_options)
    engine = LLMEngine(EngineConfig(**engine_options))
    config = WorkerConfig(
        namespace=args.namespace,
        consumer=args.consumer or default_consumer(),
        model_names=served_names(args.model),
        claim_idle_ms=args.claim_idle_ms,
        heartbeat_interval_s=min(10.0, args.claim_idle_ms / 4000),
        max_deliveries=args.max_deliveries,
        grace_period_s=args.grace_period,
        reply_ttl_s=args.reply_ttl,
        metrics_interval_s=args.metrics_interval,
    )
    conn = redis.Redis.from_url(args.redis_url, socket_connect_timeout=5, socket_keepalive=True)
    worker = Worker(engine, conn, config)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # First signal: drain within the grace period. Second: hand back at once.
        worker.stop(grace=0 if worker.stopping else None)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.run()
    return 0
