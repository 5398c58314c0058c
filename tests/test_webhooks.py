"""Webhooks end to end: jobs with webhooks run by a real worker (tiny model), events
delivered by `tokenq webhooks run` processes to a real HTTP receiver on loopback, which
verifies every delivery with the `standardwebhooks` package. Faults: the receiver fails
first attempts and goes down for seconds while a dispatcher is SIGKILLed and replaced;
nothing is lost, each event is received once after de-duplication, in order per job."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from prometheus_client import CollectorRegistry
from standardwebhooks.webhooks import Webhook

from tests.faults import free_port
from tests.redis_fixtures import CLIENT, TEST_MODEL
from tests.test_batch_api import jsonl, line, upload
from tests.test_gateway import GatewayProcess
from tests.webhook_support import Dispatcher, Receiver, receiver  # noqa: F401
from tests.worker_support import (
    WorkerThread,
    fast_config,
    make_engine,
    single_torch_thread,  # noqa: F401
    tiny_model,  # noqa: F401
    wait_for,
)
from tokenq.celery.bridge import job_kwargs
from tokenq.cli import main
from tokenq.cli.ops import render
from tokenq.ops.fleet import FleetCollector, FleetReader
from tokenq.producer.client import Client, make_request
from tokenq.protocol import (
    DoneEvent,
    Event,
    JobRequest,
    Keys,
    ProtocolError,
    TokenEvent,
    decode_job,
)
from tokenq.protocol.webhooks import COMPLETED_SEQ, DISPATCHERS, START_SEQ
from tokenq.server.openai_api import BadRequest, to_submit_kwargs
from tokenq.webhooks.addresses import Refused, resolve
from tokenq.webhooks.whsec import new_secret
from tokenq.worker.scripts import Item, Scripts, event_arg
from tokenq.worker.worker import Worker

pytestmark = pytest.mark.usefixtures("single_torch_thread")

GREEDY = {"temperature": 0, "ignore_eos": True}


FAST = ("--first-backoff", "0.05", "--max-backoff", "0.5", "--attempt-timeout", "2")


# -- the contract -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("webhook", "events", "message"),
    [
        ("ftp://example.com/x", None, "must be an http"),
        ("https://user:pw@example.com/x", None, "credentials"),
        ("https://example.com/" + "x" * 2048, None, "at most 2048"),
        ("https://example.com/x", ["finished"], "webhook_events_filter"),
        ("https://example.com/x", [], "webhook_events_filter"),
        (None, ["completed"], "needs a webhook"),
    ],
)
def test_a_bad_webhook_is_refused_before_it_is_queued(
    webhook: Any, events: Any, message: str
) -> None:
    job = JobRequest(prompt="hi", job_id="j1", webhook=webhook, webhook_events_filter=events)
    with pytest.raises(ProtocolError, match=message):
        job.validate()


def test_a_jobs_webhook_travels_in_its_entry() -> None:
    job = JobRequest(
        prompt="hi",
        job_id="j1",
        webhook="https://example.com/hook",
        webhook_events_filter=["start", "completed"],
    )
    back = decode_job({k.encode(): v for k, v in _bytes(job.to_fields()).items()})
    assert (back.webhook, back.webhook_events_filter) == (job.webhook, ["start", "completed"])


def _bytes(fields: dict[str, Any]) -> dict[str, bytes]:
    return {k: v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


def test_celery_kwargs_batch_lines_and_the_gateways_body_carry_a_webhook() -> None:
    url, events = "https://example.com/hook", ["start", "completed"]
    task = job_kwargs(None, {"prompt": "hi", "webhook": url, "webhook_events_filter": events})
    assert make_request(**task).webhook_events_filter == events
    body = {"messages": [{"role": "user", "content": "hi"}], "webhook": url}
    assert to_submit_kwargs("chat", body)["webhook"] == url  # a batch line's body, or a request's
    with pytest.raises(BadRequest) as refused:
        to_submit_kwargs("chat", {**body, "webhook_events_filter": ["done"]})
    assert refused.value.param == "webhook_events_filter"
    with pytest.raises(BadRequest) as refused:
        to_submit_kwargs("chat", {**body, "webhook": "file:///etc/passwd"})
    assert refused.value.param == "webhook"


def test_the_hook_stream_keeps_the_queues_key_apart_from_its_family() -> None:
    keys = Keys("ns")
    assert keys.hooks(keys.queue("m/odel", 5, "acme")) == "ns:hooks:m/odel:5:acme"
    with pytest.raises(ValueError):
        keys.hooks("other:jobs:m:0:-")


def test_publish_writes_webhook_events_once_in_order_and_only_for_the_owner(
    redis_conn: redis.Redis, redis_namespace: str
) -> None:
    keys, jid, fence = Keys(redis_namespace), "j1", b"w1:fence"
    redis_conn.set(keys.owner(jid), fence)
    redis_conn.set(keys.job(jid), "running")
    scripts = Scripts(redis_conn, keys, "workers", "w1")
    stream = keys.hooks(keys.queue("m", 0, "-"))

    def publish(first: int, events: list[Event], seqs: list[int], status: str = "") -> str:
        hooks = [(seq, stream, f"event {seq}".encode()) for seq in seqs]
        item = Item("run", b"q", b"1-1", jid, first, status, [event_arg(e) for e in events])
        item.hooks = hooks
        return scripts.publish(fence, [item], 600, 3600, 1000)[0][0]

    token = TokenEvent(0, [5], "a")
    assert publish(1, [token], [START_SEQ, 1]) == "ok"
    assert publish(1, [token], [START_SEQ, 1]) == "ok"  # sent again: nothing twice
    redis_conn.set(keys.owner(jid), b"another:fence")  # taken over: this worker writes nothing
    assert publish(2, [TokenEvent(1, [6], "b")], [2]) == "lost"
    redis_conn.set(keys.owner(jid), fence)
    done = DoneEvent("ab", "length", [5, 6])
    assert publish(2, [TokenEvent(1, [6], "b"), done], [COMPLETED_SEQ], "done") == "ok"
    rows = [{k.decode(): v.decode() for k, v in f.items()} for _, f in redis_conn.xrange(stream)]
    assert [(r["seq"], r["prev"], r["data"]) for r in rows] == [
        ("0", "-1", "event 0"),
        ("1", "0", "event 1"),
        (str(COMPLETED_SEQ), "1", f"event {COMPLETED_SEQ}"),
    ]
    assert redis_conn.get(keys.job(jid)) == b"done"


# -- where a webhook may go ------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1/hook",  # loopback
        "https://localhost/hook",  # a name that resolves to loopback
        "https://10.1.2.3/hook",  # private
        "https://192.168.0.7/hook",
        "https://169.254.169.254/latest/meta-data",  # link-local: the clouds' metadata
        "https://[::1]/hook",
        "https://[::ffff:10.0.0.1]/hook",  # IPv4-mapped
        "https://100.64.0.1/hook",  # shared address space
        "http://93.184.215.14/hook",  # public, but not https
    ],
)
def test_private_and_plain_http_addresses_are_refused_without_the_flag(url: str) -> None:
    with pytest.raises(Refused):
        asyncio.run(resolve(url, allow_private=False))


def test_a_public_address_is_pinned_with_its_name_kept_for_tls_and_host() -> None:
    target = asyncio.run(resolve("https://93.184.215.14:8443/a?b=c", allow_private=False))
    assert target.url == "https://93.184.215.14:8443/a?b=c"
    assert target.host == "93.184.215.14:8443"
    loop = asyncio.run(resolve("http://localhost:81/x", allow_private=True))
    assert loop.url in ("http://127.0.0.1:81/x", "http://[::1]:81/x")
    assert loop.host == "localhost:81" and loop.sni is None


# -- delivery -------------------------------------------------------------------------


def _worker(model: Path, redis_url: str, namespace: str) -> WorkerThread:
    conn = redis.Redis.from_url(redis_url)
    return WorkerThread(Worker(make_engine(model), conn, fast_config(namespace)))


def test_every_completed_event_arrives_once_in_order_through_failures_and_a_kill_9(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    receiver: Callable[..., Receiver],  # noqa: F811
    tmp_path: Path,
) -> None:
    secret = new_secret()
    hook = receiver(secret, lambda _wid, attempt: 500 if attempt == 1 else 200)
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    log = tmp_path / "dispatchers.log"
    extra = (*FAST, "--allow-private-webhooks", "--claim-idle-ms", "1500")
    everything = ["start", "output", "completed"]
    with _worker(tiny_model, redis_url, redis_namespace):
        first = Dispatcher(redis_url, redis_namespace, secret, log, *extra, "--consumer", "d1")
        second = Dispatcher(redis_url, redis_namespace, secret, log, *extra, "--consumer", "d2")
        with first:
            jobs = client.submit_many(
                make_request(
                    f"story {i}",
                    max_tokens=4,
                    webhook=hook.url,
                    webhook_events_filter=everything if i % 10 == 0 else None,
                    **GREEDY,
                )
                for i in range(200)
            )
            wait_for(lambda: len(hook.completed()) >= 20, timeout=30)
            hook.stop()  # down for a few seconds, while d1 is killed mid-delivery
            keys = client.keys
            streams = [s.decode() for s in client.redis.smembers(keys.hook_streams)]
            wait_for(lambda: _pending_of(client.redis, streams, "d1") > 0, timeout=10)
            with second:  # a second dispatcher joins, the first is killed holding events
                first.kill()
                wait_for(lambda: all(j.status() == "done" for j in jobs), timeout=30)
                hook.start()  # the same port again
                wait_for(lambda: len(hook.completed()) == 200, timeout=40)
                wait_for(lambda: _held(client.redis, streams) == 0, timeout=10)
    assert not hook.bad
    got = hook.completed()
    for job in jobs:
        data = got[job.id]["data"]
        assert data["text"] == job.result().text and data["status"] == "done"
        assert data["usage"]["completion_tokens"] == 4
    # In order per job: started, then outputs (if any), then completed.
    for job in jobs[::10]:
        mine = [w for w in hook.order if w.startswith(f"msg_{job.id}_")]
        assert mine[0] == f"msg_{job.id}_job.started" and mine[-1] == f"msg_{job.id}_job.completed"
    assert all(n >= 2 for n in hook.attempts.values())  # each first attempt answered 500
    assert _pending_of(client.redis, streams, "d1") == 0  # the killed one's: taken over
    client.close()


def _pending_of(conn: redis.Redis, streams: list[str], consumer: str) -> int:
    return sum(
        len(conn.xpending_range(s, DISPATCHERS, "-", "+", 1000, consumername=consumer))
        for s in streams
    )


def _held(conn: redis.Redis, streams: list[str]) -> int:
    """Webhook events not yet delivered: left in their streams or pending."""
    total = 0
    for stream in streams:
        total += conn.xlen(stream)
        total += conn.xpending(stream, DISPATCHERS)["pending"]
    return total


def test_a_410_disables_the_url_and_an_address_refused_is_recorded(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    receiver: Callable[..., Receiver],  # noqa: F811
    tmp_path: Path,
) -> None:
    secret = new_secret()
    gone = receiver(secret, lambda _wid, _n: 410)
    moved = receiver(secret, lambda _wid, _n: 302)  # to 10.0.0.1: never followed
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    keys = client.keys
    log = tmp_path / "dispatcher.log"
    with _worker(tiny_model, redis_url, redis_namespace):
        with Dispatcher(redis_url, redis_namespace, secret, log, *FAST, "--allow-private-webhooks"):
            a = client.submit("a", max_tokens=2, webhook=gone.url, **GREEDY)
            b = client.submit("b", max_tokens=2, webhook=moved.url, **GREEDY)
            wait_for(lambda: client.redis.xlen(keys.webhook_failures) == 2, timeout=20)
            assert client.redis.sismember(keys.webhook_gone, gone.url)
            c = client.submit("c", max_tokens=2, webhook=gone.url, **GREEDY)
            wait_for(lambda: client.redis.xlen(keys.webhook_failures) == 3, timeout=20)
        # Without the flag: loopback is refused before anything is sent.
        fresh = receiver(secret)
        with Dispatcher(redis_url, redis_namespace, secret, log, *FAST):
            d = client.submit("d", max_tokens=2, webhook=fresh.url, **GREEDY)
            wait_for(lambda: client.redis.xlen(keys.webhook_failures) == 4, timeout=20)
    failures = [
        {k.decode(): v.decode() for k, v in f.items()}
        for _, f in client.redis.xrange(keys.webhook_failures)
    ]
    by_job = {f["subject"]: f for f in failures}
    assert by_job[a.id]["outcome"] == "gone"
    assert by_job[b.id]["outcome"] == "refused" and "redirect" in by_job[b.id]["reason"]
    assert by_job[c.id]["outcome"] == "gone"
    assert by_job[d.id]["outcome"] == "refused" and "https" in by_job[d.id]["reason"]
    assert sum(gone.attempts.values()) == 1  # c was never sent: the URL is gone
    assert sum(moved.attempts.values()) == 1
    assert not fresh.attempts
    # What an operator sees: `tokenq inspect` and the fleet's gauges.
    fleet = FleetReader(client.redis, redis_namespace).read()
    assert (fleet.webhooks.failures, fleet.webhooks.backlog) == (4, 0)
    newest = [f["subject"] for f in fleet.webhooks.recent_failures]
    assert newest[:2] == [d.id, c.id] and set(newest[2:]) == {a.id, b.id}
    assert "4 deliveries given up" in render(fleet, redis_url)
    registry = CollectorRegistry()
    registry.register(FleetCollector(client.redis, redis_namespace))
    assert registry.get_sample_value("tokenq:webhook_failures") == 4
    client.close()


def test_the_cli_makes_secrets_and_endpoints_shown_once(
    redis_url: str,
    redis_namespace: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def cli(*argv: str) -> tuple[int, str, str]:
        where = ["--redis-url", redis_url, "--namespace", redis_namespace]
        code = main(["webhooks", *argv, *([] if argv[0] == "secret" else where)])
        out, err = capsys.readouterr()
        return code, out, err

    secret = cli("secret")[1].strip()
    assert secret.startswith("whsec_")
    monkeypatch.setenv("TOKENQ_WEBHOOK_SECRET", secret)  # read as the parser is built
    code, out, err = cli(
        "add", "https://hooks.example.com/tq", "--events", "batch.completed,batch.failed"
    )
    assert code == 0, err
    endpoint = json.loads(out)
    assert endpoint["secret"].startswith("whsec_") and "shown once" in err
    assert endpoint["events"] == ["batch.completed", "batch.failed"]
    listed = json.loads(cli("list")[1])
    assert [e["id"] for e in listed] == [endpoint["id"]] and "secret" not in listed[0]
    stored = redis.Redis.from_url(redis_url).hget(
        Keys(redis_namespace).webhook_endpoints, endpoint["id"]
    )
    assert endpoint["secret"].encode() not in stored and secret.encode() not in stored
    code, _, err = cli("add", "https://x.example/", "--events", "job.exploded")
    assert code == 2 and "events must be" in err
    assert cli("remove", endpoint["id"])[0] == 0
    assert json.loads(cli("list")[1]) == []
    monkeypatch.setenv("TOKENQ_WEBHOOK_SECRET", "not-a-secret")
    code, _, err = cli("run")
    assert code == 2 and "whsec_" in err and "not-a-secret" not in err
    nowhere = ["--redis-url", f"redis://127.0.0.1:{free_port()}/0"]
    assert main(["webhooks", "list", *nowhere]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenq webhooks: Redis at") and len(err.splitlines()) == 1


def test_a_keys_endpoints_hear_its_jobs_and_batches_signed_with_their_own_secret(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    receiver: Callable[..., Receiver],  # noqa: F811
    tmp_path: Path,
) -> None:
    secret = new_secret()
    key_a, key_b = "sk-a-" + os.urandom(8).hex(), "sk-b-" + os.urandom(8).hex()
    as_a, as_b = _bearer(key_a), _bearer(key_b)
    per_job, hears = receiver(secret), receiver(secret)
    gone = receiver(secret, lambda _wid, _n: 410)
    with _worker(tiny_model, redis_url, redis_namespace):
        gateway = GatewayProcess(
            redis_url, redis_namespace, tmp_path / "gateway.log", "--api-key", key_a,
            "--api-key", key_b, "--webhook-secret", secret, "--batch-poll", "0.2",
        )  # fmt: skip
        base = f"{gateway.base}/v1"
        try:
            both = ["job.completed", "batch.completed"]
            made = httpx.post(
                f"{base}/webhooks", json={"url": hears.url, "events": both}, headers=as_a
            )
            assert made.status_code == 201, made.text
            endpoint = made.json()
            hears.verifier = Webhook(endpoint["secret"])  # its own secret, shown this once
            made = httpx.post(f"{base}/webhooks", json={"url": gone.url}, headers=as_a)
            assert made.status_code == 201 and made.json()["events"] == ["job.completed"]
            mine = httpx.get(f"{base}/webhooks", headers=as_a).json()["data"]
            assert [e["url"] for e in mine] == [hears.url, gone.url]
            assert all("secret" not in e for e in mine)
            assert httpx.get(f"{base}/webhooks", headers=as_b).json()["data"] == []
            not_b = httpx.delete(f"{base}/webhooks/{endpoint['id']}", headers=as_b)
            assert not_b.status_code == 404 and not_b.json()["error"]["param"] == "id"
            bad = {"url": "https://x.example", "events": ["job.x"]}
            refused = httpx.post(f"{base}/webhooks", json=bad, headers=as_b)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "events"
            log = tmp_path / "dispatcher.log"
            with Dispatcher(
                redis_url, redis_namespace, secret, log, *FAST, "--allow-private-webhooks"
            ):
                a = openai.OpenAI(base_url=base, api_key=key_a)
                chat = a.chat.completions.create(
                    model=TEST_MODEL,
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=3,
                    extra_body={"webhook": per_job.url, "webhook_events_filter": ["completed"]},
                )
                job_id = chat.id.removeprefix("chatcmpl-")
                wait_for(lambda: job_id in hears.completed(), timeout=20)
                wait_for(lambda: job_id in per_job.completed(), timeout=20)
                batch = a.batches.create(
                    input_file_id=upload(a, jsonl([line(i) for i in range(2)])),
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
                wait_for(lambda: _batch_ends(hears), timeout=30)
                wait_for(lambda: _disabled(base, as_a) == [False, True], timeout=20)
        finally:
            gateway.close()
    text = chat.choices[0].message.content
    assert hears.completed()[job_id]["data"]["text"] == text
    assert per_job.completed()[job_id]["data"]["text"] == text
    (end,) = _batch_ends(hears)
    assert end["data"]["id"] == batch.id and end["data"]["request_counts"]["completed"] == 2
    assert not hears.bad and not per_job.bad


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _batch_ends(hook: Receiver) -> list[dict[str, Any]]:
    with hook.lock:
        return [e for e in hook.events.values() if e["type"] == "batch.completed"]


def _disabled(base: str, headers: dict[str, str]) -> list[bool]:
    found = httpx.get(f"{base}/webhooks", headers=headers).json()["data"]
    return [bool(e["disabled"]) for e in found]
