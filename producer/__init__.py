"""The client side of tokenq: submit jobs, read replies. Needs redis and msgpack, no torch."""

from tokenq.producer.client import AsyncClient, AsyncJob, Client, ClientConfig, Job, make_request
from tokenq.producer.errors import ClientClosed, JobFailed, QueueFull, RedisUnavailable
from tokenq.producer.protocol import (
    DoneEvent,
    ErrorEvent,
    Event,
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
    "Job",
    "JobFailed",
    "JobRequest",
    "QueueFull",
    "RedisUnavailable",
    "RestartEvent",
    "TokenEvent",
    "make_request",
]
