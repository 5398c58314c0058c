"""Turns the last-position logits of a step into one token per request.

Each row is processed with its own request's parameters. Randomness comes from a
generator seeded by (request seed, output index), so a seeded request draws the same
tokens whatever else shares its batch, and after a preemption it re-draws nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenq.kernels.reference import argmax_rows_torch
from tokenq.protocol.params import SamplingParams

_NEG_INF = float("-inf")
_MAX_FLOAT = torch.finfo(torch.float32).max


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
        # Drop a token when the mass before it already reaches top_p; the top one always
        # stays (a top_p below float32's smallest number compares as 0 and would drop it).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
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


def _ban_mask(banned: list[int], vocab: int) -> torch.Tensor | None:
    """The tokens a row may not produce now, as a mask; ids the row does not have are
    ignored. None when nothing is banned, and also when the ban would cover every token
    (e.g. the whole vocabulary as ``stop_token_ids`` with ``min_tokens``): then the ban is
    dropped for this row, since a row with nothing left to sample cannot honour it anyway."""
    if not banned:
        return None
    ids = torch.tensor(banned, dtype=torch.long)
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids[(ids >= 0) & (ids < vocab)]] = True
    return None if bool(mask.all()) else mask


def _finite(row: torch.Tensor) -> torch.Tensor:
    """NaN (from inf - inf, 0 * inf) becomes -inf, never a candidate; +inf (overflow of a big
    logit by penalty, bias or a small temperature) becomes the largest float, still the top
    candidate. Afterwards softmax is well defined as long as any entry is above -inf."""
    return torch.nan_to_num(row, nan=_NEG_INF, posinf=_MAX_FLOAT, neginf=_NEG_INF)


def _sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    banned: list[int],
    allowed: torch.Tensor | None = None,
) -> SampleResult:
    """One token from one row, whatever the (valid) parameters: the adjusted logits are made
    finite before anything ranks or samples them, and a row left with no candidate at all
    falls back to the raw logits' best token that the grammar allows and, if any such token
    is not banned, that is not banned. ``allowed`` is the grammar's mask: applied after the
    log-probabilities are taken (they are the model's own), before everything else."""
    p = params
    raw = torch.log_softmax(logits, -1) if p.logprobs is not None else None
    if allowed is not None:
        logits = logits.masked_fill(~allowed, _NEG_INF)
    row = logits.clone()
    if p.logit_bias:  # one indexed add: a bias on every token must not cost a Python loop
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
        inside = ids < row.numel()
        row[ids[inside]] += bias[inside]
    row = _apply_penalties(row, p, prompt, output)
    ban = _ban_mask(banned, row.numel())
    if ban is not None:
        row.masked_fill_(ban, _NEG_INF)
    row = _finite(row)
    if not p.greedy:
        row = _finite(row / p.temperature)
    if bool(torch.isneginf(row).all()):
        fallback = logits.nan_to_num(nan=_NEG_INF)
        if ban is not None:
            unbanned = fallback.masked_fill(ban, _NEG_INF)
            if allowed is None or not bool(torch.isneginf(unbanned).all()):
                fallback = unbanned
        tok = int(fallback.argmax())
    elif p.greedy:
        tok = int(row.argmax())
    else:
        probs = _filter(row, p).softmax(-1)
        g = _generator(p.seed, len(output))
        tok = int(torch.multinomial(probs, 1, generator=g))
    logprobs = None
    if raw is not None:
        top = torch.topk(raw, p.logprobs) if p.logprobs else None
        logprobs = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else {}
        logprobs[tok] = float(raw[tok])
    return SampleResult(tok, logprobs)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    banned: list[list[int]],
    argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_rows_torch,
    allowed: list[torch.Tensor | None] | None = None,
) -> list[SampleResult]:
    """One token per row of ``logits`` ``[num_seqs, vocab]``.

    ``banned[i]`` are tokens row i may not produce now (EOS and stop ids before
    ``min_tokens``); ``allowed[i]``, if not None, the only tokens its grammar admits, for
    every sampling mode. Rows with nothing to adjust and greedy decoding take a batched
    ``argmax`` (each row's first maximum: the C kernel where the engine runs on them); a
    constrained row without logprobs or bans is masked in place first, so it can be one of them.
    """
    logits = logits.float()
    masks = list(allowed) if allowed else [None] * len(params)
    for i, mask in enumerate(masks):
        if mask is not None and params[i].logprobs is None and not banned[i]:
            logits[i].masked_fill_(~mask, _NEG_INF)
            masks[i] = None
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
        rows = logits if len(plain) == len(params) else logits[plain]  # all: no copy
        for i, tok in zip(plain, argmax(rows).tolist(), strict=True):
            results[i] = SampleResult(tok, None)
    for i, p in enumerate(params):
        if results[i] is None:
            results[i] = _sample_row(logits[i], p, prompts[i], outputs[i], banned[i], masks[i])
    return results  # type: ignore[return-value]
