"""The inference engine: model, paged KV pool, scheduler, sampler. No Redis in here.

Names are imported on first use, so ``python -m engine.models`` (run before anything
heavy is needed) does not load the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "engine.llm",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "EngineStats": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "InvalidRequest": "engine.errors",
    "InvalidTransition": "engine.errors",
    "StepFailed": "engine.errors",
    "LLMEngine": "engine.llm_engine",
    "RequestState": "engine.sequence",
    "SamplingParams": "engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
