"""Offline use as vLLM users write it: ``LLM(model).generate(prompts, params)`` runs every
prompt to completion, batched, and returns vLLM's ``RequestOutput`` per prompt, in order
(``out.outputs[0].text``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from tokenq.engine.config import EngineConfig
from tokenq.engine.downloads import DEFAULT_MODEL
from tokenq.engine.llm_engine import LLMEngine
from tokenq.engine.outputs import CompletionOutput, RequestDelta, RequestOutput
from tokenq.protocol.errors import InvalidRequest, clip
from tokenq.protocol.params import SamplingParams


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


# vLLM's prompt forms: text, or a dict holding the text or the token ids.
PromptType = str | TextPrompt | TokensPrompt
Message = dict[str, Any]  # {"role": ..., "content": ...}

_PROMPT_FORMS = "a string, {'prompt': str} or {'prompt_token_ids': list[int]}"


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **config: Any) -> None:
        """``config``: any ``EngineConfig`` field (``device``, ``max_num_seqs``, ...)."""
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them; one ``SamplingParams`` for all, or one
        per prompt. ``priority``: one per prompt, lower runs first."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        return self._run([_prompt_inputs(p) for p in prompts], sampling_params, priority)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of ``{"role", "content"}``
        messages) or to each of a list of them, through the model's chat template."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # type: ignore[list-item]
        return self._run([{"messages": m} for m in messages], sampling_params, priority)

    def _run(
        self,
        inputs: list[dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[RequestOutput]:
        params = _per_prompt(sampling_params or SamplingParams(), len(inputs), "sampling_params")
        priorities = _per_prompt(priority or 0, len(inputs), "priority")
        base = self.engine.counters["requests_added"]
        ids = [f"offline-{base + i}" for i in range(len(inputs))]
        added: list[str] = []
        try:
            for rid, inp, p, prio in zip(ids, inputs, params, priorities, strict=True):
                self.engine.add_request(rid, **inp, params=p, priority=prio)
                added.append(rid)
        except Exception:
            for rid in added:  # all prompts run, or none
                self.engine.abort(rid)
            raise
        results = {
            rid: _Result(self._prompt_text(inp), self.engine.requests[rid].prompt_token_ids)
            for rid, inp in zip(ids, inputs, strict=True)
        }
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                if delta.request_id in results:
                    results[delta.request_id].add(delta)
        return [results[rid].output() for rid in ids]

    def _prompt_text(self, inputs: dict[str, Any]) -> str | None:
        """The prompt as text, as vLLM reports it: the text given, or the rendered chat
        template; None for token ids."""
        if "messages" in inputs:
            return self.tokenizer.apply_chat_template(inputs["messages"])
        return inputs.get("prompt")


class _Result:
    """A request's deltas gathered into its ``RequestOutput``."""

    def __init__(self, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.logprobs: dict[int, list[dict[int, float]]] = {}  # by output index
        self.last: RequestDelta | None = None

    def add(self, delta: RequestDelta) -> None:
        self.logprobs.setdefault(delta.index, []).extend(delta.logprobs or [])
        if delta.finished:
            self.last = delta

    def output(self) -> RequestOutput:
        last = self.last
        if last is None:
            raise RuntimeError("the engine stopped before the request finished")
        completions = [
            CompletionOutput(
                index=out.index,
                text=out.text or "",
                token_ids=list(out.token_ids or []),
                finish_reason=out.finish_reason,
                logprobs=self.logprobs.get(out.index, []) if out.logprobs is not None else None,
            )
            for out in last.outputs or [last]
        ]
        return RequestOutput(
            request_id=last.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=True,
            metrics=last.metrics,
            error=last.error,
            prompt_logprobs=last.prompt_logprobs,
        )


def _prompt_inputs(prompt: Any) -> dict[str, Any]:
    """One prompt as ``add_request`` keywords: ``prompt`` or ``prompt_token_ids``."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, dict) and len(prompt) == 1:
        key = next(iter(prompt))
        if key in ("prompt", "prompt_token_ids"):
            return {key: prompt[key]}
    got = f"a dict with keys {sorted(map(str, prompt))}" if isinstance(prompt, dict) else None
    got = clip(got or type(prompt).__name__)
    raise InvalidRequest("invalid_input", f"a prompt is {_PROMPT_FORMS}, got {got}")


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    """One value for every prompt, or a list of exactly one per prompt."""
    if not isinstance(value, Sequence):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name}: {len(value)} values for {n} prompts")
    return list(value)
