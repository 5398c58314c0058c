"""Every supported family against transformers: tiny random checkpoints that transformers
itself writes (tests/helpers.py's TINY_FAMILIES), greedy tokens equal in float32 for prompts
longer than the sliding window, through chunked prefill and recompute preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_FAMILIES, make_tiny_hf_dir
from tests.teacher_forcing import engine_logits, hf_logits
from tokenq.bench.hf_reference import build_hf_model, greedy_config
from tokenq.engine import EngineConfig, LLMEngine, SamplingParams
from tokenq.engine.config import ModelConfig
from tokenq.engine.loader import load_checkpoint

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
SHORT = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_tiny_hf_dir(root / family, family) for family in TINY_FAMILIES}


def prompts(lengths: tuple[int, ...] = (41, 23, 34)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(200, 40000, (n,), generator=g).tolist() for n in lengths]


def transformers_greedy(folder: Path, reqs: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in reqs:
            ids = model.generate(torch.tensor([p]), generation_config=greedy_config(NEW_TOKENS))
            out.append(ids[0, len(p) :].tolist())
    return out


def engine_greedy(
    folder: Path, reqs: list[list[int]], params: SamplingParams = GREEDY, **kw
) -> tuple[list[list[int]], LLMEngine]:
    """Every request to its end in one engine; all blocks back in the pool after."""
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", **kw))
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [done[f"r{i}"] for i in range(len(reqs))], engine


# A pool of 10 blocks of 8 tokens holds one request (41 + 16 tokens) but not three, and a
# budget of 12 tokens a step cuts every prompt into chunks. Mixtral holds only its window
# (8 keys) and a chunk, about 4 blocks a request: 6 blocks do not hold three.
TIGHT = {"num_kv_blocks": 10, "block_size": 8, "max_num_batched_tokens": 12}
TIGHTER = {"mixtral": {**TIGHT, "num_kv_blocks": 6}}


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_greedy_equals_transformers_through_chunks_and_preemption(
    family_dirs: dict[str, Path], family: str
) -> None:
    folder = family_dirs[family]
    reqs = prompts()
    got, engine = engine_greedy(folder, reqs, **TIGHTER.get(family, TIGHT))
    assert engine.counters["preemptions"] > 0
    assert got == transformers_greedy(folder, reqs)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_logits_at_every_position_equal_transformers(
    family_dirs: dict[str, Path], family: str
) -> None:
    """Teacher-forced: two 40-token sequences fed as a 20-token chunk, a 7-token chunk and
    13 decodes, every position's logits within 1e-4 of transformers' (relative to the
    largest): what greedy tokens could miss (a rotary base, a window off by one) shows here.
    And what the loader makes of the folder (config, experts stacked) rebuilds the saved
    model exactly: the reference the benchmarks build from a checkpoint."""
    from transformers import AutoModelForCausalLM

    folder = family_dirs[family]
    seqs = prompts((40, 40))
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32"))
    ours = engine_logits(engine, seqs, [20, 7] + [1] * 13)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = hf_logits(model, seqs)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-4, f"relative error {err:.2e}"
    checkpoint = load_checkpoint(folder)
    assert checkpoint.config.model_type == family
    rebuilt = build_hf_model(checkpoint.config, checkpoint.weights)
    assert torch.equal(hf_logits(rebuilt, seqs), ref)


def test_torch_attention_gives_the_c_kernels_tokens(family_dirs: dict[str, Path]) -> None:
    """Sliding windows, and blocks freed behind them, in the torch backend (Mixtral)."""
    reqs = prompts()
    kw = TIGHTER["mixtral"]
    c_tokens, _ = engine_greedy(family_dirs["mixtral"], reqs, **kw)
    torch_tokens, _ = engine_greedy(family_dirs["mixtral"], reqs, attention_backend="torch", **kw)
    assert torch_tokens == c_tokens


def test_triton_attention_gives_the_c_kernels_tokens(family_dirs: dict[str, Path]) -> None:
    """Gemma 3's windows through the Triton kernels (the interpreter on a CPU): short."""
    reqs = prompts((13, 20))
    kw = {"max_num_batched_tokens": 12, "params": SHORT}
    c_tokens, _ = engine_greedy(family_dirs["gemma3_text"], reqs, **kw)
    triton_tokens, _ = engine_greedy(
        family_dirs["gemma3_text"], reqs, attention_backend="triton", **kw
    )
    assert triton_tokens == c_tokens


def test_a_model_whose_every_layer_slides_holds_only_its_window(
    family_dirs: dict[str, Path],
) -> None:
    """Mixtral slides over 8 keys on every layer: a 100-token prompt's blocks behind the
    window go back to the pool as its chunks are computed, so a pool of 64 tokens serves it,
    with transformers' tokens."""
    engine = LLMEngine(
        EngineConfig(
            model=str(family_dirs["mixtral"]),
            device="cpu",
            dtype="float32",
            num_kv_blocks=8,
            block_size=8,
            max_num_batched_tokens=16,
        )
    )
    reqs = prompts((100,))
    engine.add_request("r", prompt_token_ids=reqs[0], params=GREEDY)
    held, tokens = 0, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens = out.token_ids
        held = max(held, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
    # the window (8 keys), the last full block and a chunk of 16: 5 blocks of 8 at most
    assert held <= 5
    assert [tokens] == transformers_greedy(family_dirs["mixtral"], reqs)


def test_an_unsupported_family_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf_config({"model_type": "gpt2", "vocab_size": 10})
    message = str(info.value)
    assert "\n" not in message and "'gpt2'" in message
    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "mixtral"):
        assert family in message
