"""The offline API as vLLM users write it: prompt forms in, vLLM's RequestOutput shape out."""

from __future__ import annotations

import pytest

from tests.helpers import make_tiny_llama_dir
from tokenq.engine import (
    LLM,
    CompletionOutput,
    InvalidRequest,
    RequestOutput,
    SamplingParams,
)

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llm"))
    return LLM(str(model), device="cpu", dtype="float32", num_kv_blocks=256)


def test_generate_takes_every_vllm_prompt_form(llm: LLM) -> None:
    text = "The capital of France is"
    ids = llm.engine.encode_prompt(prompt=text)
    outs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], GREEDY)
    assert len({o.request_id for o in outs}) == 3
    assert [o.prompt for o in outs] == [text, text, None]
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished and out.error is None
        assert out.prompt_token_ids == ids
        (completion,) = out.outputs
        assert isinstance(completion, CompletionOutput) and completion.index == 0
        assert completion.finish_reason == "length" and len(completion.token_ids) == 6
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
        assert completion.logprobs is None
    # The same prompt in any form is the same request: greedy gives the same tokens.
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_a_single_prompt_of_any_form_gives_a_list_of_one(llm: LLM) -> None:
    ids = llm.engine.encode_prompt(prompt="Hello")
    for prompt in ("Hello", {"prompt": "Hello"}, {"prompt_token_ids": ids}):
        (out,) = llm.generate(prompt, GREEDY)
        assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) == 6


def test_results_keep_prompt_order_with_per_prompt_params(llm: LLM) -> None:
    prompts = ["one", "two two", "three three three"]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in (5, 1, 3)]
    outs = llm.generate(prompts, params, priority=[2, 1, 0])
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 3]
    with pytest.raises(ValueError, match="sampling_params: 2 values for 3 prompts"):
        llm.generate(prompts, params[:2])


def test_logprobs_cover_every_generated_token(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=7, logprobs=2)
    (out,) = llm.generate("Count: one, two,", params)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 7
    for token, top in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in top


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2, 3],  # bare token ids: vLLM wants {"prompt_token_ids": [...]}
        {"prompt": "hi", "prompt_token_ids": [1]},
        {"text": "hi"},
        {"prompt_token_ids": []},
    ],
)
def test_other_prompt_forms_are_refused_and_nothing_runs(llm: LLM, bad) -> None:
    with pytest.raises(InvalidRequest) as err:
        llm.generate(["fine", bad], GREEDY)
    assert err.value.code in ("invalid_input", "empty_prompt")
    assert not llm.engine.has_unfinished()  # "fine" was not left queued


def test_chat_takes_a_conversation_or_a_list_of_them(llm: LLM) -> None:
    chat = [{"role": "user", "content": "Hi there"}]
    (one,) = llm.chat(chat, GREEDY)
    two = llm.chat([chat, chat + [{"role": "assistant", "content": "Hello"}]], GREEDY)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one.outputs[0].token_ids
    assert one.prompt == llm.tokenizer.apply_chat_template(chat)
    assert one.prompt_token_ids == llm.engine.encode_prompt(messages=chat)
    assert one.outputs[0].text == llm.tokenizer.decode(one.outputs[0].token_ids)
