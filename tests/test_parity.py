"""The default model against Hugging Face transformers on the same dequantized weights."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DEFAULT_MODEL
from tokenq.engine import EngineConfig, LLMEngine, SamplingParams
from tokenq.engine.attention import AttentionMetadata
from tokenq.engine.hf_reference import build_hf_model
from tokenq.engine.loader import load_checkpoint, resolve_model

pytestmark = pytest.mark.slow

CONVERSATIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a Python function that reverses a string.",
    "¿Cuántos días tiene una semana? Responde con un número.",
]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=DEFAULT_MODEL, device="cpu", dtype="float32", num_kv_blocks=512)
    )


@pytest.fixture(scope="module")
def hf_model(engine: LLMEngine) -> torch.nn.Module:
    checkpoint = load_checkpoint(resolve_model(DEFAULT_MODEL), torch.float32)
    return build_hf_model(checkpoint.config, checkpoint.weights)


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def test_greedy_tokens_equal_transformers_generate(engine: LLMEngine, hf_model) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [chat_ids(engine, c) for c in CONVERSATIONS]
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", prompt_token_ids=p, params=params)
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False
            )
        assert got[f"p{i}"] == ref[0, len(p) :].tolist(), CONVERSATIONS[i]


def test_first_step_logits_within_1e3_relative(engine: LLMEngine, hf_model) -> None:
    for text in CONVERSATIONS[:3]:
        ids = chat_ids(engine, text)
        n = len(ids)
        bs = engine.block_manager.block_size
        nblk = -(-n // bs)
        blocks = list(range(nblk))
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            block_tables=torch.tensor([blocks], dtype=torch.int32),
            slot_mapping=torch.arange(n, dtype=torch.int64),
            max_query_len=n,
            max_seq_len=n,
        )
        with torch.inference_mode():
            ours = engine.model_runner.model.forward(
                torch.tensor(ids),
                torch.arange(n),
                meta,
                engine.model_runner.kv_cache,
                torch.tensor([n - 1]),
            )[0]
            ref = hf_model(torch.tensor([ids])).logits[0, -1]
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-3, f"relative error {rel:.2e} for {text!r}"
