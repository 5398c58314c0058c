"""The real Gemma 3 270M (Q4_K_M GGUF from the package registry, `--model gemma3-270m`)
against transformers loading the same file, in float32: greedy tokens equal on several
prompts, one longer than its 512-token window, fed in chunks. And the file run as its blocks
on the quantized kernels (`--quantization gguf`) against the same file dequantized."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import GEMMA3_270M, gemma3_270m_path
from tests.teacher_forcing import agreement, engine_logits
from tests.test_parity import PROSE
from tests.test_quantization import README, linears
from tokenq.bench.hf_reference import greedy_config
from tokenq.engine import EngineConfig, LLMEngine, SamplingParams
from tokenq.engine.config import ModelConfig
from tokenq.engine.gguf_loader import read_gguf
from tokenq.engine.linear import QuantLinear
from tokenq.kernels import cpu_quant

pytestmark = pytest.mark.slow
NEW_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "¿Cuántos días tiene una semana?",
    PROSE + " " + PROSE,  # past the window: the local layers drop its beginning
]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=GEMMA3_270M,
            device="cpu",
            dtype="float32",
            max_num_batched_tokens=256,
            num_kv_blocks=128,  # 2,048 tokens: what the prompts need, not 2 GiB
            quantization="none",  # transformers' float32 reading of the file
        )
    )


def _plain_view_reader() -> type:
    """gguf's reader with its file as a plain ndarray view, not a np.memmap: the same bytes
    and parse, but without memmap's Python-level slicing hooks, which take most of its time
    over the 262,144 tokenizer strings."""
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            if isinstance(self.data, np.memmap):
                self.data = self.data.view(np.ndarray)
            return super()._get(offset, dtype, count, override_order)

    return PlainViewReader


def transformers_from_gguf(path: str, config: ModelConfig) -> torch.nn.Module:
    """transformers' own reading of the file, in one pass of its (slow: most of a minute
    here) reader: the config it parses and the tensors it dequantizes, named for a model of
    our config's shape; the two configs must agree."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cached = functools.cache(gguf.get_tensor_name_map)  # a pure function called per module
    originals = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map, gguf.GGUFReader = cached, _plain_view_reader()
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(**config.to_hf_config())
            )
        read = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = originals
    theirs = AutoConfig.for_model(**read["config"])
    for key in ("num_hidden_layers", "head_dim", "sliding_window", "layer_types"):
        assert getattr(theirs, key) == config.to_hf_config()[key], key
    assert theirs.rope_parameters["sliding_attention"]["rope_theta"] == config.local_rope_theta
    assert theirs.query_pre_attn_scalar == config.query_pre_attn_scalar
    with no_init_weights():  # every parameter is loaded below (asserted): no random init
        model = AutoModelForCausalLM.from_config(theirs, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(read["tensors"], strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embeddings
    model.tie_weights()
    return model.eval()


def test_gemma3_270m_is_what_transformers_makes_of_its_gguf(engine: LLMEngine) -> None:
    config = engine.model_config
    assert (config.model_type, config.num_layers, config.sliding_window) == ("gemma3_text", 18, 512)
    assert [config.layer_window(i) for i in range(6)] == [512] * 5 + [0]
    reqs = [engine.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    assert reqs[0][0] == engine.tokenizer.bos_token_id and len(reqs[-1]) > 512
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
    for i, ids in enumerate(reqs):
        engine.add_request(f"p{i}", prompt_token_ids=ids, params=params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
    model = transformers_from_gguf(str(gemma3_270m_path()), config)
    for i, ids in enumerate(reqs):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), generation_config=greedy_config(NEW_TOKENS))
        assert got[f"p{i}"] == ref[0, len(ids) :].tolist(), PROMPTS[i][:40]


@pytest.mark.skipif(not cpu_quant.available(), reason="no AVX2 C kernels here")
def test_gemma3_270m_runs_its_k_quant_blocks_and_agrees_with_its_fp32(engine: LLMEngine) -> None:
    """Every matrix (Q4_K, Q6_K, and Q5_0/Q8_0 where a row of 640 is no whole super-block;
    Q/K/V of two formats in one layer) kept as the file's blocks, held in the file's bytes,
    and 32 teacher-forced positions of the README within the issue's bars against the
    dequantized float32 run (measured over 128: top-1 1.000, KL 1.8e-7)."""
    quantized = LLMEngine(
        EngineConfig(
            model=GEMMA3_270M,
            device="cpu",
            dtype="float32",
            num_kv_blocks=16,
            quantization="gguf",
        )
    )
    assert all(isinstance(lin, QuantLinear) for lin in linears(quantized))
    parts = [part.name for lin in linears(quantized) for part in lin.parts]  # type: ignore[union-attr]
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= set(parts)
    model = quantized.model_runner.model
    held = model.embed.nbytes + sum(
        lin.nbytes for lin in linears(quantized) if lin is not model.lm_head
    )
    file = read_gguf(gemma3_270m_path())
    assert held == sum(t.data.nbytes for t in file.tensors if len(t.shape) == 2)
    ids = quantized.tokenizer.encode(README.read_text())[:32]
    chunks = [16, 8] + [1] * 8
    result = agreement(
        engine_logits(engine, [ids], chunks), engine_logits(quantized, [ids], chunks)
    )
    print("gemma3 quantized vs fp32:", result)
    assert result.top1 >= 0.98 and result.mean_kl <= 0.01
