"""Nobody reads another's jobs: API keys, ownership of jobs, files and batches, who may jump
the queue, per-key limits shared by every gateway, and what the logs hold.

Real parts throughout: the official `openai` SDK and raw HTTP against two `tokenq serve`
processes sharing one key file and one Redis, and a worker process on a tiny random
Llama ("tiny"). Limits are counted in Redis, so the two gateways enforce one budget.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.faults import WorkerProcess, free_port
from tests.helpers import make_tiny_llama_dir
from tests.test_batch_api import jsonl, line, upload, wait_status
from tests.test_gateway import GatewayProcess, register_ghost
from tests.waits import wait_for
from tokenq.cli.serve import api_keys
from tokenq.protocol import unpack
from tokenq.server.auth import KeyFileError, Policy, digest_of, parse_keys, principal_id

MODEL = "tiny"
ADMIN = "admin-" + uuid.uuid4().hex
KEYS = {name: f"sk-{name}-{uuid.uuid4().hex}" for name in "a b r t s c q p m w d".split()}
# Every key's line in the shared key file: tenant, then its own limits and rights.
KEY_LINES = {
    "a": "acme",
    "b": "globex",
    "r": "- rpm=5",  # requests a minute, shared by both gateways
    "t": "- tpm=200",  # tokens a minute, shared by both gateways
    "s": "- tpm=100000",  # settled to the real usage
    "c": "- concurrent=1",
    "q": "- storage=1K",
    "p": "- lanes=interactive,default,batch priority=-5..5",
    "m": "- rpm=1000 tpm=100000",  # a batch's lines counted
    "w": "- rpm=2",  # a batch waits for its key's budget
}


def key_file(path: Path) -> Path:
    lines = [f"{KEYS[name]} {rest}" for name, rest in KEY_LINES.items()]
    # A key given by its SHA-256 alone (the file then holds no key at all).
    lines.append(f"sha256:{hashlib.sha256(KEYS['d'].encode()).hexdigest()}  digested  # comment")
    path.write_text("# key  tenant  options\n" + "\n".join(lines) + "\n")
    return path


def pid(name: str) -> str:
    return principal_id(hashlib.sha256(KEYS[name].encode()).digest())


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def sdk(gateway: GatewayProcess, name: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base}/v1", api_key=KEYS[name], **kwargs)


@pytest.fixture(scope="module")
def namespace(redis_url: str) -> Iterator[str]:
    ns = f"tqsec-{uuid.uuid4().hex[:10]}"
    yield ns
    conn = redis.Redis.from_url(redis_url)
    keys = list(conn.scan_iter(match=f"{ns}:*", count=1000))
    if keys:
        conn.delete(*keys)
    conn.close()


@pytest.fixture(scope="module")
def conn(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, namespace: str
) -> Iterator[WorkerProcess]:
    root = tmp_path_factory.mktemp("security")
    model = make_tiny_llama_dir(root / "tiny")
    with WorkerProcess(
        model, redis_url, namespace, root / "worker.log", extra=["--max-num-seqs", "32"]
    ) as proc:
        proc.wait_registered()
        yield proc


@pytest.fixture(scope="module")
def gateways(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, namespace: str, worker: WorkerProcess
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    root = tmp_path_factory.mktemp("security-gw")
    keys = key_file(root / "keys.txt")
    args = ("--api-keys-file", str(keys), "--admin-key", ADMIN, "--batch-poll", "0.2")
    args += ("--cancel-grace", "0.3")
    one = GatewayProcess(redis_url, namespace, root / "one.log", *args)
    two = GatewayProcess(redis_url, namespace, root / "two.log", *args)
    yield one, two
    one.close()
    two.close()


@pytest.fixture(scope="module")
def gateway(gateways: tuple[GatewayProcess, GatewayProcess]) -> GatewayProcess:
    return gateways[0]


def complete(gateway: GatewayProcess, name: str, **body: Any) -> httpx.Response:
    headers = {**auth(name), **body.pop("headers", {})}
    payload = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **body}
    return httpx.post(f"{gateway.base}/v1/completions", json=payload, headers=headers, timeout=60)


# --- keys ------------------------------------------------------------------------------


def test_a_key_file_is_read_whole_or_refused_naming_the_line_never_the_key() -> None:
    defaults = Policy(requests_per_minute=60)
    secret = "sk-" + uuid.uuid4().hex
    table = parse_keys(
        f"# comment\n{secret} acme tpm=10 lanes=interactive,default priority=-3..3\n"
        f"sha256:{'ab' * 32} -  # digest only\n",
        defaults,
    )
    digest = digest_of(secret)
    acme = table[digest]
    assert acme.tenant == "acme" and acme.id == principal_id(digest) == digest.hex()[:16]
    assert acme.policy.requests_per_minute == 60 and acme.policy.tokens_per_minute == 10
    assert acme.policy.lanes == {"interactive", "default"}
    assert (acme.policy.min_priority, acme.policy.max_priority) == (-3, 3)
    assert table[bytes.fromhex("ab" * 32)].tenant is None
    for bad, why in (
        (f"{secret}\n", "needs a key and a tenant"),
        (f"{secret} has/slash\n", "tenant must match"),
        (f"{secret} acme rpm=lots\n", "invalid literal"),
        (f"{secret} acme speed=9\n", "unknown option"),
        (f"{secret} acme lanes=vip\n", "lanes must be among"),
        (f"{secret} acme priority=5..1\n", "low first"),
        (f"{secret} acme\n{secret} globex\n", "line 2: the same key twice"),
        ("sha256:abc acme\n", "64 hex digits"),
    ):
        with pytest.raises(KeyFileError) as info:
            parse_keys(bad, defaults)
        assert why in str(info.value) and secret not in str(info.value)


def test_api_keys_come_from_flags_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENQ_API_KEY", " k1, k2 ,,")
    assert api_keys([]) == ("k1", "k2")
    assert api_keys(["flag"]) == ("flag",)
    monkeypatch.delenv("TOKENQ_API_KEY")
    assert api_keys([]) == ()


def test_no_key_or_a_wrong_key_is_401_in_openais_shape_and_health_stays_open(
    gateway: GatewayProcess,
) -> None:
    wrong = "sk-wrong-" + uuid.uuid4().hex
    for headers in ({}, {"Authorization": f"Bearer {wrong}"}, {"Authorization": "Basic x"}):
        for method, path in (
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("GET", "/v1/files"),
            ("GET", "/v1/batches"),
            ("GET", "/v1/nothing"),
        ):
            r = httpx.request(method, f"{gateway.base}{path}", headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, r.text)
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert wrong not in r.text
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{gateway.base}/v1", api_key=wrong, max_retries=0).models.list()
    assert info.value.code == "invalid_api_key"
    # A 20 MB body without a key is refused before it is read.
    r = httpx.post(f"{gateway.base}/v1/completions", content=b"x" * (20 << 20), timeout=30)
    assert r.status_code == 401
    assert httpx.get(f"{gateway.base}/health", timeout=10).status_code == 200
    # Keys from the file work, one given by its digest alone too.
    for name in ("a", "d"):
        assert [m.id for m in sdk(gateway, name).models.list().data] == [MODEL]


def test_operator_routes_need_the_admin_key(gateway: GatewayProcess) -> None:
    for path in ("/metrics", "/dashboard", "/dashboard/data"):
        assert httpx.get(f"{gateway.base}{path}", timeout=10).status_code == 401
        # An API key is not the admin key.
        assert httpx.get(f"{gateway.base}{path}", headers=auth("a"), timeout=10).status_code == 401
        ok = httpx.get(f"{gateway.base}{path}", headers={"Authorization": f"Bearer {ADMIN}"})
        assert ok.status_code == 200, ok.text
    # A browser asked for Basic credentials sends the admin key as the password.
    page = httpx.get(f"{gateway.base}/dashboard", timeout=10)
    assert page.headers["www-authenticate"].startswith("Basic")
    assert httpx.get(f"{gateway.base}/dashboard/data", auth=("ops", ADMIN)).status_code == 200


# --- ownership ---------------------------------------------------------------------------


def test_another_key_with_the_same_idempotency_key_gets_its_own_job(
    gateway: GatewayProcess,
) -> None:
    idem = f"shared-{uuid.uuid4().hex}"
    secret = {"messages": [{"role": "user", "content": "My password is hunter2, repeat it"}]}
    other = {"messages": [{"role": "user", "content": "What is 2+2?"}]}
    args = {"model": MODEL, "max_tokens": 24, "temperature": 0}
    a = sdk(gateway, "a").chat.completions.with_raw_response.create(
        **args, **secret, extra_headers={"Idempotency-Key": idem}
    )
    b = sdk(gateway, "b").chat.completions.with_raw_response.create(
        **args, **other, extra_headers={"Idempotency-Key": idem}
    )
    a_job, b_job = a.headers["x-tokenq-job-id"], b.headers["x-tokenq-job-id"]
    assert a_job != b_job and idem not in (a_job, b_job)
    a_out, b_out = a.parse(), b.parse()
    assert a_out.id != b_out.id
    # B's answer is its own prompt's: the same as B asking again without any key.
    fresh = sdk(gateway, "b").chat.completions.create(**args, **other)
    assert b_out.choices[0].message.content == fresh.choices[0].message.content
    assert b_out.usage.prompt_tokens == fresh.usage.prompt_tokens != a_out.usage.prompt_tokens
    # A's retry is A's job, run once; the same key with another body is refused.
    again = sdk(gateway, "a").chat.completions.with_raw_response.create(
        **args, **secret, extra_headers={"Idempotency-Key": idem}
    )
    assert again.headers["x-tokenq-job-id"] == a_job
    assert again.parse().choices[0].message.content == a_out.choices[0].message.content
    with pytest.raises(openai.UnprocessableEntityError) as info:
        sdk(gateway, "a", max_retries=0).chat.completions.create(
            **args, **other, extra_headers={"Idempotency-Key": idem}
        )
    assert info.value.status_code == 422 and info.value.code == "idempotency_key_reused"


def test_the_owner_resumes_its_stream_by_last_event_id(gateway: GatewayProcess) -> None:
    idem = f"resume-{uuid.uuid4().hex}"
    body = {
        "model": MODEL, "prompt": "Hello", "max_tokens": 120, "temperature": 0,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    headers = {**auth("a"), "Idempotency-Key": idem, "X-Tokenq-Keep-Running": "1"}
    url = f"{gateway.base}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        job_id = r.headers["x-tokenq-job-id"]
        lines = [x for x in r.iter_lines() if x]
    ids = [x[4:] for x in lines if x.startswith("id: ")]
    cut = ids[len(ids) // 2]
    with httpx.stream(
        "POST", url, json=body, headers={**headers, "Last-Event-ID": cut}, timeout=60
    ) as r:
        assert r.headers["x-tokenq-job-id"] == job_id
        tail = [x for x in r.iter_lines() if x]

    def text(chunks: list[str]) -> str:
        return "".join(
            json.loads(x[6:])["choices"][0]["text"]
            for x in chunks
            if x.startswith("data: {") and json.loads(x[6:])["choices"]
        )

    assert text(lines[: lines.index(f"id: {cut}") + 2]) + text(tail) == text(lines)
    # Another key sending the same Idempotency-Key and Last-Event-ID reads nothing of it.
    with httpx.stream(
        "POST", url, json=body, headers={**headers, **auth("b"), "Last-Event-ID": cut}, timeout=60
    ) as r:
        assert r.headers["x-tokenq-job-id"] != job_id


def test_files_and_batches_are_their_owners_alone(
    gateway: GatewayProcess, conn: redis.Redis, namespace: str
) -> None:
    a, b = sdk(gateway, "a"), sdk(gateway, "b", max_retries=0)
    content = jsonl([line(i) for i in range(3)])
    file = a.files.create(file=("in.jsonl", content), purpose="batch")
    batch = a.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for attempt in (
        lambda: b.files.retrieve(file.id),
        lambda: b.files.content(file.id),
        lambda: b.files.delete(file.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert file.id not in [f.id for f in b.files.list()]
    assert batch.id not in [x.id for x in b.batches.list()]
    done = wait_status(a, batch.id, "completed")
    assert done.request_counts.completed == 3
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)
    owned = {f.id for f in a.files.list()}
    assert {file.id, done.output_file_id} <= owned
    assert [x.id for x in a.batches.list()][0] == batch.id
    # The batch's jobs ran in its owner's tenant.
    assert conn.exists(f"{namespace}:jobs:{MODEL}:1:acme")


def test_a_key_picks_its_tenant_and_user_is_only_metadata(
    gateway: GatewayProcess, conn: redis.Redis, namespace: str
) -> None:
    """A model whose one worker never takes a job: the entry waits where it was queued."""
    register_ghost(conn, namespace, "ghost")
    body = {"model": "ghost", "prompt": "Hi", "user": "globex"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.base}/v1/completions", json=body, headers=auth("a"), timeout=0.5)
    assert not conn.exists(f"{namespace}:jobs:ghost:0:globex")
    ((_, fields),) = conn.xrange(f"{namespace}:jobs:ghost:0:acme")
    job = unpack(fields[b"data"])
    assert job["tenant"] == "acme" and job["metadata"] == {"user": "globex"}


# --- who may jump the queue ------------------------------------------------------------


def test_a_key_uses_only_its_lanes_and_priorities(gateway: GatewayProcess) -> None:
    for name, extra, status in (
        ("a", {"priority": -1}, 403),
        ("a", {"lane": "interactive"}, 403),
        ("a", {"priority": -2147483647}, 403),
        ("a", {"priority": 3}, 200),
        ("a", {}, 200),
        ("p", {"priority": -5}, 200),
        ("p", {"priority": -6}, 403),
        ("p", {"priority": 6}, 403),
    ):
        r = complete(gateway, name, **extra)
        assert r.status_code == status, (name, extra, r.text)
        if status == 403:
            assert r.json()["error"]["type"] == "permission_error"
    with pytest.raises(openai.PermissionDeniedError):
        sdk(gateway, "a", max_retries=0).completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": -1}
        )


# --- limits ------------------------------------------------------------------------------


def _burst(
    gateways: tuple[GatewayProcess, GatewayProcess], name: str, count: int, **body: Any
) -> list[httpx.Response]:
    """`count` requests at once, alternating between the two gateways."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: complete(gateways[i % 2], name, **body), range(count)))


def test_two_gateways_share_one_keys_request_budget(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    answers = _burst(gateways, "r", 16)
    ok = [r for r in answers if r.status_code == 200]
    limited = [r for r in answers if r.status_code == 429]
    assert len(ok) == 5 and len(limited) == 11, [r.status_code for r in answers]
    for r in limited:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
    for r in answers:
        assert r.headers["x-ratelimit-limit-requests"] == "5"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok)
    assert remaining == [0, 1, 2, 3, 4]
    # The SDK reads the same: a RateLimitError with the headers.
    with pytest.raises(openai.RateLimitError) as info:
        sdk(gateways[1], "r", max_retries=0).completions.create(
            model=MODEL, prompt="Hi", max_tokens=2
        )
    assert info.value.response.headers["retry-after"]


def test_two_gateways_share_one_keys_token_budget(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """10 prompt token ids and 40 generated each: 50 tokens, exactly, 4 in a budget of 200."""
    body = {"prompt": list(range(100, 110)), "max_tokens": 40, "ignore_eos": True}
    answers = _burst(gateways, "t", 10, **body)
    ok = [r for r in answers if r.status_code == 200]
    assert len(ok) == 4, [(r.status_code, r.text[:200]) for r in answers]
    for r in ok:
        assert r.json()["usage"]["total_tokens"] == 50
    for r in answers:
        assert r.headers["x-ratelimit-limit-tokens"] == "200"
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
    big = complete(gateways[0], "t", prompt="Hi", max_tokens=500)
    assert big.status_code == 429 and "max_tokens" in big.json()["error"]["message"]


def test_tokens_are_settled_to_what_the_job_used(
    gateway: GatewayProcess, conn: redis.Redis, namespace: str
) -> None:
    """The prompt's estimate (a token per 4 characters) and max_tokens are charged first,
    then corrected to the job's usage."""
    r = complete(gateway, "s", prompt="a b " * 100, max_tokens=5, ignore_eos=True)
    assert r.status_code == 200
    assert r.headers["x-ratelimit-remaining-tokens"] == str(100000 - 105)
    used = r.json()["usage"]["total_tokens"]
    assert used > 200  # two tokens per 4 characters here: twice the estimate

    def charged() -> int:
        counts = conn.hgetall(f"{namespace}:gw:rate:{pid('s')}")
        return sum(int(v) for k, v in counts.items() if k.startswith(b"t:"))

    wait_for(lambda: charged() == used, timeout=10)


def test_a_key_runs_at_most_its_concurrent_jobs(
    gateway: GatewayProcess, conn: redis.Redis, namespace: str
) -> None:
    """The first job waits for a worker that never takes it (a ghost model's)."""
    register_ghost(conn, namespace, "ghost")
    running = f"{namespace}:gw:running:{pid('c')}"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            httpx.post,
            f"{gateway.base}/v1/completions",
            json={"model": "ghost", "prompt": "Go"},
            headers=auth("c"),
            timeout=3,
        )
        wait_for(lambda: conn.zcard(running) == 1, timeout=10)
        second = complete(gateway, "c")
        assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
        assert "at once" in second.json()["error"]["message"]
        with pytest.raises(httpx.ReadTimeout):
            first.result()
    # Its client left: the slot is free again.
    wait_for(lambda: conn.zcard(running) == 0, timeout=10)
    assert complete(gateway, "c").status_code == 200


def test_a_batch_counts_against_its_keys_budget(
    gateway: GatewayProcess, conn: redis.Redis, namespace: str
) -> None:
    m = sdk(gateway, "m")
    batch = m.batches.create(
        input_file_id=upload(m, jsonl([line(i, max_tokens=3) for i in range(3)])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    done = wait_status(m, batch.id, "completed")
    answers = [json.loads(x) for x in m.files.content(done.output_file_id).text.splitlines()]
    used = sum(a["response"]["body"]["usage"]["total_tokens"] for a in answers)

    def counted() -> tuple[int, int]:
        counts = conn.hgetall(f"{namespace}:gw:rate:{pid('m')}")
        requests = sum(int(v) for k, v in counts.items() if k.startswith(b"r:"))
        return requests, sum(int(v) for k, v in counts.items() if k.startswith(b"t:"))

    wait_for(lambda: counted() == (3, used), timeout=10)
    # A key over its budget: the batch waits for room (and its cancel is heard meanwhile).
    w = sdk(gateway, "w")
    waiting = w.batches.create(
        input_file_id=upload(w, jsonl([line(i) for i in range(3)])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_for(lambda: w.batches.retrieve(waiting.id).request_counts.completed == 2, timeout=60)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert w.batches.retrieve(waiting.id).status == "in_progress"
        assert w.batches.retrieve(waiting.id).request_counts.completed == 2
        time.sleep(0.1)
    w.batches.cancel(waiting.id)
    assert wait_status(w, waiting.id, "cancelled", timeout=20).request_counts.completed == 2


# --- files -------------------------------------------------------------------------------


def test_files_expire_can_be_deleted_and_fit_their_keys_quota(
    gateway: GatewayProcess, conn: redis.Redis, namespace: str
) -> None:
    a = sdk(gateway, "a")
    content = jsonl([line(0)])
    default = a.files.create(file=("in.jsonl", content), purpose="batch")
    assert default.expires_at == default.created_at + 30 * 24 * 3600
    short = a.files.create(
        file=("in.jsonl", content),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert short.expires_at == short.created_at + 3600
    for key in (f"{namespace}:file:{short.id}", f"{namespace}:file:{short.id}:data"):
        assert 3500 < conn.ttl(key) <= 3600
    assert a.files.delete(short.id).deleted
    assert short.id not in [f.id for f in a.files.list()]
    assert not conn.exists(f"{namespace}:file:{short.id}:data")
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(short.id)
    with pytest.raises(openai.BadRequestError):
        a.files.create(
            file=("in.jsonl", content),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 10},
        )

    q = sdk(gateway, "q", max_retries=0)
    before = len(list(conn.scan_iter(match=f"{namespace}:file:*", count=1000)))
    with pytest.raises(openai.APIStatusError) as info:  # alone over the key's 1 KiB
        q.files.create(file=("big.jsonl", b"x" * 2000), purpose="batch")
    assert info.value.status_code == 413 and info.value.code == "storage_quota_exceeded"
    first = q.files.create(file=("a.jsonl", b"x" * 600), purpose="batch")
    with pytest.raises(openai.APIStatusError) as info:  # over, with the first one held
        q.files.create(file=("b.jsonl", b"x" * 600), purpose="batch")
    assert info.value.status_code == 413
    after = len(list(conn.scan_iter(match=f"{namespace}:file:*", count=1000)))
    assert after == before + 2  # the first file's metadata and data: nothing of the refused
    q.files.delete(first.id)
    assert q.files.create(file=("b.jsonl", b"x" * 600), purpose="batch").bytes == 600


# --- the door ----------------------------------------------------------------------------


def test_bad_input_at_the_door_is_4xx_in_openais_shape_and_the_gateway_stays_up(
    gateway: GatewayProcess,
) -> None:
    url = f"{gateway.base}/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (json.dumps({"model": MODEL, "messages": messages, "frobnicate": 1}).encode(), 400),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400),
        (json.dumps({"model": MODEL, "messages": messages, "max_tokens": "9"}).encode(), 400),
        (b"{nope", 400),
        (b"[1, 2]", 400),
        (b"x" * (20 << 20), 413),
    ]
    for content, status in cases:
        r = httpx.post(url, content=content, headers=auth("a"), timeout=60)
        assert r.status_code == status, (content[:40], r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(
        f"{gateway.base}/v1/batches", content=b"{" * (20 << 20), headers=auth("a"), timeout=60
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert httpx.get(f"{gateway.base}/health", timeout=10).status_code == 200
    assert complete(gateway, "a").status_code == 200


# --- separate gateways -------------------------------------------------------------------


def test_keys_are_reread_on_sighup(
    tmp_path: Path, redis_url: str, namespace: str, worker: WorkerProcess
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEYS['a']} acme\n")
    gw = GatewayProcess(redis_url, namespace, tmp_path / "gw.log", "--api-keys-file", str(keys))
    try:
        assert complete(gw, "a").status_code == 200
        assert complete(gw, "b").status_code == 401
        keys.write_text(f"{KEYS['b']} globex\n")
        gw.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: complete(gw, "b").status_code == 200, timeout=10, interval=0.1)
        assert complete(gw, "a").status_code == 401
        keys.write_text(f"{KEYS['a']} acme rpm=lots\n")  # a broken file: the keys stay
        gw.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "API keys not reloaded" in gw.log.read_text(), timeout=10)
        assert complete(gw, "b").status_code == 200
        assert "line 1: " in gw.log.read_text() and KEYS["a"] not in gw.log.read_text()
    finally:
        gw.close()


def test_the_admin_address_serves_the_operator_routes_and_the_public_one_not(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    port = free_port()
    gw = GatewayProcess(
        redis_url, namespace, tmp_path / "gw.log", "--api-key", KEYS["a"],
        "--admin-port", str(port),
    )  # fmt: skip
    try:
        assert httpx.get(f"{gw.base}/metrics", timeout=10).status_code == 404
        admin = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{admin}/metrics", timeout=10).status_code == 200
        assert httpx.get(f"{admin}/dashboard/data", timeout=10).status_code == 200
        assert httpx.get(f"{admin}/v1/models", timeout=10).status_code == 404
    finally:
        gw.close()
    # Both addresses stopped on one SIGTERM (which uvicorn raises again once stopped),
    # not a kill after close's timeout.
    assert gw.proc.returncode == -signal.SIGTERM


def test_without_keys_it_warns_once_and_payloads_are_logged_only_when_asked(
    tmp_path: Path, redis_url: str, namespace: str, worker: WorkerProcess
) -> None:
    prompt = f"secret-prompt-{uuid.uuid4().hex}"
    for extra in ((), ("--log-payloads",)):
        log = tmp_path / f"gw{len(extra)}.log"
        gw = GatewayProcess(redis_url, namespace, log, *extra)
        try:
            r = httpx.post(
                f"{gw.base}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                timeout=60,
            )
            assert r.status_code == 200
        finally:
            gw.close()
        text = log.read_text()
        assert text.count("no API key configured: anyone who reaches") == 1
        assert (prompt in text) == bool(extra), text
        assert ("--log-payloads: prompts and outputs" in text) == bool(extra)


def test_keys_never_reach_logs_metrics_or_errors(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """Last in the file: every key above has been used (and a wrong one refused)."""
    metrics = httpx.get(
        f"{gateways[0].base}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ).text
    texts = [metrics] + [g.log.read_text() for g in gateways]
    for secret in [*KEYS.values(), ADMIN]:
        for text in texts:
            assert secret not in text
