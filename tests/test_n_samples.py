"""n outputs of one prompt: prefilled once, its blocks shared by reference and the last
partial one copied on write; with a seed, output i equals a request of its own with seed
+ i. And prompt scoring (``prompt_logprobs``) against transformers in float32."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.faults import free_port
from tests.helpers import DEFAULT_MODEL
from tests.redis_fixtures import CLIENT, TEST_MODEL, queue_of
from tests.worker_support import (
    WorkerThread,
    fast_config,
    make_engine,
    reference_run,
    tiny_model,  # noqa: F401
    wait_for,
)
from tokenq.engine import LLM, SamplingParams
from tokenq.ops.dlq import DeadLetters
from tokenq.producer.client import Client, ClientConfig, make_request
from tokenq.producer.errors import JobFailed, QueueFull
from tokenq.protocol import DoneEvent, Event, RestartEvent, TokenEvent, decode_event
from tokenq.protocol.errors import InvalidRequest
from tokenq.protocol.params import check_sizes
from tokenq.worker.worker import Worker

PROMPT = (
    "The lighthouse keeper wrote in his log every night, describing the storms, the ships "
    "that passed and the birds that rested on the rail. One quiet evening he wrote:"
)
SEEDED = {"temperature": 0.9, "seed": 1234, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm() -> LLM:
    """Dequantized (the scores are held to transformers' float32 ones)."""
    return LLM(
        DEFAULT_MODEL,
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        block_size=16,
        num_threads=1,
        quantization="none",
    )


_ALONE: dict[int, tuple[list[int], str]] = {}


def alone(llm: LLM, seed: int) -> list[int]:
    """A request of its own with ``seed`` (run once per module: several tests compare)."""
    if seed not in _ALONE:
        (out,) = llm.generate(PROMPT, SamplingParams(**{**SEEDED, "seed": seed}))
        _ALONE[seed] = (out.outputs[0].token_ids, out.outputs[0].text)
    return _ALONE[seed][0]


def alone_text(llm: LLM, seed: int) -> str:
    alone(llm, seed)
    return _ALONE[seed][1]


def test_output_i_of_n_equals_a_request_of_its_own_with_seed_plus_i(llm: LLM) -> None:
    engine = llm.engine
    prompt_tokens = engine.counters["prompt_tokens"]
    engine.block_manager.reset_peak()
    (out,) = llm.generate(PROMPT, SamplingParams(n=4, **SEEDED))
    p = len(out.prompt_token_ids)
    assert p % 16 and p > 32  # full blocks to share, and a partial one to copy
    assert engine.counters["prompt_tokens"] - prompt_tokens == p  # prefilled once
    # the prompt's full blocks once, then each output's own (its copy of the partial one)
    full = p // 16
    own = -(-(p + 8) // 16) - full
    assert engine.stats().peak_used_blocks == full + 4 * own
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 4
    for i, output in enumerate(out.outputs):
        assert output.token_ids == alone(llm, 1234 + i)
        assert output.text == llm.tokenizer.decode(output.token_ids)


def test_stop_rules_and_penalties_apply_to_each_output(llm: LLM) -> None:
    params = {"temperature": 0.9, "max_tokens": 8, "min_tokens": 2, "frequency_penalty": 1.0}
    params |= {"stop": [" the"]}
    (out,) = llm.generate(PROMPT, SamplingParams(n=2, seed=5, **params))
    for i, got in enumerate(out.outputs):
        (want,) = llm.generate(PROMPT, SamplingParams(seed=5 + i, **params))
        assert (got.text, got.finish_reason) == (
            want.outputs[0].text,
            want.outputs[0].finish_reason,
        )


def test_a_group_preempted_for_blocks_recomputes_and_loses_nothing() -> None:
    # 6 blocks of 16: the prompt's 33 tokens fit, not 3 outputs of 52 positions (4 blocks)
    small = LLM(
        DEFAULT_MODEL, device="cpu", dtype="float32", num_kv_blocks=6, block_size=16, num_threads=1
    )
    params = {"temperature": 0.9, "max_tokens": 20, "ignore_eos": True}
    (out,) = small.generate(PROMPT, SamplingParams(n=3, seed=99, **params))
    assert small.engine.counters["preemptions_kv_cache"] > 0
    for i, output in enumerate(out.outputs):
        (one,) = small.generate(PROMPT, SamplingParams(seed=99 + i, **params))
        assert output.token_ids == one.outputs[0].token_ids


def test_cancelling_or_a_deadline_ends_every_output_and_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    params = SamplingParams(n=3, temperature=0.9, seed=1, max_tokens=50, ignore_eos=True)
    engine.add_request("cancel-me", PROMPT, params=params)
    engine.add_request("late", PROMPT, params=params, deadline=0.0)
    late = [d for d in engine.step() if d.request_id == "late"]
    assert [d.finished for d in late] == [False, False, True]
    assert [o.finish_reason for o in late[-1].outputs] == ["deadline"] * 3
    engine.step()
    last = engine.abort("cancel-me")
    assert last is not None and last.finished
    assert [(o.index, o.finish_reason) for o in last.outputs] == [
        (i, "cancelled") for i in range(3)
    ]
    assert [len(o.token_ids) for o in last.outputs] == [2, 2, 2]  # two steps: two tokens each
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == free


def test_n_is_bounded_by_the_limits() -> None:
    check_sizes({"n": 16})
    with pytest.raises(InvalidRequest, match="n: 17 outputs"):
        check_sizes({"n": 17})
    with pytest.raises(InvalidRequest, match="n: must be at least 1"):
        SamplingParams(n=0)


@pytest.fixture(scope="module")
def hf_logprobs() -> Callable[[list[int]], torch.Tensor]:
    """transformers on the default model's weights in float32: log-softmax of every
    position's logits for a prompt's ids."""
    from tokenq.bench.hf_reference import build_hf_model
    from tokenq.engine.loader import load_checkpoint, resolve_model

    checkpoint = load_checkpoint(resolve_model(DEFAULT_MODEL), torch.float32)
    hf = build_hf_model(checkpoint.config, checkpoint.weights)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)

    return logprobs


def test_prompt_logprobs_equal_transformers_in_float32(hf_logprobs) -> None:
    # prefilled in chunks of 16: every chunk's rows are scored
    llm = LLM(
        DEFAULT_MODEL,
        device="cpu",
        dtype="float32",
        num_kv_blocks=32,
        max_num_batched_tokens=16,
        num_threads=1,
        quantization="none",  # held to transformers' float32 scores
    )
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=3, temperature=0))
    ids = out.prompt_token_ids
    ref = hf_logprobs(ids)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry is not None and ids[pos] in entry
        assert abs(entry[ids[pos]] - float(ref[pos - 1, ids[pos]])) < 1e-4
        top = torch.topk(ref[pos - 1], 3)
        for token, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(entry[token] - lp) < 1e-4


# -- through the queue ----------------------------------------------------------------


def outputs_of(events: list[Event]) -> dict[int, tuple[list[int], str]]:
    """Each output's streamed tokens and text, checking that they are contiguous: no gap
    and no duplicate within an output (a restart voids only its own output)."""
    streamed: dict[int, tuple[list[int], str]] = {}
    for event in events:
        if isinstance(event, RestartEvent):
            streamed[event.output] = ([], "")
        elif isinstance(event, TokenEvent):
            ids, text = streamed.get(event.output, ([], ""))
            assert event.index == len(ids), (event.output, event.index, len(ids))
            streamed[event.output] = (ids + event.token_ids, text + event.text)
    assert sum(e.type in ("done", "error") for e in events) == 1
    return streamed


def test_a_job_of_n_streams_each_output_and_ends_with_all_of_them(
    llm: LLM, redis_url: str, redis_namespace: str
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    config = fast_config(redis_namespace)
    with WorkerThread(Worker(llm.engine, client.redis, config)):
        job = client.submit(PROMPT, n=4, **SEEDED)
        events = list(job.stream(timeout=120))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.outputs is not None
    streamed = outputs_of(events)
    assert [o.index for o in done.outputs] == [0, 1, 2, 3]
    assert done.usage.completion_tokens == 4 * SEEDED["max_tokens"]
    for i, output in enumerate(done.outputs):
        assert streamed[i] == (output.token_ids, output.text)
        assert output.finish_reason == "length"
        assert output.token_ids == alone(llm, SEEDED["seed"] + i)
    assert (done.text, done.token_ids) == (done.outputs[0].text, done.outputs[0].token_ids)
    client.close()


def test_a_dead_workers_job_of_n_resumes_every_output_without_duplicates(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    params = {"n": 3, "temperature": 0.9, "seed": 7, "max_tokens": 30, "ignore_eos": True}
    job = client.submit("a long story", **params)
    # Worker A streams a few tokens of every output, then stops dead (never called again).
    a = Worker(make_engine(tiny_model), conn, fast_config(redis_namespace, consumer="a"))
    a.register()

    def published() -> dict[int, tuple[list[int], str]]:
        return outputs_of(
            [decode_event(i, f) for i, f in conn.xrange(keys.reply(job.id))]
            + [DoneEvent("", "stop")]
        )

    while not all(len(published().get(i, ([], ""))[0]) >= 3 for i in range(3)):
        a.run_once()
    before = published()
    with WorkerThread(
        Worker(make_engine(tiny_model), conn, fast_config(redis_namespace, consumer="b"))
    ):
        events = list(job.stream(timeout=60))
    assert not any(isinstance(e, RestartEvent) for e in events)
    streamed = outputs_of(events)
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.outputs is not None
    ((_, expected),) = reference_run(tiny_model, [{"prompt": "a long story", "params": params}])
    for i, output in enumerate(done.outputs):
        assert streamed[i][0] == output.token_ids == expected.outputs[i].token_ids
        assert len(output.token_ids) == 30 > len(before[i][0])
    client.close()


def test_a_job_of_n_counts_n_in_its_lanes_backlog_until_it_ends(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    """QueueFull counts outputs: with a cap of 8, n = 5 then n = 4 is refused, n = 4 twice
    fits. Each end takes its job's n off again: a run's acknowledgement, a dead-lettered
    entry's settlement, and a replay of that dead letter adds n back (checked first)."""
    ns = redis_namespace
    client = Client(redis_url, namespace=ns, **CLIENT, max_backlog=8)
    conn, keys = client.redis, client.keys
    params = {"temperature": 0.9, "seed": 3, "max_tokens": 4, "ignore_eos": True}
    five = client.submit("five", n=5, **params)
    with pytest.raises(QueueFull) as full:
        client.submit("four", n=4, **params)
    assert (full.value.lane, full.value.backlog, full.value.max_backlog) == ("default", 5, 8)
    fours = client.submit_many([make_request("four", n=4, lane="batch", **params) for _ in "ab"])
    with pytest.raises(QueueFull):
        client.submit("one more", lane="batch", **params)
    default, batch = keys.backlog(TEST_MODEL, "default"), keys.backlog(TEST_MODEL, "batch")
    assert (conn.get(default), conn.get(batch)) == (b"5", b"8")
    queues = (queue_of(ns), queue_of(ns, priority=1))
    assert [f.get(b"w") for q in queues for _, f in conn.xrange(q)] == [b"5", b"4", b"4"]
    # The n = 5 job's entry was delivered too often: the worker dead-letters it unrun.
    conn.xgroup_create(queues[0], "workers", id="0")
    ((_, ((entry, _),)),) = conn.xreadgroup("workers", "ghost", {queues[0]: ">"}, count=1)
    conn.xclaim(queues[0], "workers", "ghost", 0, [entry], retrycount=5, justid=True)
    with WorkerThread(Worker(make_engine(tiny_model), conn, fast_config(ns))):
        for job in fours:
            assert len(job.result(timeout=60).outputs or []) == 4
        with pytest.raises(JobFailed):
            five.result(timeout=60)
        assert (conn.get(default), conn.get(batch)) == (b"0", b"0")
        letters = DeadLetters(conn, ns)
        letter = letters.find(five.id)
        with pytest.raises(QueueFull):
            letters.replay(letter, ClientConfig(namespace=ns, max_backlog=4))
        letters.replay(letter, ClientConfig(namespace=ns, max_backlog=8))
        assert [f.get(b"w") for _, f in conn.xrange(queues[0])] == [b"5"]
        assert len(five.result(timeout=60).outputs or []) == 5
    assert (conn.get(default), conn.get(batch)) == (b"0", b"0")
    client.close()


# -- through the gateway, with the openai SDK ---------------------------------------------


@pytest.fixture(scope="module")
def gateway(llm: LLM, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tokenq serve` in its own process before a worker on the default model (in a
    thread, on the module's engine); the SDK's base URL."""
    for i in range(4):  # the engine is the worker's once it starts
        alone(llm, SEEDED["seed"] + i)
    namespace = f"tqn-{time.monotonic_ns()}"
    client = Client(redis_url, namespace=namespace, **CLIENT)
    port = free_port()
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    cmd = [
        sys.executable, "-m", "tokenq.cli", "serve", "--redis-url", redis_url,
        "--namespace", namespace, "--port", str(port),
    ]  # fmt: skip
    with (
        WorkerThread(Worker(llm.engine, client.redis, fast_config(namespace))),
        log.open("w") as out,
    ):
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: _healthy(port), timeout=60)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    for key in client.redis.scan_iter(match=f"{namespace}:*", count=1000):
        client.redis.delete(key)
    client.close()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_sdk_gets_n_choices_each_equal_to_its_own_seeded_request(
    llm: LLM, gateway: str
) -> None:
    sdk = openai.OpenAI(base_url=gateway, api_key="none")
    asked = {"prompt": PROMPT, "n": 4, "temperature": 0.9, "seed": SEEDED["seed"]}
    asked |= {"max_tokens": SEEDED["max_tokens"], "extra_body": {"ignore_eos": True}}
    whole = sdk.completions.create(model=TEST_MODEL, **asked)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.usage.completion_tokens == 4 * SEEDED["max_tokens"]
    streamed: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in sdk.completions.create(model=TEST_MODEL, stream=True, **asked):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    for i, choice in enumerate(whole.choices):
        want = alone_text(llm, SEEDED["seed"] + i)
        assert choice.text == streamed[i] == want
        assert choice.finish_reason == reasons[i] == "length"


def test_chat_streams_each_choice_by_index(gateway: str) -> None:
    sdk = openai.OpenAI(base_url=gateway, api_key="none")
    messages = [{"role": "user", "content": "Name a colour."}]
    asked = {"messages": messages, "n": 2, "temperature": 0.9, "seed": 3, "max_tokens": 4}
    asked |= {"extra_body": {"ignore_eos": True}}
    whole = sdk.chat.completions.create(model=TEST_MODEL, **asked)
    texts: dict[int, str] = {}
    for chunk in sdk.chat.completions.create(model=TEST_MODEL, stream=True, **asked):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]
    assert whole.usage.completion_tokens == 2 * 4  # summed over the choices


def test_n_choices_each_follow_the_response_format(gateway: str) -> None:
    sdk = openai.OpenAI(base_url=gateway, api_key="none")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    whole = sdk.chat.completions.create(
        model=TEST_MODEL,
        messages=[{"role": "user", "content": "Name a city. Answer in JSON."}],
        n=2,
        temperature=0.9,
        seed=11,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers_does(
    gateway: str, hf_logprobs
) -> None:
    """What lm-evaluation-harness's local-completions model sends for log-likelihoods."""
    sdk = openai.OpenAI(base_url=gateway, api_key="none")
    text = "The capital of France is Paris"
    answer = sdk.completions.create(
        model=TEST_MODEL, prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    (choice,) = answer.choices
    assert choice.text == text and answer.usage.completion_tokens == 0
    lp = choice.logprobs
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_logprobs(ids)
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - float(ref[pos - 1, ids[pos]])) < 1e-4
        best = int(ref[pos - 1].argmax())
        assert abs(lp.top_logprobs[pos][f"token_id:{best}"] - float(ref[pos - 1, best])) < 1e-4


ITEMS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["five", "four", "ten"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "answer": 0},
]
TASK = """task: tokenq_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def test_lm_evaluation_harness_scores_a_multiple_choice_task_as_transformers_does(
    llm: LLM, gateway: str, hf_logprobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-evaluation-harness's local-completions model against `tokenq serve`, offline, on
    a task from a local file; skipped where lm_eval is not installed (it is no extra of
    tokenq's: a large install)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "tokenq_mc.yaml").write_text(TASK.format(items=items))
    tokenizer = tmp_path / "tokenizer"
    llm.tokenizer.save_pretrained(tokenizer)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": TEST_MODEL,
            "base_url": f"{gateway}/completions",
            "tokenizer": str(tokenizer),
            "tokenizer_backend": "huggingface",
            "max_retries": 1,
        },
        tasks=["tokenq_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = results["samples"]["tokenq_mc"]
    assert len(samples) == len(ITEMS)
    hf_tok = __import__("transformers").AutoTokenizer.from_pretrained(str(tokenizer))
    for sample in samples:
        doc = sample["doc"]
        for (context, continuation), (ll, _) in zip(
            sample["arguments"], [r[0] for r in sample["resps"]], strict=True
        ):
            whole = hf_tok.encode(context + continuation, add_special_tokens=False)
            ctx = hf_tok.encode(context, add_special_tokens=False)
            ref = hf_logprobs(whole)
            want = sum(float(ref[p - 1, whole[p]]) for p in range(len(ctx), len(whole)))
            assert abs(ll - want) < 1e-4, (doc["question"], continuation)
