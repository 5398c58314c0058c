"""`tokenq serve` end to end: the official `openai` SDK -> a real gateway (uvicorn, in its
own process) -> a real Redis -> a real worker process serving a tiny random Llama as
"tiny". What the gateway answers is compared with what tokenq's own Client gets for the
same job, token ids included."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import redis

from tests.faults import RedisServer, WorkerProcess, free_port
from tests.helpers import make_tiny_llama_dir
from tests.test_packaging import NO_TORCH
from tokenq.producer import Client, JobFailed
from tokenq.protocol import (
    NO_TENANT,
    ErrorEvent,
    InvalidRequest,
    Keys,
    ProtocolError,
    SamplingParams,
    check_sizes,
    pack,
)

MODEL = "tiny"
GRACE = 0.5  # the main gateway's --cancel-grace


class GatewayProcess:
    """`tokenq serve` in a subprocess on a free port; its log goes to a file."""

    def __init__(self, url: str, namespace: str, log: Path, *extra: str) -> None:
        self.port = free_port()
        cmd = [
            sys.executable, "-m", "tokenq.cli", "serve", "--redis-url", url,
            "--namespace", namespace, "--port", str(self.port), *extra,
        ]  # fmt: skip
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sdk(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", **kwargs)

    def async_sdk(self, **kwargs: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="none", **kwargs)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def namespace(redis_url: str) -> Iterator[str]:
    ns = f"tqgw-{uuid.uuid4().hex[:10]}"
    yield ns
    conn = redis.Redis.from_url(redis_url)
    for pattern in (f"{ns}:*", f"{ns}-empty:*"):
        keys = list(conn.scan_iter(match=pattern, count=1000))
        if keys:
            conn.delete(*keys)
    conn.close()


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, namespace: str
) -> Iterator[WorkerProcess]:
    root = tmp_path_factory.mktemp("gateway")
    model = make_tiny_llama_dir(root / "tiny")
    with WorkerProcess(
        model, redis_url, namespace, root / "worker.log", extra=["--max-num-seqs", "32"]
    ) as proc:
        proc.wait_registered()
        yield proc


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, namespace: str, worker: WorkerProcess
) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    proc = GatewayProcess(
        redis_url, namespace, log, "--cancel-grace", str(GRACE), "--max-body", "2M"
    )
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(redis_url: str, namespace: str) -> Iterator[Client]:
    with Client(redis_url, namespace=namespace, model=MODEL) as c:
        yield c


def ids_of(logprobs_content: list) -> list[int]:
    return [int(c.token.removeprefix("token_id:")) for c in logprobs_content]


def reply_types(conn: redis.Redis, namespace: str, job_id: str) -> list[bytes]:
    return [f[b"type"] for _, f in conn.xrange(f"{namespace}:reply:{job_id}")]


def wait_done(client: Client, job_id: str, timeout: float = 60):
    return client.job(job_id).result(timeout=timeout)


MESSAGES = [{"role": "user", "content": "Name three rivers."}]


# --- happy paths -------------------------------------------------------------------------


def test_models(gateway: GatewayProcess) -> None:
    models = gateway.sdk().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "tokenq"


def test_a_model_is_retrieved_by_name_and_an_unknown_one_is_a_404(gateway: GatewayProcess) -> None:
    sdk = gateway.sdk(max_retries=0)
    model = sdk.models.retrieve(MODEL)
    assert (model.id, model.owned_by) == (MODEL, "tokenq")
    with pytest.raises(openai.NotFoundError) as info:
        sdk.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_chat_greedy_equals_the_engines_tokens(gateway: GatewayProcess, client: Client) -> None:
    sdk = gateway.sdk()
    out = sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    direct = client.submit(messages=MESSAGES, max_tokens=12, temperature=0).result(timeout=60)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == direct.text
    assert ids_of(choice.logprobs.content) == direct.token_ids
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
    # Greedy: the chosen token is the most likely one.
    assert all(c.top_logprobs[0].token == c.token for c in choice.logprobs.content)
    assert choice.finish_reason == direct.finish_reason
    assert out.usage.prompt_tokens == direct.usage.prompt_tokens
    assert out.usage.completion_tokens == len(direct.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.object == "chat.completion" and out.model == MODEL


def test_completion_with_vllm_fields(gateway: GatewayProcess, client: Client) -> None:
    sdk = gateway.sdk()
    extra = {"top_k": 1, "min_tokens": 5, "repetition_penalty": 1.0, "ignore_eos": True}
    out = sdk.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=9, temperature=0,
        logprobs=1, extra_body=extra,
    )  # fmt: skip
    direct = client.submit(
        prompt="The capital of France is", max_tokens=9, temperature=0, ignore_eos=True
    ).result(timeout=60)
    choice = out.choices[0]
    assert choice.text == direct.text and choice.finish_reason == "length"
    assert [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens] == direct.token_ids
    assert out.usage.completion_tokens == 9
    assert out.usage.prompt_tokens == direct.usage.prompt_tokens
    # Token ids as the prompt, a batch of one.
    ids = sdk.completions.create(model=MODEL, prompt=[[1, 2, 3]], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_chat_stream_with_usage(gateway: GatewayProcess, client: Client) -> None:
    stream = gateway.sdk().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True,
    )  # fmt: skip
    chunks = list(stream)
    direct = client.submit(messages=MESSAGES, max_tokens=10, temperature=0).result(timeout=60)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.text
    ids = [
        i
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for i in ids_of(c.choices[0].logprobs.content)
    ]
    assert ids == direct.token_ids
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [direct.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(direct.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_response_format_json_schema_and_structured_outputs_hold(gateway: GatewayProcess) -> None:
    """The random tiny model left alone writes no JSON; constrained, every answer parses and
    validates (the schema is short: its enum and booleans leave little to sample)."""
    sdk = gateway.sdk(max_retries=0)
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    out = sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, response_format=fmt
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    choice = sdk.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=8, temperature=1.0, seed=5,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )  # fmt: skip
    assert choice.choices[0].text in ("red", "green", "blue")
    with pytest.raises(openai.BadRequestError) as info:
        bad = {"type": "json_schema", "json_schema": {"schema": {"uniqueItems": True}}}
        sdk.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=bad)
    assert info.value.body["param"] == "response_format"
    assert "uniqueItems" in info.value.body["message"]


def test_completion_stream_raw_sse(gateway: GatewayProcess) -> None:
    """The wire itself: ids on the events, `data: [DONE]` last."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{gateway.base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert any(line.startswith("id: 0-") for line in lines)


def test_async_sdk(gateway: GatewayProcess, client: Client) -> None:
    asyncio.run(async_sdk(gateway, client))


async def async_sdk(gateway: GatewayProcess, client: Client) -> None:
    sdk = gateway.async_sdk()
    out = await sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
    )
    stream = await sdk.completions.create(
        model=MODEL, prompt="Hi", max_tokens=6, temperature=0, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    direct = client.submit(messages=MESSAGES, max_tokens=6, temperature=0).result(timeout=60)
    assert out.choices[0].message.content == direct.text
    assert text == client.submit(prompt="Hi", max_tokens=6, temperature=0).result(timeout=60).text
    await sdk.close()


def test_200_concurrent_streams(gateway: GatewayProcess) -> None:
    asyncio.run(concurrent_streams(gateway, 200))


async def concurrent_streams(gateway: GatewayProcess, count: int) -> None:
    sdk = gateway.async_sdk(max_retries=0)

    async def one(i: int) -> tuple[str, int]:
        stream = await sdk.completions.create(
            model=MODEL, prompt=f"Request {i}:", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), 240)
    assert [u for _, u in results] == [6] * count
    await sdk.close()


# --- idempotency, reconnects, disconnects -----------------------------------------------


def test_idempotency_key_runs_once(
    gateway: GatewayProcess, redis_conn: redis.Redis, namespace: str
) -> None:
    key = f"idem-{uuid.uuid4().hex}"
    sdk = gateway.sdk()
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0.9}
    a = sdk.chat.completions.create(**args, extra_headers={"Idempotency-Key": key})
    b = sdk.chat.completions.create(**args, extra_headers={"Idempotency-Key": key})
    assert a.id == b.id == f"chatcmpl-{key}"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert reply_types(redis_conn, namespace, key).count(b"done") == 1
    # Retries racing the first request, the job still running: one run as well.
    key = f"idem-{uuid.uuid4().hex}"
    long = {**args, "max_tokens": 200, "extra_body": {"ignore_eos": True}}
    with ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(
                lambda _: sdk.chat.completions.create(
                    **long, extra_headers={"Idempotency-Key": key}
                ),
                range(4),
            )
        )
    assert len({o.choices[0].message.content for o in outs}) == 1
    assert reply_types(redis_conn, namespace, key).count(b"done") == 1
    assert reply_types(redis_conn, namespace, key).count(b"token") >= 1
    # Without a key, two calls are two jobs.
    c = sdk.chat.completions.create(**args)
    assert c.id != a.id


def test_stream_reconnect_continues(
    gateway: GatewayProcess, client: Client, redis_conn: redis.Redis, namespace: str
) -> None:
    key = f"resume-{uuid.uuid4().hex}"
    sdk = gateway.sdk(max_retries=0)
    args = {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0,
        "stream": True, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    # (max_tokens: long enough that the job runs on while the gateway sees the drop, on a
    # fast host too)
    stream = sdk.completions.create(**args, extra_headers={"Idempotency-Key": key})
    first = ""
    for n, chunk in enumerate(stream):
        first += chunk.choices[0].text
        if n == 5:
            break
    stream.close()  # the connection drops mid-generation
    # The retry comes once the gateway has seen the drop (it bookmarks the last event it
    # sent), within the cancel grace: the job keeps running for it. (A retry that comes
    # sooner, without Last-Event-ID, gets the stream from its start.)
    deadline = time.monotonic() + 10
    while not redis_conn.exists(f"{namespace}:gw:sent:{key}"):
        assert time.monotonic() < deadline, "the gateway did not see the client leave"
        time.sleep(0.01)
    again = sdk.completions.create(**args, extra_headers={"Idempotency-Key": key})
    rest = "".join(c.choices[0].text for c in again if c.choices)
    done = wait_done(client, key)
    assert done.finish_reason == "length"
    assert first + rest == done.text  # nothing repeated, nothing lost


def test_stream_resume_from_last_event_id(gateway: GatewayProcess, client: Client) -> None:
    key = f"lei-{uuid.uuid4().hex}"
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 200,  # several events, however fast the host: one per stream interval
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Idempotency-Key": key, "X-Tokenq-Keep-Running": "1"}
    url = f"{gateway.base}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    done = wait_done(client, key)
    ids = [line[4:] for line in lines if line.startswith("id: ")]
    assert len(ids) >= 4, lines
    cut = ids[len(ids) // 2]  # as if the client had seen the first half
    with httpx.stream(
        "POST", url, json=body, headers={**headers, "Last-Event-ID": cut}, timeout=60
    ) as r:
        tail = [line for line in r.iter_lines() if line]

    def texts(ls: list[str]) -> str:
        return "".join(
            json.loads(ln[6:])["choices"][0]["text"]
            for ln in ls
            if ln.startswith("data: {") and json.loads(ln[6:])["choices"]
        )

    head = texts(lines[: lines.index(f"id: {cut}") + 2])
    assert head + texts(tail) == done.text
    assert tail[-1] == "data: [DONE]"
    # A client that saw everything gets the end at once.
    last = ids[-1]
    with httpx.stream(
        "POST", url, json=body, headers={**headers, "Last-Event-ID": last}, timeout=10
    ) as r:
        assert [line for line in r.iter_lines() if line] == ["data: [DONE]"]


def test_dropped_stream_cancels_the_job(gateway: GatewayProcess, client: Client) -> None:
    key = f"drop-{uuid.uuid4().hex}"
    stream = gateway.sdk(max_retries=0).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1500, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"Idempotency-Key": key},
    )  # fmt: skip
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    done = wait_done(client, key)
    assert done.finish_reason == "cancelled"
    assert done.usage.completion_tokens < 1500


def test_keep_running_header(gateway: GatewayProcess, client: Client) -> None:
    key = f"keep-{uuid.uuid4().hex}"
    stream = gateway.sdk(max_retries=0).completions.create(
        model=MODEL, prompt="Go", max_tokens=150, stream=True, extra_body={"ignore_eos": True},
        extra_headers={"Idempotency-Key": key, "X-Tokenq-Keep-Running": "1"},
    )  # fmt: skip
    next(iter(stream))
    stream.close()
    done = wait_done(client, key)  # its end, not a cancel: the gateway left it running
    assert done.finish_reason == "length" and done.usage.completion_tokens == 150


def test_dropped_request_cancels_the_job(gateway: GatewayProcess, client: Client) -> None:
    """Not streamed: the client gives up waiting (its timeout), the job is cancelled."""
    key = f"gone-{uuid.uuid4().hex}"
    sdk = gateway.sdk(max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        sdk.completions.create(
            model=MODEL, prompt="Go", max_tokens=1500, extra_body={"ignore_eos": True},
            extra_headers={"Idempotency-Key": key},
        )  # fmt: skip
    assert wait_done(client, key).finish_reason == "cancelled"


def register_ghost(conn: redis.Redis, namespace: str, model: str) -> None:
    """A live worker in the registry that never takes a job: requests for its model are
    accepted and wait in the queue for as long as a test needs."""
    now = time.time()
    info = {"names": json.dumps([model]), "max_model_len": 2048, "host": "ghost", "pid": 1}
    conn.hset(f"{namespace}:worker:ghost", mapping={**info, "heartbeat_at": now})
    conn.zadd(f"{namespace}:workers", {"ghost": int(now * 1000)})


@pytest.fixture(scope="module")
def ghost_gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, namespace: str
) -> Iterator[GatewayProcess]:
    """A gateway of its own namespace whose one "worker" takes nothing."""
    ns = f"{namespace}-ghost"
    conn = redis.Redis.from_url(redis_url)
    register_ghost(conn, ns, "ghost")
    log = tmp_path_factory.mktemp("ghost-gw") / "gateway.log"
    proc = GatewayProcess(redis_url, ns, log, "--cancel-grace", "0.1")
    yield proc
    proc.close()
    conn.delete(*conn.scan_iter(match=f"{ns}:*", count=1000))
    conn.close()


def test_serve_says_where_it_listens_which_redis_and_the_models_it_sees(
    ghost_gateway: GatewayProcess,
) -> None:
    lines = [line for line in ghost_gateway.log.read_text().splitlines() if "tokenq" in line]
    assert f"listening on http://127.0.0.1:{ghost_gateway.port}" in lines[0], lines
    assert "redis://127.0.0.1:6379/0" in lines[0] or "Redis redis://" in lines[0], lines
    assert "-ghost; models: ghost" in lines[0], lines


def test_a_client_that_leaves_before_its_first_token_is_one_info_line(
    ghost_gateway: GatewayProcess,
) -> None:
    """Streamed or not, with or without an Idempotency-Key: the job is cancelled and the
    log says so in one line, with no traceback."""
    body = {"model": "ghost", "messages": MESSAGES}
    for stream in (False, True):
        for key in (f"left-{uuid.uuid4().hex}", None):
            headers = {"Idempotency-Key": key} if key else {}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{ghost_gateway.base}/v1/chat/completions",
                    json={**body, "stream": stream}, headers=headers, timeout=0.5,
                )  # fmt: skip
    log = ghost_gateway.log
    deadline = time.monotonic() + 20
    while log.read_text().count("its client left before the end; cancelled") < 4:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
    assert text.count("its client left") == 4, text[-3000:]


# --- errors ------------------------------------------------------------------------------


def job_keys(conn: redis.Redis, namespace: str) -> int:
    return len(list(conn.scan_iter(match=f"{namespace}:job:*", count=1000)))


def test_bad_requests_never_reach_the_queue(
    gateway: GatewayProcess, redis_conn: redis.Redis, namespace: str
) -> None:
    sdk = gateway.sdk(max_retries=0)
    before = job_keys(redis_conn, namespace)
    cases = [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 17}, "n"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"priority": "high"}}, "priority"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"user": "has spaces"}, "user"),
        ({"extra_headers": {"Idempotency-Key": "bad key!"}}, "Idempotency-Key"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model=MODEL, messages=MESSAGES, **extra)
        assert info.value.status_code == 400
        assert info.value.body["param"] == param, (extra, info.value.body)
        assert info.value.body["message"]
    # Not JSON at all.
    r = httpx.post(f"{gateway.base}/v1/chat/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert job_keys(redis_conn, namespace) == before


def test_text_no_encoding_holds_and_json_nested_past_the_parser_are_400s(
    gateway: GatewayProcess,
) -> None:
    """Every input gets a 4xx in OpenAI's shape, never a plain-text 500."""
    lone = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]})
    for body in (lone, "[" * 100_000):
        answer = httpx.post(
            f"{gateway.base}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error", error
    assert "not valid Unicode" in error["message"] or "nested" in error["message"]


def add_raw_job(conn: redis.Redis, namespace: str, job_id: str, params: dict) -> None:
    """A job XADDed as a producer that skips the client would (one transaction, as the
    submit script is one)."""
    keys = Keys(namespace)
    with conn.pipeline(transaction=True) as pipe:
        pipe.zadd(keys.queues(MODEL), {f"0:{NO_TENANT}": 0})
        data = pack({"messages": MESSAGES, "params": params})
        pipe.xadd(keys.queue(MODEL, 0, NO_TENANT), {"v": "2", "id": job_id, "data": data})
        pipe.execute()


def test_a_bad_field_is_refused_with_one_message_whichever_way_it_comes_in(
    gateway: GatewayProcess, client: Client, redis_conn: redis.Redis, namespace: str
) -> None:
    """The gateway's 400, the client's refusal and the worker's error event for one bad
    field carry one message, the contract's (`SamplingParams`, `check_sizes`); the 400's
    `param` is the field as the request named it."""
    sdk = gateway.sdk(max_retries=0)

    def gateway_error(extra: dict) -> dict:
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model=MODEL, messages=MESSAGES, **extra)
        assert info.value.status_code == 400
        return info.value.body

    def worker_error(job_id: str) -> ErrorEvent:
        (event,) = client.job(job_id).stream(timeout=30)
        assert isinstance(event, ErrorEvent) and event.code == "invalid_params"
        return event

    # Values: the client leaves them to the worker, which refuses with SamplingParams's text.
    values = [
        ({"temperature": -1}, {"temperature": -1}, "temperature"),
        ({"max_completion_tokens": 0}, {"max_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, {"logprobs": 21}, "top_logprobs"),
        ({"extra_body": {"logit_bias": {"7": 101}}}, {"logit_bias": {"7": 101}}, "logit_bias"),
        ({"extra_body": {"top_k": -5}}, {"top_k": -5}, "top_k"),
    ]
    for extra, params, param in values:
        with pytest.raises(InvalidRequest) as contract:
            SamplingParams.from_dict(params)
        message = contract.value.message
        assert message.startswith(f"{next(iter(params))}: ")
        body = gateway_error(extra)
        assert (body["message"], body["param"], body["code"]) == (message, param, "invalid_params")
        assert worker_error(client.submit(messages=MESSAGES, **params).id).message == message

    # Sizes: the client refuses before Redis; a producer that skips it meets the worker.
    sizes = [
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
        ({"extra_body": {"stop_token_ids": [1] * 1025}}, "stop_token_ids"),
    ]
    for extra, param in sizes:
        params = extra.get("extra_body", extra)
        with pytest.raises(InvalidRequest) as contract:
            check_sizes(params)
        message = contract.value.message
        body = gateway_error(extra)
        assert (body["message"], body["param"], body["code"]) == (message, param, "invalid_params")
        with pytest.raises(ProtocolError) as refused:
            client.submit(messages=MESSAGES, **params)
        assert (refused.value.code, refused.value.message) == ("invalid_params", message)
        job_id = f"raw-{uuid.uuid4().hex[:12]}"
        add_raw_job(redis_conn, namespace, job_id, params)
        assert worker_error(job_id).message == message


def test_worker_refusal_is_a_400(gateway: GatewayProcess) -> None:
    """A prompt longer than the worker's context is known only to the worker: the
    streamed request still gets its status, since no token was sent before."""
    sdk = gateway.sdk(max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            out = sdk.completions.create(
                model=MODEL, prompt=list(range(5000)), max_tokens=2, stream=stream
            )
            list(out) if stream else None
        assert info.value.body["code"] == "prompt_too_long"


def test_a_token_id_outside_the_vocabulary_is_a_400_naming_its_field(
    gateway: GatewayProcess,
) -> None:
    """Only the worker knows the vocabulary: its refusal still names the field."""
    sdk = gateway.sdk(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"999999": 5})
    error = info.value.body
    assert (error["code"], error["param"]) == ("invalid_params", "logit_bias"), error
    assert "outside the vocabulary" in error["message"]


def test_max_tokens_past_the_models_context_is_a_400_at_the_door_and_in_the_worker(
    gateway: GatewayProcess, redis_url: str, namespace: str
) -> None:
    sdk = gateway.sdk(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=1_000_000_000)
    error = info.value.body
    assert (error["code"], error["param"]) == ("invalid_params", "max_tokens"), error
    assert "context of 2048 tokens" in error["message"]
    # A producer that skips the registry: the worker counts the prompt and refuses.
    with Client(redis_url, namespace=namespace, model=MODEL, require_worker=False) as client:
        job = client.submit(prompt="a few words of prompt", max_tokens=2047, queue_anyway=True)
        with pytest.raises(JobFailed) as failed:
            job.result(timeout=60)
    assert failed.value.code == "invalid_params"
    assert failed.value.message.startswith("max_tokens: 2047 tokens after a prompt of ")


def test_unknown_model_404(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        gateway.sdk(max_retries=0).chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"


def test_payload_too_large_413(gateway: GatewayProcess) -> None:
    sdk = gateway.sdk(max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:  # over the gateway's --max-body 2M
        sdk.completions.create(model=MODEL, prompt="x" * (3 << 20))
    assert info.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as info:  # over a job's prompt limit
        sdk.completions.create(model=MODEL, prompt="x" * 1_200_000)
    assert info.value.status_code == 413
    assert info.value.body["code"] == "payload_too_large"


def test_deadline_504(gateway: GatewayProcess) -> None:
    sdk = gateway.sdk(max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        sdk.completions.create(
            model=MODEL, prompt="Go", max_tokens=1500, extra_body={"ignore_eos": True},
            extra_headers={"X-Tokenq-Timeout": "0.3"},
        )  # fmt: skip
    assert info.value.status_code == 504
    assert info.value.body["code"] == "deadline_exceeded"


def test_queue_full_429(
    tmp_path: Path, redis_url: str, namespace: str, gateway: GatewayProcess, client: Client
) -> None:
    full = GatewayProcess(
        redis_url, namespace, tmp_path / "full.log", "--max-backlog", "1", "--retry-after", "7",
        "--cancel-grace", str(GRACE),
    )  # fmt: skip
    try:
        sdk = full.sdk(max_retries=0)
        key = f"hog-{uuid.uuid4().hex}"
        hog = sdk.completions.create(
            model=MODEL, prompt="Go", max_tokens=2000, stream=True,
            extra_body={"ignore_eos": True, "lane": "batch"},
            extra_headers={"Idempotency-Key": key},
        )  # fmt: skip
        next(iter(hog))  # running: the batch lane holds one job
        with pytest.raises(openai.RateLimitError) as info:
            sdk.completions.create(
                model=MODEL, prompt="Go", max_tokens=2, extra_body={"lane": "batch"}
            )
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == "7"
        assert info.value.body["code"] == "queue_full"
        # Another lane is not full.
        ok = sdk.completions.create(
            model=MODEL, prompt="Go", max_tokens=2, extra_body={"lane": "interactive"}
        )
        assert ok.usage.completion_tokens == 2
        hog.close()
        assert wait_done(client, key).finish_reason == "cancelled"
    finally:
        full.close()


def test_no_live_worker_503(tmp_path: Path, redis_url: str, namespace: str) -> None:
    empty = GatewayProcess(redis_url, f"{namespace}-empty", tmp_path / "empty.log")
    try:
        with pytest.raises(openai.InternalServerError) as info:
            empty.sdk(max_retries=0).chat.completions.create(model=MODEL, messages=MESSAGES)
        assert info.value.status_code == 503
        assert info.value.body["code"] == "no_live_worker"
        assert empty.sdk().models.list().data == []
    finally:
        empty.close()


def test_gateway_restart_loses_nothing(
    tmp_path: Path, redis_url: str, namespace: str, worker: WorkerProcess, client: Client
) -> None:
    """A job keeps running when its gateway dies; another gateway gives its answer to the
    client's retry (same key)."""
    first = GatewayProcess(redis_url, namespace, tmp_path / "a.log", "--cancel-grace", "30")
    key = f"restart-{uuid.uuid4().hex}"
    args = {
        "model": MODEL,
        "prompt": "Go",
        "max_tokens": 300,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    try:
        stream = first.sdk(max_retries=0).completions.create(
            **args, stream=True, extra_headers={"Idempotency-Key": key}
        )
        next(iter(stream))
        first.proc.kill()  # no goodbye: nothing of this gateway's may matter
        first.proc.wait(timeout=10)
    finally:
        first.close()
    second = GatewayProcess(redis_url, namespace, tmp_path / "b.log")
    try:
        out = second.sdk().completions.create(**args, extra_headers={"Idempotency-Key": key})
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].text == wait_done(client, key).text
        assert out.usage.completion_tokens == 300
    finally:
        second.close()


def test_unknown_route_in_openai_shape(gateway: GatewayProcess) -> None:
    r = httpx.get(f"{gateway.base}/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_serve_without_fastapi_says_what_to_install(tmp_path: Path) -> None:
    """A client-only install lists `serve` and names the extra (fastapi hidden here)."""
    (tmp_path / "fastapi").mkdir()
    (tmp_path / "fastapi" / "__init__.py").write_text("raise ImportError(name='fastapi')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "tokenq.cli", "serve"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2
    assert "pip install 'tokenq[serve]'" in out.stderr


def test_a_full_redis_is_a_503_and_the_same_request_succeeds_once_it_has_room(
    tmp_path: Path,
) -> None:
    """Redis at maxmemory under noeviction refuses the submit: the SDK gets a 503 that
    says so (it was a 500 and a traceback in the log), and nothing is queued; the same
    request goes through once Redis has room again."""
    model = make_tiny_llama_dir(tmp_path / "tiny")
    with RedisServer(tmp_path / "redis", aof=False) as server:
        with WorkerProcess(model, server.url, "full", tmp_path / "worker.log") as worker:
            worker.wait_registered()
            gateway = GatewayProcess(server.url, "full", tmp_path / "gateway.log")
            try:
                sdk = gateway.sdk(max_retries=0)
                admin = server.client()
                admin.config_set("maxmemory", "1")
                with pytest.raises(openai.InternalServerError) as refused:
                    sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4)
                assert refused.value.status_code == 503
                assert "Redis refused" in refused.value.message, refused.value.message
                assert not admin.keys("full:job:*")
                admin.config_set("maxmemory", "0")
                done = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4)
                assert done.usage is not None and done.usage.completion_tokens == 4
            finally:
                gateway.close()
        assert "Traceback" not in (tmp_path / "gateway.log").read_text()


def test_the_gateway_needs_no_torch() -> None:
    script = NO_TORCH + (
        "from tokenq.server.gateway import GatewayConfig, create_app\n"
        "app = create_app(GatewayConfig())\n"
        "assert not [m for m in sys.modules if m.startswith(('torch', 'tokenq.engine'))]\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_bench_gateway_runs(tmp_path: Path, redis_url: str) -> None:
    """`tokenq bench gateway` end to end on a tiny workload: both sides run, it reports."""
    model = make_tiny_llama_dir(tmp_path / "tiny")
    cmd = [
        sys.executable, "-m", "tokenq.cli", "bench", "gateway", "--model", str(model),
        "--device", "cpu", "--dtype", "float32", "--num-threads", "1",
        "--redis-url", redis_url, "--port", str(free_port()), "--requests", "4",
        "--prompt-len", "8", "--gen", "4", "--latency-requests", "3", "--repeat", "1",
        "--log", str(tmp_path / "gateway.log"), "--no-warm-up",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gateway/Client throughput" in out.stdout
    assert "added TTFT, median of the pairs" in out.stdout
    assert "3 requests of 16 tokens + 4 each way" in out.stdout
