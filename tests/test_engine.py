"""The engine end to end on tiny random Llamas: batching must never change the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.helpers import make_tiny_llama_dir
from tokenq.bench.hf_reference import build_hf_model, greedy_config
from tokenq.engine import EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from tokenq.engine.downloads import build_dir
from tokenq.engine.loader import load_checkpoint
from tokenq.engine.model_runner import _merged
from tokenq.engine.sequence import Sequence
from tokenq.kernels import cpu_ops

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # GQA (4 query heads on 2 KV heads); 3 layers so cross-layer cache mix-ups would show.
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), num_hidden_layers=3)


def make_engine(model: Path, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 16)
    return LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", **kw))


def prompts(n: int, lengths: tuple[int, ...] = (5, 17, 33, 2, 48, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [
        torch.randint(200, 40000, (lengths[i % len(lengths)],), generator=g).tolist()
        for i in range(n)
    ]


def run(engine: LLMEngine, reqs: list[list[int]], params=GREEDY) -> dict[str, list[int]]:
    """Every request's generated ids, checking that streamed deltas add up to the end."""
    streamed: dict[str, list[int]] = {}
    final: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
    while engine.has_unfinished():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            if out.finished:
                final[out.request_id] = out.token_ids
                assert texts[out.request_id] == out.text
    assert streamed == final
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return final


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    checkpoint = load_checkpoint(model_dir, torch.float32)
    hf = build_hf_model(checkpoint.config, checkpoint.weights)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), generation_config=greedy_config(n))
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_matches_transformers_for_unaligned_prompts(tiny_dir: Path, block_size: int):
    engine = make_engine(tiny_dir, block_size=block_size, num_kv_blocks=4096 // block_size)
    reqs = prompts(3)
    got = run(engine, reqs)
    for i, p in enumerate(reqs):
        assert got[f"r{i}"] == hf_greedy(tiny_dir, p, GREEDY.max_tokens)


def test_chunked_prefill_equals_unchunked(tiny_dir: Path):
    reqs = prompts(6)
    whole = run(make_engine(tiny_dir, max_num_batched_tokens=4096), reqs)
    chunked = run(make_engine(tiny_dir, max_num_batched_tokens=7), reqs)
    assert chunked == whole


def test_a_request_alone_equals_it_inside_a_mixed_batch(tiny_dir: Path):
    reqs = prompts(6)
    batch = run(make_engine(tiny_dir, max_num_batched_tokens=40), reqs)
    for i, p in enumerate(reqs):
        alone = run(make_engine(tiny_dir), [p])
        assert alone["r0"] == batch[f"r{i}"]


def test_preemption_round_trip_equals_an_unpreempted_run(tiny_dir: Path):
    reqs = prompts(6)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40)
    roomy = run(make_engine(tiny_dir), reqs, params)
    tight = make_engine(tiny_dir, num_kv_blocks=12, block_size=8)  # 96 tokens: r4 fits alone
    squeezed = run(tight, reqs, params)
    assert tight.counters["preemptions"] > 0
    assert squeezed == roomy


def test_prefix_cache_hit_gives_the_same_tokens(tiny_dir: Path):
    engine = make_engine(tiny_dir)
    shared = prompts(1, (40,))[0]
    first = run(engine, [shared + [300, 301]])
    again = run(engine, [shared + [300, 301]])
    assert engine.block_manager.num_cache_hit_tokens >= 32
    assert again == first


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_dir: Path):
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=42, max_tokens=16, ignore_eos=True)
    reqs = prompts(4)
    alone = run(make_engine(tiny_dir), [reqs[0]], seeded)["r0"]
    engine = make_engine(tiny_dir)
    engine.add_request("noise-1", prompt_token_ids=reqs[1], params=SamplingParams(max_tokens=9))
    engine.add_request("noise-2", prompt_token_ids=reqs[2], params=SamplingParams(max_tokens=30))
    mixed = run(engine, [reqs[0]], seeded)["r0"]
    assert mixed == alone
    other = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    assert run(make_engine(tiny_dir), [reqs[0]], other)["r0"] != alone


def test_stop_string_across_token_boundaries_is_cut_and_never_streamed(tiny_dir: Path):
    engine = make_engine(tiny_dir)
    prompt = prompts(1)[0]
    engine.add_request("free", prompt_token_ids=prompt, params=GREEDY)
    ids = run_to_end(engine)["free"].token_ids
    tok = engine.tokenizer
    # A stop string from the middle of token 3 to the middle of token 4.
    a, b, c = (len(tok.decode(ids[:k])) for k in (3, 4, 5))
    full = tok.decode(ids)
    assert b - a >= 2 and c - b >= 2, "tokens too short for this test"
    stop = full[a + 1 : b + 1]
    expected = full[: full.find(stop)]
    engine.add_request("stopped", prompt_token_ids=prompt, params=_with(GREEDY, stop=[stop]))
    streamed = ""
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.new_text
            assert stop not in streamed
            if out.finished:
                assert out.finish_reason == "stop"
                assert out.text == expected == streamed


def test_min_tokens_and_stop_token_ids(tiny_dir: Path):
    engine = make_engine(tiny_dir)
    prompt = prompts(1)[0]
    ids = run(engine, [prompt])["r0"]
    # Stopping on the 3rd generated token; min_tokens then forbids stopping before 5.
    stop_at = ids[2]
    first = ids.index(stop_at)
    out = run(engine, [prompt], _with(GREEDY, stop_token_ids=[stop_at]))["r0"]
    assert out == ids[: first + 1]
    held = run(engine, [prompt], _with(GREEDY, stop_token_ids=[stop_at], min_tokens=5))["r0"]
    assert len(held) >= 5 and stop_at not in held[:4]


def test_logprobs_report_the_top_tokens_and_the_sampled_one(tiny_dir: Path):
    engine = make_engine(tiny_dir)
    engine.add_request("lp", prompt_token_ids=prompts(1)[0], params=_with(GREEDY, logprobs=3))
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.logprobs
    assert len(logprobs) == GREEDY.max_tokens
    for token, top in zip(tokens, logprobs, strict=True):
        assert token in top and len(top) == 3  # greedy: the sampled token is the best one
        assert max(top.values()) == top[token] <= 0.0


def test_without_detokenize_the_tokens_are_the_same_and_the_text_empty(tiny_dir: Path):
    reqs = prompts(3)
    sampled = SamplingParams(temperature=1.0, seed=7, ignore_eos=True, max_tokens=12)
    with_text = run(make_engine(tiny_dir), reqs, sampled)
    engine = make_engine(tiny_dir)
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=_with(sampled, detokenize=False))
    outs = [out for _ in range(13) for out in engine.step()]
    assert not engine.has_unfinished()
    assert {o.request_id: o.token_ids for o in outs if o.finished} == with_text
    assert {(o.new_text, o.text) for o in outs} == {("", None), ("", "")}
    with pytest.raises(InvalidRequest, match="stop strings need detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_abort_frees_blocks_and_reports_cancelled(tiny_dir: Path):
    engine = make_engine(tiny_dir)
    engine.add_request("x", prompt_token_ids=prompts(1, (50,))[0], params=GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    out = engine.abort("x")
    assert out.finished and out.finish_reason == "cancelled"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished() and engine.abort("x") is None


def test_bad_requests_are_refused_with_a_code(tiny_dir: Path):
    engine = make_engine(tiny_dir, max_model_len=64)
    cases = [
        ({"prompt_token_ids": []}, "empty_prompt"),
        ({"prompt_token_ids": [1] * 64}, "prompt_too_long"),
        ({"prompt_token_ids": [10**9]}, "invalid_input"),
        ({"prompt_token_ids": [1, -1]}, "invalid_input"),
        ({"prompt_token_ids": [1, False]}, "invalid_input"),
        ({"prompt_token_ids": [1.0]}, "invalid_input"),
        ({"prompt_token_ids": [1, None]}, "invalid_input"),
        ({"prompt": "hi", "prompt_token_ids": [1]}, "invalid_input"),
        ({"messages": [{"role": "user"}]}, "invalid_input"),
        ({"prompt": "lone \ud800 surrogate"}, "invalid_input"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, "invalid_input"),
        ({"prompt": "hi", "params": {"temperature": -2}}, "invalid_params"),
    ]
    for kwargs, code in cases:
        with pytest.raises(InvalidRequest) as err:
            engine.add_request("bad", **kwargs)
        assert err.value.code == code
    assert not engine.has_unfinished()


def test_max_tokens_past_the_context_left_after_the_prompt_is_refused(tiny_dir: Path):
    """As vLLM answers 400: a job is never accepted to run until its deadline."""
    engine = make_engine(tiny_dir, max_model_len=64)
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("big", prompt_token_ids=[1] * 10, params={"max_tokens": 55})
    assert (err.value.code, err.value.param) == ("invalid_params", "max_tokens")
    assert err.value.message.startswith("max_tokens: 55 tokens after a prompt of 10 ")
    assert "(at most 54 fit)" in err.value.message
    engine.add_request("fits", prompt_token_ids=[1] * 10, params={"max_tokens": 54})
    engine.add_request("open", prompt_token_ids=[1] * 10, params={"max_tokens": None})
    assert engine.has_unfinished()


def test_deadline_ends_a_request_with_reason_deadline(tiny_dir: Path):
    import time

    engine = make_engine(tiny_dir)
    engine.add_request(
        "late", prompt_token_ids=prompts(1)[0], params=GREEDY, deadline=time.monotonic() - 1
    )
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("late", "deadline")]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _with(params: SamplingParams, **changes) -> SamplingParams:
    return SamplingParams(**{**params.to_dict(), **changes})


def run_to_end(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_triton_backend_gives_the_same_tokens_as_torch(tiny_dir: Path):
    """The engine on its Triton kernels (the interpreter on a CPU) against the torch path,
    on a mixed batch: chunked prefills beside decodes."""
    reqs = prompts(3, (5, 21, 2))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    torch_run = run(
        make_engine(tiny_dir, max_num_batched_tokens=16, attention_backend="torch"), reqs, params
    )
    engine = make_engine(tiny_dir, max_num_batched_tokens=16, attention_backend="triton")
    assert engine.backend.name == "triton"
    assert run(engine, reqs, params) == torch_run


@pytest.mark.skipif(not cpu_ops.available(build_dir()), reason="no C compiler")
def test_cpu_kernels_give_the_same_tokens_as_torch(tiny_dir: Path):
    """The C forward (fused norms, in-place rotary, C decode attention) against the plain
    torch one, on mixed steps; and auto picks it on a float32 CPU engine."""
    reqs = prompts(6, (5, 21, 2, 40, 9, 17))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
    torch_engine = make_engine(tiny_dir, max_num_batched_tokens=24, attention_backend="torch")
    engine = make_engine(tiny_dir, max_num_batched_tokens=24)
    assert (torch_engine.backend.name, engine.backend.name) == ("torch", "cpu")
    assert run(engine, reqs, params) == run(torch_engine, reqs, params)


# -- at the door: what cannot run is refused by add_request, and fast ------------------------


def run_all(engine: LLMEngine) -> dict:
    """Every request to its end: no exception may escape a step; all blocks free after."""
    done = run_to_end(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_parameter(tiny_dir: Path):
    engine = make_engine(tiny_dir)
    vocab = engine.model_config.vocab_size
    for params, name in [
        ({"stop_token_ids": [1, vocab], "min_tokens": 2}, "stop_token_ids"),
        ({"logit_bias": {str(vocab): 5}}, "logit_bias"),
        ({"logit_bias": {10**18: 5}}, "logit_bias"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            engine.add_request("bad", prompt_token_ids=[1, 2], params=params)
        assert err.value.code == "invalid_params"
        assert err.value.message.startswith(f"{name}: token id ")
    assert not engine.has_unfinished()


def test_encode_prompt_gives_the_ids_add_request_queues(tiny_dir: Path):
    engine = make_engine(tiny_dir)
    chat = [{"role": "user", "content": "Hi there"}]
    for kwargs in ({"prompt": "Hello, world"}, {"messages": chat}, {"prompt_token_ids": [5, 6]}):
        ids = engine.encode_prompt(**kwargs)
        engine.add_request("q", **kwargs, params=GREEDY)
        assert engine.requests["q"].prompt_token_ids == ids
        engine.abort("q")


def test_text_too_long_for_the_context_is_refused_without_tokenizing_it(
    tiny_dir: Path, monkeypatch
):
    import time

    engine = make_engine(tiny_dir)
    limit = engine.prompts.max_prompt_chars
    assert limit == engine.max_model_len * engine.tokenizer.max_token_chars()

    def encode(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    huge = "a" * 10_000_000
    for kwargs in ({"prompt": huge}, {"messages": [{"role": "user", "content": huge}]}):
        start = time.perf_counter()
        with pytest.raises(InvalidRequest) as err:
            engine.encode_prompt(**kwargs)
        assert err.value.code == "prompt_too_long"
        assert time.perf_counter() - start < 1.0  # tokenizing it takes seconds
    with pytest.raises(InvalidRequest) as err:
        engine.encode_prompt(prompt="a" * (limit + 1))
    assert err.value.code == "prompt_too_long"
    monkeypatch.undo()  # at the bound it is tokenized, and refused for its token count
    with pytest.raises(InvalidRequest) as err:
        engine.encode_prompt(prompt="a" * limit)
    assert err.value.code == "prompt_too_long" and "tokens;" in err.value.message


def test_encode_prompt_from_other_threads_while_the_engine_steps(tiny_dir: Path):
    from concurrent.futures import ThreadPoolExecutor

    engine = make_engine(tiny_dir)
    texts = [f"request {i}: " + "some words and 123 numbers " * 200 for i in range(8)]
    expected = [engine.encode_prompt(prompt=t) for t in texts]
    for i, p in enumerate(prompts(4)):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(engine.encode_prompt, t) for t in texts]
        run_all(engine)
        assert [f.result() for f in futures] == expected


# -- one poison request never breaks its step or its neighbours --------------------------------

POISON = 49151  # a valid token id that only poison prompts carry (innocent ids are < 40000)


def alone_tokens(model: Path, reqs: list[list[int]]) -> list[list[int]]:
    """What each request generates on an engine of its own (greedy)."""
    engine = make_engine(model)
    return [run(engine, [p])["r0"] for p in reqs]


def add_beside(engine: LLMEngine, reqs: list[list[int]], poison: list[int]) -> None:
    """The poison request first, then the innocent ones: all in the same first step."""
    engine.add_request("poison", prompt_token_ids=poison, params=GREEDY)
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY)


def assert_only_the_poison_failed(done: dict, alone: list[list[int]], error: str) -> None:
    assert done["poison"].finish_reason == "error"
    assert done["poison"].error.startswith(error)
    for i, tokens in enumerate(alone):
        out = done[f"r{i}"]
        assert (out.finish_reason, out.error, out.token_ids) == ("length", None, tokens)


def fail_forward_when(engine: LLMEngine, monkeypatch, fails) -> None:
    forward = engine.model_runner.model.forward

    def poisoned(input_ids, positions, *rest):
        if fails(input_ids, positions):
            raise RuntimeError("poisoned batch")
        return forward(input_ids, positions, *rest)

    monkeypatch.setattr(engine.model_runner.model, "forward", poisoned)


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_request_whose_forward_pass_raises_fails_alone(tiny_dir: Path, monkeypatch, when: str):
    reqs = prompts(5)
    alone = alone_tokens(tiny_dir, reqs)
    engine = make_engine(tiny_dir)
    poison = prompts(1, (95,))[0]
    if when == "prefill":  # the batch fails whenever the poison prompt is in it
        poison[3] = POISON
        fail_forward_when(engine, monkeypatch, lambda ids, pos: bool((ids == POISON).any()))
    else:  # only the poison request ever reaches position 100, mid-generation
        fail_forward_when(engine, monkeypatch, lambda ids, pos: bool((pos >= 100).any()))
    add_beside(engine, reqs, poison)
    done = run_all(engine)
    assert_only_the_poison_failed(done, alone, "RuntimeError: poisoned batch")
    # Decode: the 6th generated token sits at position 100; feeding it is what fails.
    assert done["poison"].completion_tokens == (0 if when == "prefill" else 6)


@pytest.mark.parametrize("stage", ["sampling", "detokenizing"])
def test_a_request_whose_token_processing_raises_fails_alone(
    tiny_dir: Path, monkeypatch, stage: str
):
    from tokenq.engine import model_runner

    reqs = prompts(5)
    alone = alone_tokens(tiny_dir, reqs)
    engine = make_engine(tiny_dir)
    add_beside(engine, reqs, [300, POISON, 301])
    if stage == "sampling":
        real_sample = model_runner.sample

        def sample(logits, params, prompts_, *rest):
            if any(POISON in p for p in prompts_):
                raise ValueError("no token for this row")
            return real_sample(logits, params, prompts_, *rest)

        monkeypatch.setattr(model_runner, "sample", sample)
        error, tokens = "ValueError: no token for this row", 0
    else:  # the third token of the poison request cannot be decoded
        detokenizer = engine.output_processor.states[engine.requests["poison"]].detokenizer
        real_push, pushed = detokenizer.push, []

        def push(ids):
            pushed.append(ids)
            if len(pushed) == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return real_push(ids)

        monkeypatch.setattr(detokenizer, "push", push)
        error, tokens = "UnicodeDecodeError: 'utf-8' codec", 3
    done = run_all(engine)
    assert_only_the_poison_failed(done, alone, error)
    assert done["poison"].completion_tokens == tokens


def test_a_forward_pass_failing_for_everyone_raises_step_failed_and_a_retry_is_correct(
    tiny_dir: Path, monkeypatch
):
    import time

    from tokenq.engine import StepFailed

    reqs = prompts(3)
    alone = alone_tokens(tiny_dir, reqs)
    engine = make_engine(tiny_dir)
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY)
    first = {out.request_id: out.new_token_ids for out in engine.step()}
    late = time.monotonic() - 1
    engine.add_request("late", prompt_token_ids=reqs[0], params=GREEDY, deadline=late)
    fail_forward_when(engine, monkeypatch, lambda ids, pos: True)  # out of memory, say
    with pytest.raises(StepFailed) as err:
        engine.step()
    assert isinstance(err.value.__cause__, RuntimeError)
    # Nothing advanced, nobody blamed; what the step did finish is handed over.
    assert [(o.request_id, o.finish_reason) for o in err.value.outputs] == [("late", "deadline")]
    for i, p in enumerate(reqs):
        seq = engine.requests[f"r{i}"]
        assert (seq.num_computed_tokens, seq.output_token_ids) == (len(p), first[f"r{i}"])
    monkeypatch.undo()  # the device recovers: the same requests go on exactly as before
    done = run_all(engine)
    assert [done[f"r{i}"].token_ids for i in range(3)] == alone


def test_after_step_failed_aborting_everything_frees_the_whole_kv_pool(tiny_dir: Path, monkeypatch):
    from tokenq.engine import StepFailed

    engine = make_engine(tiny_dir, max_num_batched_tokens=40)  # some prefills still chunked
    for i, p in enumerate(prompts(6)):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY)
    engine.step()
    fail_forward_when(engine, monkeypatch, lambda ids, pos: True)
    with pytest.raises(StepFailed):
        engine.step()
    for request_id in list(engine.requests):
        assert engine.abort(request_id).finish_reason == "cancelled"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished()
    assert not (engine.scheduler.waiting or engine.scheduler.running)


def test_a_lone_request_whose_forward_pass_raises_ends_with_error(tiny_dir: Path, monkeypatch):
    # With nothing to compare it against, a lone request cannot be told from a broken
    # device; it is failed rather than retried forever.
    engine = make_engine(tiny_dir)
    fail_forward_when(engine, monkeypatch, lambda ids, pos: True)
    engine.add_request("only", prompt_token_ids=prompts(1)[0], params=GREEDY)
    (out,) = engine.step()
    assert (out.finish_reason, out.error) == ("error", "RuntimeError: poisoned batch")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_extreme_but_valid_parameters_run_beside_ordinary_requests(tiny_dir: Path):
    reqs = prompts(4)
    alone = alone_tokens(tiny_dir, reqs)
    engine = make_engine(tiny_dir)
    vocab = engine.model_config.vocab_size
    extremes = [
        {"stop_token_ids": list(range(vocab)), "min_tokens": 4},  # every token stops
        {"temperature": 1e-300, "repetition_penalty": 0.01, "seed": 2**63 - 1},
        {"temperature": 100.0, "top_p": 5e-324, "min_p": 1.0, "frequency_penalty": -2.0},
        {"logit_bias": {str(t): 100 for t in range(0, vocab, 97)}, "presence_penalty": 2.0},
        {"logit_bias": {t: -100 for t in range(vocab)}, "logprobs": 20, "seed": -(2**63)},
    ]
    for i, extra in enumerate(extremes):
        params = {"max_tokens": 12, "ignore_eos": True, **extra}
        engine.add_request(f"x{i}", prompt_token_ids=reqs[i % 4], params=params)
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY)
    done = run_all(engine)
    for i in range(len(extremes)):
        assert done[f"x{i}"].error is None
        assert all(0 <= t < vocab for t in done[f"x{i}"].token_ids)
    # min_tokens holds even though its ban (the whole vocabulary) had to be dropped.
    assert (done["x0"].finish_reason, done["x0"].completion_tokens) == ("stop", 5)
    assert [done[f"r{i}"].token_ids for i in range(4)] == alone


# -- priority: interactive requests preempt batch ones -----------------------------------------

BATCH = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48)
INTERACTIVE = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)


@dataclass
class Timeline:
    """Steps an engine to the end, recording each request's tokens, the step of its
    first token and the order requests finished in."""

    engine: LLMEngine
    steps: int = 0
    tokens: dict[str, list[int]] = field(default_factory=dict)
    first_token_step: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)

    def step(self) -> None:
        self.steps += 1
        for out in self.engine.step():
            tokens = self.tokens.setdefault(out.request_id, [])
            tokens += out.new_token_ids
            if tokens:
                self.first_token_step.setdefault(out.request_id, self.steps)
            if out.finished:
                assert out.token_ids == tokens and out.finish_reason == "length"
                self.finished.append(out.request_id)

    def run_to_end(self) -> None:
        while self.engine.has_unfinished():
            self.step()
        assert self.engine.block_manager.num_free_blocks == self.engine.block_manager.num_blocks


def add_all(engine: LLMEngine, reqs: list[list[int]], params, priority: int) -> list[Sequence]:
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params, priority=priority)
    return [engine.requests[f"r{i}"] for i in range(len(reqs))]


def test_an_interactive_request_takes_a_batch_slot_and_the_batch_tokens_stay(tiny_dir: Path):
    batch = prompts(4)
    unpreempted = run(make_engine(tiny_dir), batch, BATCH)
    engine = make_engine(tiny_dir, max_num_seqs=4)
    timeline = Timeline(engine)
    seqs = add_all(engine, batch, BATCH, priority=5)
    for _ in range(3):
        timeline.step()
    assert engine.free_capacity() == engine.free_capacity(5) == 0
    assert engine.free_capacity(-1) == 4  # all four slots hold batch requests
    engine.add_request("hi", prompt_token_ids=prompts(5)[4], params=INTERACTIVE, priority=-1)
    hi, added = engine.requests["hi"], timeline.steps
    timeline.run_to_end()
    assert timeline.first_token_step["hi"] - added <= 2
    assert timeline.finished[0] == "hi"
    assert {r: timeline.tokens[r] for r in unpreempted} == unpreempted
    assert [s.num_preemptions for s in seqs + [hi]] == [0, 0, 0, 1, 0]  # the newest batch one
    counters = engine.stats().counters
    assert counters["preemptions"] == counters["preemptions_priority"] == 1


def test_an_interactive_request_takes_batch_blocks_and_the_batch_tokens_stay(tiny_dir: Path):
    batch = prompts(4, (16,))
    unpreempted = run(make_engine(tiny_dir), batch, BATCH)
    # 30 blocks of 8 tokens for 4 batch requests that end with 8 blocks each; 8 slots.
    engine = make_engine(tiny_dir, num_kv_blocks=30, block_size=8, max_num_seqs=8)
    timeline = Timeline(engine)
    seqs = add_all(engine, batch, BATCH, priority=5)
    interactive = prompts(3, (33,))[2]  # a first chunk of 5 blocks
    while engine.block_manager.num_free_blocks >= 5:
        timeline.step()
    assert engine.free_capacity() == 0 < engine.free_capacity(-1)
    engine.add_request("hi", prompt_token_ids=interactive, params=INTERACTIVE, priority=-1)
    hi, added = engine.requests["hi"], timeline.steps
    timeline.run_to_end()
    assert timeline.first_token_step["hi"] - added <= 2
    assert timeline.finished[0] == "hi" and hi.num_preemptions == 0
    assert {r: timeline.tokens[r] for r in unpreempted} == unpreempted
    assert engine.counters["preemptions_priority"] >= 1
    assert sum(s.num_preemptions for s in seqs) == engine.counters["preemptions"]


def test_a_stream_of_interactive_requests_preempts_each_batch_request_boundedly(tiny_dir: Path):
    """Each step preempts for priority at most as many requests as it admits interactive
    ones; interactive requests never preempt each other; everything finishes, exactly."""
    batch = prompts(2, (17, 9))
    unpreempted = run(make_engine(tiny_dir), batch, BATCH)
    short = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3)
    engine = make_engine(tiny_dir, max_num_seqs=2)
    timeline = Timeline(engine)
    seqs = add_all(engine, batch, BATCH, priority=5)
    stream = prompts(12, (5, 11, 3))
    interactive: list[Sequence] = []
    while engine.has_unfinished():
        if timeline.steps % 2 == 0 and len(interactive) < len(stream):
            rid = f"hi{len(interactive)}"
            prompt = stream[len(interactive)]
            engine.add_request(rid, prompt_token_ids=prompt, params=short, priority=-1)
            interactive.append(engine.requests[rid])
        waiting = [s for s in interactive if s.metrics.first_scheduled is None]
        before = engine.counters["preemptions_priority"]
        timeline.step()
        admitted = sum(s.metrics.first_scheduled is not None for s in waiting)
        assert engine.counters["preemptions_priority"] - before <= admitted
        assert timeline.steps < 500
    assert all(s.num_preemptions == 0 for s in interactive)
    assert 0 < engine.counters["preemptions_priority"] <= len(stream)
    assert max(s.num_preemptions for s in seqs) <= len(stream)
    assert {r: timeline.tokens[r] for r in unpreempted} == unpreempted


def test_an_interactive_request_added_during_a_batch_step_has_its_first_token_before_it_ends(
    tiny_dir: Path,
):
    """Added between two layers of a full batch step, it runs a step ahead there: its
    first token comes out of that call, and every request's tokens stay exact."""
    batch, interactive = prompts(4), prompts(5)[4]
    unpreempted = run(make_engine(tiny_dir), batch, BATCH)
    alone = run(make_engine(tiny_dir), [interactive], INTERACTIVE)["r0"]
    engine = make_engine(tiny_dir, max_num_seqs=4)
    timeline = Timeline(engine)
    add_all(engine, batch, BATCH, priority=5)
    for _ in range(3):
        timeline.step()
    ahead: list = []
    layers = []

    def between_layers() -> None:
        layers.append(len(layers))
        if len(layers) == 1:
            engine.add_request("hi", prompt_token_ids=interactive, params=INTERACTIVE, priority=-1)
            ahead.extend(engine.step_ahead())
        assert engine.step_ahead() == []  # nothing more outranks the batch step

    outputs = engine.step(between_layers)
    assert len(layers) == engine.model_config.num_layers - 1
    assert [(o.request_id, o.new_token_ids) for o in ahead] == [("hi", alone[:1])]
    assert "hi" not in {o.request_id for o in outputs} and len(outputs) == 4
    assert engine.counters["steps_ahead"] == 1
    # Five requests on four seats: they keep them; nothing is preempted.
    timeline.tokens["hi"] = list(ahead[0].new_token_ids)
    for o in outputs:
        timeline.tokens[o.request_id] += o.new_token_ids
    timeline.run_to_end()
    assert timeline.tokens["hi"] == alone and timeline.finished[0] == "hi"
    assert {r: timeline.tokens[r] for r in unpreempted} == unpreempted
    assert engine.counters["preemptions"] == 0


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_requests_added_early_in_a_step_join_its_pass_with_the_same_tokens(
    tiny_dir: Path, backend: str
):
    """Added between two layers of a prefill step with room left, they go through the
    layers done so far alone and share the rest of the pass: their first tokens come out
    of that step, and every request's tokens equal a run where all came at once."""
    reqs = prompts(5)
    together = run(make_engine(tiny_dir, attention_backend=backend), reqs, GREEDY)
    engine = make_engine(
        tiny_dir, max_num_seqs=4, max_num_batched_tokens=96, attention_backend=backend
    )
    engine.add_request("r0", prompt_token_ids=reqs[0], params=GREEDY)  # 5 tokens
    layers: list[int] = []

    def between_layers() -> None:
        layers.append(len(layers))
        if len(layers) == 1:  # 5 + 17 + 33 + 2 tokens fit the budget; a fifth seat does not
            for i in range(1, 5):
                engine.add_request(f"r{i}", prompt_token_ids=reqs[i], params=GREEDY)

    first = engine.step(between_layers)
    assert len(layers) == engine.model_config.num_layers - 1
    assert sorted(o.request_id for o in first) == ["r0", "r1", "r2", "r3"]
    assert all(len(o.new_token_ids) == 1 for o in first)
    assert engine.counters["joins"] == 1 and engine.counters["requests_joined"] == 3
    assert engine.scheduler.num_waiting == 1  # r4: no seat
    tokens = {o.request_id: list(o.new_token_ids) for o in first}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert {f"r{i}": tokens[f"r{i}"] for i in range(5)} == together
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_joined_inputs_equal_the_inputs_of_all_the_requests_at_once(tiny_dir: Path):
    """A pass's inputs after joins are its own and the joining requests' joined as tensors;
    they must equal what one walk over all the requests builds: tokens, positions, slots,
    query offsets, lengths, block tables padded to the widest, logits rows."""
    engine = make_engine(tiny_dir)
    for i, ids in enumerate(prompts(4, (5, 40, 17, 70))):  # 1, 3, 2 and 5 blocks of 16
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=GREEDY)
    scheduled = engine.scheduler.schedule().scheduled
    runner = engine.model_runner
    whole = runner._inputs(scheduled)[0]
    parts = [scheduled[:1], scheduled[1:3], scheduled[3:]]
    merged = runner._inputs(parts[0])[0]
    for part in parts[1:]:
        merged = _merged(merged, runner._inputs(part)[0])
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(merged, name), getattr(whole, name)), name
    for name in ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(merged.meta, name), getattr(whole.meta, name)), name
    assert merged.meta.max_query_len == whole.meta.max_query_len == 70
    assert merged.meta.max_seq_len == whole.meta.max_seq_len


def test_no_request_joins_a_step_beyond_its_token_budget(tiny_dir: Path):
    reqs = prompts(3, (40, 40, 30))
    engine = make_engine(tiny_dir, max_num_batched_tokens=64)
    engine.add_request("r0", prompt_token_ids=reqs[0], params=GREEDY)

    def between_layers() -> None:
        if "r1" not in engine.requests:
            engine.add_request("r1", prompt_token_ids=reqs[1], params=GREEDY)

    engine.step(between_layers)
    r1 = engine.requests["r1"]
    # 24 tokens of budget were left: r1 joined with a first chunk of them, no token yet.
    assert r1.num_computed_tokens == 24 and r1.num_output_tokens == 0
    assert engine.counters["requests_joined"] == 1
