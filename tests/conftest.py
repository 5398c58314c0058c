"""Shared test set-up. Redis fixtures give a real server (see tests/redis_fixtures.py)."""

from __future__ import annotations

import os

import torch

# Without CUDA, Triton kernels run in the interpreter, which must be chosen before any
# kernel module is imported (triton.jit reads it when decorating).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A real Redis server for the queue tests: TOKENQ_TEST_REDIS_URL, else 127.0.0.1:6379 if it
# answers, else a redis-server started for the session.
from tests.redis_fixtures import redis_conn, redis_namespace, redis_url  # noqa: E402, F401
