"""Structured outputs: refused at the door when they cannot be enforced, and every output of
the real default model parses and validates (jsonschema) when they can, greedy and sampled,
through preemption and prefix-cache hits."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import fakeredis
import jsonschema
import pytest
import torch
from lark import Lark

from tests.helpers import default_model_path
from tests.redis_fixtures import CLIENT, queue_of
from tests.worker_support import (
    WorkerThread,
    check_reply,
    fast_config,
    make_engine,
    single_torch_thread,  # noqa: F401
    tiny_model,  # noqa: F401
    wait_for,
)
from tokenq.engine import LLM
from tokenq.engine.outputs import RequestDelta
from tokenq.engine.sequence import RequestMetrics
from tokenq.engine.structured import GrammarCompiler
from tokenq.producer.client import Client, Job
from tokenq.protocol import (
    DoneEvent,
    InvalidRequest,
    JobRequest,
    SamplingParams,
    TokenEvent,
    decode_event,
)
from tokenq.worker import pipe
from tokenq.worker.worker import Worker

S = "string"


def obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


def short(**extra: Any) -> dict:
    return {"type": S, "minLength": 1, "maxLength": 12, **extra}


# Real-world shapes (extraction, classification, records), kept short so that greedy
# output ends well before max_tokens.
SCHEMAS: list[dict[str, Any]] = [
    obj({"name": short(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}}),
    obj({"city": short(), "country": short()}),
    obj({"tags": {"type": "array", "items": short(), "minItems": 1, "maxItems": 3}}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"email": short(pattern="^[a-z]{1,8}@[a-z]{1,8}\\.com$")}),
    obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": short()})}),
    obj({"done": {"type": "boolean"}, "title": short()}),
    obj({"zip": {"type": S, "pattern": "^[0-9]{5}$"}}),
    obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}}),
    obj(
        {"point": {"$ref": "#/$defs/point"}},
        **{"$defs": {"point": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})}},
    ),
    obj({"items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}),
    obj({"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "maximum": 9}}),
    obj({"date": {"type": S, "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"answer": {"type": S, "enum": ["yes", "no"]}, "reason": short()}),
    obj({"name": short(), "nickname": short()}, required=["name"]),
    obj({"priority": {"type": "integer", "enum": [1, 2, 3]}}),
    obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}, "currency": {"const": "USD"}}),
    obj({"id": {"type": S, "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "ok": {"type": "boolean"}}),
    obj(
        {"people": {"type": "array", "items": {"$ref": "#/$defs/p"}, "minItems": 1, "maxItems": 2}},
        **{"$defs": {"p": obj({"first": short()})}},
    ),
    obj({"language": {"enum": ["en", "fr", "de"]}, "confidence": {"type": "number"}}),
    obj(
        {
            "contact": {
                "anyOf": [
                    obj({"phone": {"type": S, "pattern": "^[0-9]{3}$"}}),
                    obj({"email": short()}),
                ]
            }
        }
    ),
]
LARK = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"'
PROMPTS = ["Describe a person.", "Fill in the form for a customer order."]


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{prompt} Answer in JSON."}]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # A small KV pool: 28 requests of up to 60 tokens cannot all fit, so some are preempted
    # (recompute) and prefilled again, partly from the prefix cache. One torch thread: the
    # fastest for a small model on a shared machine (the setting is process-wide: put back).
    threads = torch.get_num_threads()
    yield LLM(
        str(default_model_path()),
        device="cpu",
        dtype="float32",
        num_threads=1,
        num_kv_blocks=20,
        max_num_seqs=32,
    )
    torch.set_num_threads(threads)


def test_every_output_validates_greedy_and_sampled_through_preemption(llm: LLM) -> None:
    cases = [({"json": schema}, 0.0, None) for schema in SCHEMAS]
    cases += [({"json": schema}, 0.9, 7 + i) for i, schema in enumerate(SCHEMAS[:2])]
    cases += [
        ({"regex": "[0-9]{3}-[0-9]{4}"}, 0.0, None),
        ({"choice": ["positive", "negative"]}, 0.7, 1),
        ({"grammar": LARK}, 0.0, None),
        ({"json_object": True}, 0.0, None),
    ]
    params = [
        SamplingParams(temperature=t, seed=seed, max_tokens=100, structured_outputs=spec)
        for spec, t, seed in cases
    ]
    prompts = [chat(PROMPTS[i % 2]) for i in range(len(cases) - 1)]
    prompts.append(chat('Reply {"ok": true} if the sky is blue.'))  # json_object: any object
    outs = llm.chat(prompts, params)
    counters = llm.engine.counters
    for (spec, _, _), out in zip(cases, outs, strict=True):
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert reason == "stop", (spec, text)
        ((kind, value),) = spec.items()
        if kind == "json":
            jsonschema.validate(json.loads(text), value)
        elif kind == "json_object":
            assert isinstance(json.loads(text), dict)
        elif kind == "regex":
            assert re.fullmatch(value, text), text
        elif kind == "choice":
            assert text in value
        else:
            Lark(value).parse(text)
    assert counters["preemptions"] > 0
    assert llm.engine.stats().counters["prefix_cache_hit_tokens"] > 0
    assert counters["structured_requests"] >= len(cases)
    assert llm.engine.grammars.stats.compile_cached  # the sampled repeats reused grammars


def test_each_of_n_outputs_follows_the_grammar_alone_as_its_own_seeded_job(llm: LLM) -> None:
    """n = 3 sampled outputs of one prompt, each with its own matcher: every one validates,
    and output i equals a job of its own with seed + i (sharing one matcher, the outputs
    would feed it each other's tokens and be refused)."""
    schema = SCHEMAS[0]
    spec = {"json": schema}

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(
            n=n, temperature=0.9, seed=seed, max_tokens=60, structured_outputs=spec
        )

    prompt = chat(PROMPTS[0])
    group, *alone = llm.chat([prompt] * 4, [params(3, 40), *(params(1, 40 + i) for i in range(3))])
    texts = [o.text for o in group.outputs]
    for i, output in enumerate(group.outputs):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)
        assert output.token_ids == alone[i].outputs[0].token_ids
    assert len(set(texts)) > 1, texts  # sampled apart


def test_a_grammar_compiling_too_long_ends_its_job_alone(llm: LLM) -> None:
    engine = llm.engine
    timeout = engine.config.grammar_compile_timeout
    engine.config.grammar_compile_timeout = 0.05
    busy = threading.Event()  # holds the compile thread: the grammar compiles past its limit
    engine.grammars._pool.submit(busy.wait)
    try:
        # n = 2: the refusal ends both outputs, with one error
        slow = SamplingParams(n=2, max_tokens=4, structured_outputs={"regex": "[a-f]{40}[0-9]"})
        engine.add_request("slow", "Hi", params=slow)
        engine.add_request("mate", "Hi", params=SamplingParams(temperature=0, max_tokens=3))
        done = {}
        while engine.has_unfinished():
            done.update({d.request_id: d for d in engine.step() if d.finished})
    finally:
        busy.set()
        engine.config.grammar_compile_timeout = timeout
    assert done["slow"].finish_reason == "error"
    assert done["slow"].error_code == "invalid_params"
    assert "to compile" in (done["slow"].error or "")
    assert [o.finish_reason for o in done["slow"].outputs or []] == ["error", "cancelled"]
    assert done["mate"].finish_reason == "length" and done["mate"].completion_tokens == 3


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json": {"type": "object", "if": {"type": "object"}}}, '"if"'),
        ({"json": {"type": S, "format": "no-such-format"}}, "no-such-format"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "(?=a)b"}, "look-around"),
        ({"grammar": "start: missing_rule"}, "missing_rule"),
        ({"choice": []}, "non-empty list"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
        ({"guided_json": {}}, "guided_json"),
    ],
)
def test_a_constraint_that_cannot_be_enforced_is_refused_naming_the_part(
    spec: dict, named: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(structured_outputs=spec)
    assert caught.value.code == "invalid_params"
    assert caught.value.param == "structured_outputs"
    assert named in caught.value.message


def test_a_refused_schema_never_reaches_redis() -> None:
    fake = fakeredis.FakeRedis()
    client = Client(fake, namespace="t", **CLIENT)
    bad = {"json": {"type": "array", "uniqueItems": True}}
    with pytest.raises(InvalidRequest, match="uniqueItems") as caught:
        client.submit("hi", structured_outputs=bad)
    assert caught.value.param == "structured_outputs"
    assert fake.xlen(queue_of("t")) == 0 and not fake.keys("t:job:*")
    job = client.submit("hi", structured_outputs={"json": '{"type": "object"}'})
    assert fake.xlen(queue_of("t")) == 1 and job.id


def test_a_job_too_big_in_its_schema_is_refused_by_size() -> None:
    huge = {"json": obj({f"k{i}": {"type": "integer"} for i in range(20_000)})}
    with pytest.raises(InvalidRequest, match="limit"):
        JobRequest(prompt="x", params={"structured_outputs": huge}, job_id="j1").validate()


def test_compiled_grammars_are_cached_and_bounded(llm: LLM) -> None:
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.model_config.vocab_size, 2)
    specs = [{"regex": f"a{i}"} for i in range(3)]
    for spec in specs + specs[-1:]:
        assert not compiler.matcher(spec).is_error()
    assert len(compiler.stats.compile_cold) == 3 and len(compiler.stats.compile_cached) == 1
    assert len(compiler._cache) == 2


@pytest.mark.usefixtures("single_torch_thread")
def test_a_dead_workers_structured_job_resumes_elsewhere_and_still_validates(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    """The rescuer runs the job again with a fresh matcher: it reproduces the published
    tokens (greedy), streams only the rest, and the whole answer validates."""
    schema = obj(
        {
            "answers": {
                "type": "array",
                "items": {"enum": ["yes", "no"]},
                "minItems": 4,
                "maxItems": 4,
            }
        }
    )
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    job = client.submit("Vote.", max_tokens=60, temperature=0, structured_outputs={"json": schema})

    def published() -> list[int]:
        events = reply_events(client, job.id)
        return [sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent))]

    before, rescuer = left_mid_job_then_rescued(client, job, tiny_model, published)
    events = reply_events(client, job.id)
    reply = check_reply(events)
    assert not any(e.type == "restart" for e in events)
    assert reply.done.finish_reason == "stop" and len(reply.done.token_ids) > before[0]
    jsonschema.validate(json.loads(reply.done.text), schema)
    scrape = rescuer.metrics.registry.get_sample_value
    assert scrape("tokenq:structured_requests_total", {"model": "tiny"}) == 1
    assert scrape("tokenq:structured_mask_seconds_count", {"model": "tiny"}) > 0
    compiles = {"model": "tiny", "cache": "cold"}
    assert scrape("tokenq:structured_compile_seconds_count", compiles) == 1
    assert scrape("tokenq:structured_rejections_total", {"model": "tiny", "reason": "timeout"}) == 0
    client.close()


@pytest.mark.usefixtures("single_torch_thread")
def test_a_dead_workers_structured_job_of_n_resumes_every_output_and_each_validates(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
) -> None:
    """Each output's fresh matcher on the rescuer follows that output's own tokens: the
    seeded re-run reproduces what every output published, streams only the rest, and every
    output validates."""
    schema = obj({"answers": {"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 4}})
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    spec = {"json": schema}
    job = client.submit(
        "Vote.", n=2, temperature=0.9, seed=5, max_tokens=60, structured_outputs=spec
    )

    def published() -> list[int]:
        counts = [0, 0]
        for e in reply_events(client, job.id):
            if isinstance(e, TokenEvent):
                counts[e.output] += len(e.token_ids)
        return counts

    before, _ = left_mid_job_then_rescued(client, job, tiny_model, published)
    events = reply_events(client, job.id)
    assert not any(e.type == "restart" for e in events)
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.outputs is not None and len(done.outputs) == 2
    for output, seen in zip(done.outputs, before, strict=True):
        assert output.finish_reason == "stop" and len(output.token_ids) > seen
        jsonschema.validate(json.loads(output.text), schema)
    client.close()


def left_mid_job_then_rescued(
    client: Client, job: Job, model: Path, published: Callable[[], list[int]]
) -> tuple[list[int], Worker]:
    """A worker that dies once every output has published 3 tokens, then a rescuer that
    takes the job over to its end: what each output had published, and the rescuer."""
    config = fast_config(client.keys.namespace, claim_idle_ms=500, claim_interval_s=0.2)
    dead = Worker(make_engine(model), client.redis, replace(config, consumer="dead"))
    dead.register()
    while min(published()) < 3:
        dead.run_once()
    before = published()
    assert job.status() == "running"  # the dead worker left it mid-generation
    rescuer = Worker(make_engine(model), client.redis, replace(config, consumer="rescuer"))
    with WorkerThread(rescuer):
        wait_for(lambda: job.status() == "done", timeout=60)
    return before, rescuer


def reply_events(client: Client, job_id: str) -> list[Any]:
    return [decode_event(i, f) for i, f in client.redis.xrange(client.keys.reply(job_id))]


def test_a_refusals_code_crosses_the_pipe_to_the_queue_process() -> None:
    """The two-process worker sends deltas as tuples: the code must survive the trip."""
    refused = RequestDelta(
        "j",
        [],
        "",
        True,
        "error",
        3,
        0,
        RequestMetrics(0.0),
        error="no",
        error_code="invalid_params",
    )
    (back,) = pipe.to_wire([[refused]])[0]
    assert pipe.from_wire(back).error_code == "invalid_params"
