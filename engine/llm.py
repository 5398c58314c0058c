"""Offline use, in the spirit of vLLM's ``LLM``: give prompts, get finished generations."""

from __future__ import annotations

from typing import Any

from tokenq.engine.config import EngineConfig
from tokenq.engine.downloads import DEFAULT_MODEL
from tokenq.engine.llm_engine import LLMEngine
from tokenq.engine.outputs import RequestDelta
from tokenq.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priorities: list[int] | None = None,
    ) -> list[RequestDelta]:
        """Run every prompt (text, or token ids) to completion, batched; results in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return self._run(
            [{"prompt" if isinstance(p, str) else "prompt_token_ids": p} for p in prompts],
            sampling_params,
            priorities,
        )

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestDelta]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        return self._run([{"messages": c} for c in conversations], sampling_params, None)

    def _run(
        self,
        inputs: list[dict[str, Any]],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        priorities: list[int] | None,
    ) -> list[RequestDelta]:
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(inputs)
        base = self.engine.counters["requests_added"]
        ids = [f"offline-{base + i}" for i in range(len(inputs))]
        for i, (rid, inp) in enumerate(zip(ids, inputs, strict=True)):
            prio = priorities[i] if priorities else 0
            self.engine.add_request(rid, **inp, params=sampling_params[i], priority=prio)
        done: dict[str, RequestDelta] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
