"""tokenq: LLM inference as a message-queue worker service.

The client side imports with nothing heavier than redis and msgpack::

    from tokenq import Client, AsyncClient, QueueFull, JobFailed

The rooms (docs/design.md): ``tokenq.producer`` (the client library), ``tokenq.protocol``
(the contract every room shares), ``tokenq.server`` (the HTTP gateway), ``tokenq.batch``,
``tokenq.ops`` and ``tokenq.celery`` (tools), ``tokenq.cli`` (the command),
``tokenq.worker`` (the Redis loop), ``tokenq.engine`` (the inference engine, torch) and
``tokenq.kernels`` (its Triton and C kernels). The names below are loaded on first use, so
importing a room (the contract, say) loads only that room.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "Client",
    "ClientClosed",
    "ClientConfig",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "InvalidRequest",
    "Job",
    "JobFailed",
    "JobRequest",
    "ModelInfo",
    "QueueFull",
    "RedisUnavailable",
    "RestartEvent",
    "TokenEvent",
    "UnknownModel",
    "make_request",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'tokenq' has no attribute {name!r}")
    return getattr(importlib.import_module("tokenq.producer"), name)
