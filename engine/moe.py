"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts,
and each expert runs once per step on the tokens routed to it.

Tokens are grouped by expert with one sort, so a step costs one pair of matrix products per
expert that has tokens, whatever the batch holds, never one per token. Experts add their
weighted outputs in expert order, as transformers does, so float32 results match it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenq.engine.linear import Linear


class MoE:
    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        *,
        top_k: int,
        normalize: bool,
        round_weights: bool,
        act_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        """``router`` ``[experts, hidden]``; ``gate_up`` ``[experts, 2 * inter, hidden]`` (gate
        rows first); ``down`` ``[experts, hidden, inter]``. ``normalize``: the top-k weights
        are scaled to sum to one; ``round_weights``: they are rounded to the model's dtype
        before they scale an expert's output (Qwen3-MoE), else applied in float32
        (Mixtral)."""
        self.router = Linear(router)
        self.gate_up = [Linear(w.contiguous()) for w in gate_up]
        self.down = [Linear(w.contiguous()) for w in down]
        self.num_experts = router.shape[0]
        self.inter = down.shape[2]
        self.top_k = top_k
        self.normalize = normalize
        self.round_weights = round_weights
        self.act_mul = act_mul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype)
        # (token, slot) pairs grouped by expert: one sort, one count, on the host once
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            act = torch.empty(count, self.inter, dtype=x.dtype, device=x.device)
            h = self.down[e](self.act_mul(self.gate_up[e](x[tokens]), act))
            out.index_add_(0, tokens, (h * weights[pairs, None]).to(x.dtype))
        return out
