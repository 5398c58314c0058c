"""tokenq/server/openai_api.py: OpenAI request bodies to jobs, results to OpenAI bodies.

The end-to-end tests, through a real gateway with the official SDK, are in
tests/test_gateway.py; these pin the translation itself, and that the gateway refuses
exactly what the engine would refuse (so no bad request reaches the job stream).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.producer.client import make_request
from tokenq.protocol import DoneEvent, ProtocolError, TokenEvent, Usage
from tokenq.protocol.errors import InvalidRequest
from tokenq.protocol.params import SamplingParams, check_sizes
from tokenq.server.openai_api import (
    BadRequest,
    ChoiceLogprobs,
    Logprobs,
    Rendering,
    chunk_body,
    job_error,
    rendering,
    response_body,
    to_submit_kwargs,
    usage_chunk,
)

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
OTHER_KEYS = ("model", "tenant", "priority")


def chat(**fields: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def params_of(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in PROMPT_KEYS + OTHER_KEYS}


def test_completion_body_becomes_submit_kwargs() -> None:
    body = {
        "model": "tiny",
        "prompt": "Once upon",
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": "\n",
        "seed": 3,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "logit_bias": {"12": -5},
        "logprobs": 3,
        "user": "acme",
        "priority": -2,
    }
    kwargs = to_submit_kwargs("completions", body)
    assert kwargs == {
        "prompt": "Once upon",
        "model": "tiny",
        "tenant": "acme",
        "priority": -2,
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["\n"],
        "seed": 3,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "logit_bias": {"12": -5},
        "logprobs": 3,
    }
    # What it returns is a valid job, whose params the engine accepts as they are.
    make_request(**kwargs).validate()
    SamplingParams.from_dict(params_of(kwargs))


def test_prompt_forms() -> None:
    assert to_submit_kwargs("completions", {"prompt": ["a"]}) == {"prompt": "a"}
    ids = to_submit_kwargs("completions", {"prompt": [1, 2, 3]})
    assert ids == {"prompt_token_ids": [1, 2, 3]}
    assert to_submit_kwargs("completions", {"prompt": [[4, 5]]}) == {"prompt_token_ids": [4, 5]}
    for bad in (None, "", [], ["a", "b"], [1, -1], {"x": 1}, [1.5]):
        with pytest.raises(BadRequest) as info:
            to_submit_kwargs("completions", {"prompt": bad})
        assert info.value.param == "prompt" and info.value.status == 400


def test_chat_messages_and_token_limits() -> None:
    kwargs = to_submit_kwargs(
        "chat",
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok", "name": "bot"},
            ],
            max_completion_tokens=5,
        ),
    )
    assert kwargs["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok"},
    ]
    assert kwargs["max_tokens"] == 5
    # Chat without a bound runs to the context, as OpenAI's does; completions default to 16.
    assert to_submit_kwargs("chat", chat())["max_tokens"] is None
    assert "max_tokens" not in to_submit_kwargs("completions", {"prompt": "x"})
    SamplingParams.from_dict(params_of(to_submit_kwargs("chat", chat())))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (chat(messages=[{"role": "user", "content": None}]), "messages[0].content"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content",
        ),
        (chat(messages=["hi"]), "messages[0]"),
        (chat(tools=[{"type": "function"}]), "tools"),
        (chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format"),
        (chat(response_format={"type": "xml"}), "response_format"),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"schema": {"if": {}}}}),
            "response_format",
        ),
        (chat(structured_outputs={"regex": "(?=a)"}), "structured_outputs"),
        (
            chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
            "response_format",
        ),
        (chat(n=17), "n"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=4, max_completion_tokens=5), "max_tokens"),
        (chat(temperature=-0.1), "temperature"),
        (chat(temperature="hot"), "temperature"),
        (chat(temperature=math.nan), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(top_k=-2), "top_k"),
        (chat(min_p=1.5), "min_p"),
        (chat(presence_penalty=3), "presence_penalty"),
        (chat(repetition_penalty=0), "repetition_penalty"),
        (chat(seed=2**63), "seed"),
        (chat(seed=1.0), "seed"),
        (chat(max_tokens=3, min_tokens=4), "min_tokens"),
        (chat(stop=[""]), "stop"),
        (chat(stop=["x"] * 17), "stop"),
        (chat(stop_token_ids=[-1]), "stop_token_ids"),
        (chat(ignore_eos="yes"), "ignore_eos"),
        (chat(logit_bias={"a": 1}), "logit_bias"),
        (chat(logit_bias={"1": 101}), "logit_bias"),
        (chat(logprobs=1), "logprobs"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(user="no spaces please"), "user"),
        (chat(priority=True), "priority"),
        (chat(priority=2**31), "priority"),
        (chat(lane="fast"), "lane"),
        (chat(lane="batch", priority=-1), "lane"),
        (chat(stream="yes"), "stream"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(model=5), "model"),
        (chat(frobnicate=1), "frobnicate"),
        ({"model": "m", "prompt": "x"}, "prompt"),
    ],
)
def test_bad_chat_fields_are_named(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        to_submit_kwargs("chat", body)
    assert info.value.param == param
    assert info.value.status == 400
    error = info.value.body()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize(
    ("field", "value"), [("echo", "yes"), ("best_of", 2), ("suffix", "end"), ("logprobs", 21)]
)
def test_unsupported_completion_options(field: str, value: object) -> None:
    with pytest.raises(BadRequest) as info:
        to_submit_kwargs("completions", {"prompt": "x", field: value})
    assert info.value.param == field


def test_neutral_values_of_unsupported_options_pass() -> None:
    body = {"prompt": "x", "n": 1, "best_of": 1, "echo": False, "suffix": None, "user": ""}
    assert to_submit_kwargs("completions", body) == {"prompt": "x"}
    body = chat(tool_choice="none", tools=[], response_format={"type": "text"}, top_k=0)
    assert "top_k" not in to_submit_kwargs("chat", body)


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("temperature", [0, 0.005, 2, 100, 100.5, -1e-9]),
        ("top_p", [1e-6, 1, 1.01]),
        ("min_p", [0, 1, 1.0001]),
        ("presence_penalty", [-2, 2, 2.1]),
        ("frequency_penalty", [-2.1, 0]),
        ("repetition_penalty", [0.01, 0.0099, 10, 10.01]),
        ("top_k", [-1, 1, 5, -3]),
        ("seed", [-(2**63), 2**63 - 1, 2**63]),
        ("max_tokens", [1, 0, 4096]),
        ("min_tokens", [0, 5, -1]),
    ],
)
def test_ranges_are_the_engines(name: str, values: list[float]) -> None:
    """The gateway accepts a value exactly when the engine would: it never lets through
    what a worker refuses, nor refuses what the engine can run."""
    for value in values:
        body = {"prompt": "x", name: value}
        if name == "min_tokens":
            body["max_tokens"] = 10
        try:
            params = params_of(to_submit_kwargs("completions", body))
            gateway = True
        except BadRequest as exc:
            assert exc.param == name
            gateway = False
        try:
            SamplingParams.from_dict(
                {**({"max_tokens": 10} if name == "min_tokens" else {}), name: value}
            )
            engine = True
        except InvalidRequest:
            engine = False
        assert gateway == engine, (name, value)
        if gateway:
            SamplingParams.from_dict(params)


@pytest.mark.parametrize(
    ("fields", "params", "param"),
    [
        ({"temperature": "hot"}, {"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, {"top_p": 0}, "top_p"),
        ({"n": 17}, {"n": 17}, "n"),
        ({"seed": 2**63}, {"seed": 2**63}, "seed"),
        ({"max_completion_tokens": -1}, {"max_tokens": -1}, "max_completion_tokens"),
        ({"max_tokens": 2, "min_tokens": 3}, {"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"logprobs": True, "top_logprobs": -1}, {"logprobs": -1}, "top_logprobs"),
        ({"logit_bias": {"3": "up"}}, {"logit_bias": {"3": "up"}}, "logit_bias"),
        ({"stop": "x" * 300}, {"stop": "x" * 300}, "stop"),
        ({"stop_token_ids": [2] * 2000}, {"stop_token_ids": [2] * 2000}, "stop_token_ids"),
    ],
)
def test_a_refused_field_gets_the_contracts_message_and_the_requests_name(
    fields: dict, params: dict, param: str
) -> None:
    """What the gateway answers is what the client (sizes) and the worker (sizes, then
    values) say for the same job: one message per bad field."""
    with pytest.raises(BadRequest) as gateway:
        to_submit_kwargs("chat", chat(**fields))
    with pytest.raises(InvalidRequest) as contract:
        check_sizes(params)
        SamplingParams.from_dict(params)
    assert (gateway.value.message, gateway.value.param) == (contract.value.message, param)
    assert gateway.value.body()["error"]["code"] == contract.value.code == "invalid_params"
    job = make_request(messages=[{"role": "user", "content": "hi"}], **params)
    if param in ("stop", "stop_token_ids", "n"):  # a size: the client refuses it before Redis
        with pytest.raises(ProtocolError) as client:
            job.validate()
        assert (client.value.code, client.value.message) == (
            "invalid_params",
            gateway.value.message,
        )
    else:  # a value: left to the worker, whose SamplingParams refuses it as above
        job.validate()


def test_priority_and_lane() -> None:
    assert to_submit_kwargs("chat", chat(lane="interactive"))["priority"] == -1
    assert to_submit_kwargs("chat", chat(lane="batch", priority=5))["priority"] == 5
    assert "priority" not in to_submit_kwargs("chat", chat(lane="default"))


def test_rendering() -> None:
    assert rendering("chat", chat()).stream is False
    r = rendering("chat", chat(stream=True, stream_options={"include_usage": True}))
    assert r.stream and r.include_usage and r.logprobs is None
    assert rendering("chat", chat(logprobs=True)).logprobs == 0
    assert rendering("chat", chat(logprobs=True, top_logprobs=4)).logprobs == 4
    assert rendering("chat", chat(logprobs=False)).logprobs is None
    assert rendering("completions", {"prompt": "x", "logprobs": 2}).logprobs == 2


def done(text: str = "Hello world", reason: str = "stop") -> DoneEvent:
    return DoneEvent(text, reason, [5, 6], Usage(prompt_tokens=3, completion_tokens=2))


def test_response_bodies() -> None:
    chat_body = response_body("chat", "j1", "tiny", done(), 100)
    assert chat_body == {
        "id": "chatcmpl-j1",
        "object": "chat.completion",
        "created": 100,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    text = response_body("completions", "j2", "tiny", done(reason="length"), 7)
    assert text["object"] == "text_completion" and text["id"] == "cmpl-j2"
    assert text["choices"][0]["text"] == "Hello world"
    assert text["choices"][0]["finish_reason"] == "length"


def test_logprobs_rendering() -> None:
    lp = Logprobs()
    # The chosen token (6) is not the best one, and comes as the engine sends it: after
    # the top-n, always included.
    lp.add(TokenEvent(0, [5], "a", [[(5, -0.1), (9, -2.5)]]))
    lp.add(TokenEvent(1, [6], "b", [[(7, -0.2), (8, -1.0), (6, -3.0)]]))
    lp.add(TokenEvent(2, [3], "c"))  # no logprobs asked: nothing added
    rendered = lp.render("chat", 1)["content"]
    assert [c["token"] for c in rendered] == ["token_id:5", "token_id:6"]
    assert [c["logprob"] for c in rendered] == [-0.1, -3.0]
    assert rendered[1]["top_logprobs"] == [{"token": "token_id:7", "logprob": -0.2, "bytes": None}]
    legacy = lp.render("completions", 2)
    assert legacy["tokens"] == ["token_id:5", "token_id:6"]
    assert legacy["token_logprobs"] == [-0.1, -3.0]
    assert legacy["top_logprobs"] == [
        {"token_id:5": -0.1, "token_id:9": -2.5},
        {"token_id:7": -0.2, "token_id:8": -1.0},
    ]
    body = response_body(
        "chat", "j", "m", done(), 1, ChoiceLogprobs({0: lp}), Rendering(logprobs=0)
    )
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_chunks() -> None:
    first = chunk_body("chat", "j", "m", 1, role=True, include_usage=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    piece = chunk_body("chat", "j", "m", 1, text="hi")
    assert piece["choices"][0]["delta"] == {"content": "hi"} and "usage" not in piece
    end = chunk_body("chat", "j", "m", 1, finish_reason="stop")
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    text = chunk_body("completions", "j", "m", 1, text="x")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "x"
    usage = usage_chunk("chat", "j", "m", 1, done())
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5


def test_job_errors_map_to_statuses() -> None:
    assert job_error("prompt_too_long", "long").status == 400
    assert job_error("payload_too_large", "big").status == 413
    assert job_error("unknown_model", "who").status == 404
    deadline = job_error("deadline_exceeded", "late")
    assert deadline.status == 504 and deadline.body()["error"]["code"] == "deadline_exceeded"
    assert job_error("internal_error", "boom").status == 500


def test_not_an_object() -> None:
    with pytest.raises(BadRequest):
        to_submit_kwargs("chat", [1, 2])
    with pytest.raises(ValueError):
        to_submit_kwargs("edits", {})


# Any JSON a client can send: the known fields with values of every JSON type, nested.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "n", "stop", "seed", "logprobs", "top_logprobs", "logit_bias",
    "stream", "stream_options", "user", "presence_penalty", "frequency_penalty",
    "ignore_eos", "min_tokens", "response_format", "priority", "echo",
]  # fmt: skip


@given(
    kind=st.sampled_from(["chat", "completions"]),
    body=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6)
    | st.fixed_dictionaries(
        {"model": st.just("m"), "messages": st.just([{"role": "user", "content": "hi"}])},
        optional={f: _JSON for f in _FIELDS if f not in ("model", "messages")},
    ),
)
@settings(max_examples=200, deadline=None)
def test_any_json_body_is_a_job_or_a_400_never_another_exception(kind: str, body: dict) -> None:
    """What the gateway does with a parsed body before any Redis call: a refusal in
    OpenAI's shape (BadRequest) or a job the client accepts (else it would be a 500)."""
    try:
        kwargs = to_submit_kwargs(kind, body)
        rendering(kind, body)
    except BadRequest as exc:
        assert 400 <= exc.status < 500 and exc.body()["error"]["message"]
        return
    try:
        make_request(**kwargs).validate()
    except InvalidRequest as exc:
        assert exc.code and exc.message


def test_response_format_and_vllms_structured_outputs_become_the_jobs_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert to_submit_kwargs("chat", chat(response_format=fmt))["structured_outputs"] == {
        "json": schema
    }
    prompt = {"model": "m", "prompt": "hi"}
    json_mode = to_submit_kwargs(
        "completions", {**prompt, "response_format": {"type": "json_object"}}
    )
    assert json_mode["structured_outputs"] == {"json_object": True}
    extra = to_submit_kwargs("completions", {**prompt, "structured_outputs": {"choice": ["a"]}})
    assert extra["structured_outputs"] == {"choice": ["a"]}
    assert "structured_outputs" not in to_submit_kwargs(
        "chat", chat(response_format={"type": "text"})
    )
