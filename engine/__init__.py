"""The inference engine: model, paged KV pool, scheduler, sampler. No Redis in here.

Names are imported on first use, so ``python -m tokenq.engine.downloads`` (run before
anything heavy is needed) does not load the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "tokenq.engine.llm",
    "EngineConfig": "tokenq.engine.config",
    "ModelConfig": "tokenq.engine.config",
    "DEFAULT_MODEL": "tokenq.engine.downloads",
    "CompletionOutput": "tokenq.engine.outputs",
    "EngineStats": "tokenq.engine.outputs",
    "RequestDelta": "tokenq.engine.outputs",
    "RequestOutput": "tokenq.engine.outputs",
    "TextPrompt": "tokenq.engine.llm",
    "TokensPrompt": "tokenq.engine.llm",
    "InvalidRequest": "tokenq.protocol.errors",
    "InvalidTransition": "tokenq.engine.errors",
    "StepFailed": "tokenq.engine.errors",
    "LLMEngine": "tokenq.engine.llm_engine",
    "RequestState": "tokenq.engine.sequence",
    "SamplingParams": "tokenq.protocol.params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
