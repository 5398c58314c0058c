"""tokenq: LLM inference as a message-queue worker service.

The client side imports with nothing heavier than redis and msgpack::

    from tokenq import Client, AsyncClient, QueueFull, JobFailed

The parts are subpackages: ``tokenq.producer`` (wire protocol, clients, the command),
``tokenq.worker`` (the Redis loop), ``tokenq.engine`` (the inference engine, torch) and
``tokenq.kernels`` (its Triton and C kernels). Only ``tokenq.engine`` and below need torch.
"""

from tokenq.producer import (
    AsyncClient,
    AsyncJob,
    Client,
    ClientClosed,
    ClientConfig,
    DoneEvent,
    ErrorEvent,
    Event,
    Job,
    JobFailed,
    JobRequest,
    ModelInfo,
    QueueFull,
    RedisUnavailable,
    RestartEvent,
    TokenEvent,
    UnknownModel,
    make_request,
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
    "ModelInfo",
    "QueueFull",
    "RedisUnavailable",
    "RestartEvent",
    "TokenEvent",
    "UnknownModel",
    "make_request",
]
