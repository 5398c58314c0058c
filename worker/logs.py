"""structlog setup: context first (the job id bound per job), JSON lines in production.
The engine logs through the standard library (it knows no structlog): its `tokenq.*`
records (the dtype chosen and why, a dequantized file) come out in the same format."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import structlog


def configure_logging(json: bool = True, level: str = "info") -> None:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
        )
    )
    own = logging.getLogger("tokenq")
    own.handlers[:] = [handler]
    own.setLevel(level.upper())
    own.propagate = False


@dataclass
class LogSettings:
    """How a worker's processes log (`tokenq worker --log-format/--log-level`)."""

    json: bool = True
    level: str = "info"


def job_log(log: Any, job_id: str | None) -> Any:
    """`log` with the job id bound, when there is one."""
    return log.bind(job_id=job_id) if job_id else log
