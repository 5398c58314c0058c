"""Shared test set-up. Redis fixtures give a real server (see tests/redis_fixtures.py)."""

from __future__ import annotations

import os

import torch

# Without CUDA, Triton kernels run in the interpreter, which must be chosen before any
# kernel module is imported (triton.jit reads it when decorating).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
