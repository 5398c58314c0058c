"""The client side of tokenq: submit jobs, read replies. Needs redis and msgpack, no torch."""

from tokenq.producer.client import (
    AsyncClient,
    AsyncJob,
    Client,
    ClientConfig,
    Job,
    ModelInfo,
    make_request,
)
from tokenq.producer.errors import (
    ClientClosed,
    JobFailed,
    NotReplicated,
    QueueFull,
    RedisUnavailable,
    UnknownModel,
)
from tokenq.protocol import (
    DoneEvent,
    ErrorEvent,
    Event,
    InvalidRequest,
    JobRequest,
    RestartEvent,
    TokenEvent,
)

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
    "NotReplicated",
    "QueueFull",
    "RedisUnavailable",
    "RestartEvent",
    "TokenEvent",
    "UnknownModel",
    "make_request",
]
