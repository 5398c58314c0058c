"""The default model against Hugging Face transformers on the same dequantized weights:
float32 exactly, bfloat16 by teacher-forced agreement."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DEFAULT_MODEL
from tests.teacher_forcing import agreement, engine_logits, hf_logits
from tokenq.bench.hf_reference import build_hf_model
from tokenq.engine import EngineConfig, LLMEngine, SamplingParams
from tokenq.engine.attention import AttentionMetadata
from tokenq.engine.checkpoint import Checkpoint
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
        EngineConfig(
            model=DEFAULT_MODEL,
            device="cpu",
            dtype="float32",
            num_kv_blocks=512,
            quantization="none",
        )
    )


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    """The dequantized weights, read once for every transformers model built here."""
    return load_checkpoint(resolve_model(DEFAULT_MODEL), torch.float32)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Checkpoint) -> torch.nn.Module:
    return build_hf_model(checkpoint.config, checkpoint.weights)


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def test_greedy_tokens_equal_transformers_generate(engine: LLMEngine, hf_model) -> None:
    """32 greedy tokens per prompt, batched and decoded step by step, are the tokens
    transformers' greedy generate() makes: at each position of our continuation its top
    token, given the same prefix, is ours, which by induction is generate()'s sequence.
    One forward per prompt checks that, not generate()'s 32 sequential steps."""
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
        ours = got[f"p{i}"]
        assert len(ours) == 32
        with torch.inference_mode():
            logits = hf_model(torch.tensor([p + ours[:-1]])).logits[0, len(p) - 1 :]
        assert logits.argmax(-1).tolist() == ours, CONVERSATIONS[i]


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


# Plain prose for the teacher-forced comparison: a real model on real text has peaked and
# flat positions alike, unlike random tokens (flat everywhere).
PROSE = (
    "A message queue decouples the programs that produce work from the programs that do it. "
    "Producers append jobs to a stream and return at once; workers read the stream at their "
    "own pace, acknowledge each job when its result is safely written, and leave the rest "
    "for another worker if they die. The queue therefore absorbs bursts: when a thousand "
    "requests arrive in the same second, they wait in order instead of overwhelming the "
    "servers. It also makes failure visible, because a job that no worker acknowledges "
    "stays pending and can be claimed again after a timeout. Inference services benefit "
    "from the same design. A language model runs fastest when it batches many requests "
    "together, so a worker that pulls as many jobs as its memory allows, and streams each "
    "token back on a reply channel as soon as it is produced, keeps the hardware busy "
    "without making any single user wait for the slowest request in the batch. The rivers "
    "of northern Europe freeze in winter, and the boats that carry timber to the coast "
    "stop until the ice breaks in spring. Farmers plant barley and rye, which tolerate the "
    "short summers, and the long evenings of June are spent outdoors. In the cities, old "
    "wooden houses stand beside glass towers, and the trams run through the night during "
    "the festival of midsummer, when the sun barely sets at all. Bread is baked with "
    "caraway and eaten with smoked fish, butter and cheese. Children learn to swim in "
    "lakes that stay cold all year, and every family seems to own a small cabin in the "
    "forest, with a sauna, a rowing boat and no electricity. When autumn comes, people "
    "pick mushrooms and berries, and the first snow falls before the end of October."
)


@pytest.fixture(scope="module")
def bf16_engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=DEFAULT_MODEL,
            device="cpu",
            dtype="bfloat16",
            num_kv_blocks=64,
            quantization="none",
        )
    )


def test_bf16_teacher_forced_agreement_with_transformers_bf16(
    bf16_engine: LLMEngine, hf_model: torch.nn.Module, checkpoint: Checkpoint
) -> None:
    """Two 160-token windows of prose (320 positions), fed as a 64-token prefill chunk, a
    32-token chunk, a 5-token chunk and 59 single-token decodes, against transformers in
    bf16 (and in fp32) on the same weights.

    Thresholds, with margin over what was measured here: top-1 agreement with transformers'
    bf16 >= 0.93 (exact tokens are not expected: both sides round to bf16 in different
    places, so positions whose best two logits lie within bf16's resolution may flip);
    |log p| of transformers' top token within 0.1 on average; mean KL <= 1e-2 nats. And
    against the float32 model our bf16 is no further off than transformers' own bf16 (KL
    within 1.5x, top-1 within 3 points): what bf16 costs, and no more. Measured on the
    AVX2 machine: top-1 0.994, |dlog p| mean 0.035, KL 1.8e-3 against transformers' bf16;
    against fp32, ours KL 1.29e-3 and top-1 0.956, transformers' bf16 1.37e-3 and 0.956.
    """
    ids = bf16_engine.tokenizer.encode(PROSE, add_special_tokens=False)
    assert len(ids) >= 320, len(ids)
    seqs = [ids[:160], ids[160:320]]
    ours = engine_logits(bf16_engine, seqs, [64, 32, 5] + [1] * 59)
    hf16 = hf_logits(build_hf_model(checkpoint.config, checkpoint.weights, torch.bfloat16), seqs)
    hf32 = hf_logits(hf_model, seqs)
    vs_hf16 = agreement(hf16, ours)
    ours_err, theirs_err = agreement(hf32, ours), agreement(hf32, hf16)
    print(f"ours vs transformers bf16: {vs_hf16}\nagainst fp32: ours {ours_err}")
    print(f"against fp32: transformers bf16 {theirs_err}")
    assert vs_hf16.positions == 320
    assert vs_hf16.top1 >= 0.93
    assert vs_hf16.mean_abs_logprob <= 0.1
    assert vs_hf16.mean_kl <= 1e-2
    assert ours_err.mean_kl <= 1.5 * theirs_err.mean_kl
    assert ours_err.top1 >= theirs_err.top1 - 0.03
