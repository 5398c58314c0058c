"""`tokenq bench <target>`: each target's module, imported only when it runs."""

from __future__ import annotations

import importlib

TARGETS = {
    "engine": "the engine against transformers (and vLLM with --vllm) on W1 and W2",
    "queue": "W1 through Redis against the engine alone",
    "gateway": "the OpenAI SDK through `tokenq serve` against tokenq's Client",
    "batch": "`tokenq batch run` against the engine alone",
    "fleet": "interactive jobs under a batch backlog, on one worker",
    "kernels": "the kernels against copy bandwidth (GPU) or the torch ops they replace (CPU)",
    "quant": "quantized weights on the quantized kernels against fp32 and bf16: kernels, W1/W2, "
    "teacher-forced accuracy",
    "invariance": "greedy output batched against each prompt alone, per dtype",
    "structured": "W1 with every request JSON-Schema constrained against it unconstrained",
    "webhooks": "the webhook dispatcher against plain HTTP posts, and its added latency",
    "cluster": "one shard's cost on a local Redis Cluster (sizing); a primary killed (failover)",
    "samples": "one job of n outputs against n separate jobs of the same prompt",
}


def main(target: str, argv: list[str]) -> int:
    return importlib.import_module(f"tokenq.bench.{target}").main(argv) or 0
