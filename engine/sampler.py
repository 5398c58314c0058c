"""Turns the last-position logits of a step into one token per request.

Each row is processed with its own request's parameters. Randomness comes from a
generator seeded by (request seed, output index), so a seeded request draws the same
tokens whatever else shares its batch, and after a preemption it re-draws nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None


def _apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        vals = logits[seen]
        pen = params.repetition_penalty
        logits[seen] = torch.where(vals > 0, vals / pen, vals * pen)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype)
        logits[ids] -= params.presence_penalty
    return logits


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, then top-p, then min-p, each masking to -inf what it removes."""
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the top one stays.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    banned: list[list[int]],
) -> list[SampleResult]:
    """One token per row of ``logits`` ``[num_seqs, vocab]``.

    ``banned[i]`` are tokens row i may not produce now (EOS and stop ids before
    ``min_tokens``). Rows with nothing to adjust and greedy decoding take a batched argmax.
    """
    logits = logits.float()
    results: list[SampleResult | None] = [None] * len(params)
    plain = [
        i
        for i, p in enumerate(params)
        if p.greedy
        and not banned[i]
        and not p.logit_bias
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    ]
    if plain:
        for i, tok in zip(plain, logits[plain].argmax(-1).tolist(), strict=True):
            results[i] = SampleResult(tok, None)
    for i, p in enumerate(params):
        if results[i] is not None:
            continue
        row = logits[i]
        logprobs = None
        if p.logprobs is not None:
            raw = torch.log_softmax(row, -1)
        row = row.clone()
        for tok, bias in p.logit_bias.items():
            if 0 <= tok < row.numel():
                row[tok] += bias
        row = _apply_penalties(row, p, prompts[i], outputs[i])
        if banned[i]:
            row[torch.tensor(banned[i], dtype=torch.long)] = float("-inf")
        if p.greedy:
            tok = int(row.argmax())
        else:
            probs = _filter(row / p.temperature, p).softmax(-1)
            g = _generator(p.seed, len(outputs[i]))
            tok = int(torch.multinomial(probs, 1, generator=g))
        if p.logprobs is not None:
            top = torch.topk(raw, p.logprobs) if p.logprobs else None
            logprobs = (
                dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else {}
            )
            logprobs[tok] = float(raw[tok])
        results[i] = SampleResult(tok, logprobs)
    return results  # type: ignore[return-value]
