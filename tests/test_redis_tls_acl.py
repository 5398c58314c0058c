"""Every component over TLS, each as a Redis ACL user with its role's least rights
(tokenq/protocol/acl.py): one `redis-server` listening on a TLS port only, with
certificates made here by the openssl command (a CA, the server's, a client's), and one
user per role. Jobs run end to end through each role, and Redis's ACL log stays empty:
nothing any component sent was outside its role's line. Then each role is shown to be
refused what lies outside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import httpx
import openai
import pytest
import redis

from tests.faults import WorkerProcess, free_port
from tests.helpers import make_tiny_llama_dir
from tests.test_batch_api import jsonl, line, upload, wait_status
from tests.test_gateway import GatewayProcess
from tests.waits import wait_for
from tests.webhook_support import Dispatcher, Receiver
from tokenq.celery.bridge import Bridge, RevokeWatcher
from tokenq.producer.client import Client
from tokenq.protocol.acl import ROLES, acl_rules
from tokenq.protocol.connection import version_tuple
from tokenq.webhooks.whsec import new_secret

NAMESPACE = "tqacl"
MODEL = "tiny"
ROOT_PASSWORD = uuid.uuid4().hex
API_KEY, ADMIN_KEY = "sk-" + uuid.uuid4().hex, "admin-" + uuid.uuid4().hex


def openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def make_certificates(folder: Path) -> None:
    """A CA, and the server's and a client's certificates it signs (P-256 keys: quick)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=tokenq test CA", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder,
    )  # fmt: skip
    for name, usage, alt in (
        ("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"),
        ("client", "clientAuth", ""),
    ):
        (folder / f"{name}.ext").write_text(
            f"basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n{alt}"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        )
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=tokenq {name}", cwd=folder)  # fmt: skip
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
            cwd=folder,
        )  # fmt: skip


@dataclass
class TlsRedis:
    """redis-server on a TLS port only (no plain port), clients' certificates optional."""

    folder: Path
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    def url(self, role: str, client_cert: bool = False) -> str:
        query = {"ssl_ca_certs": str(self.ca)}
        if client_cert:
            query |= {
                "ssl_certfile": str(self.folder / "client.crt"),
                "ssl_keyfile": str(self.folder / "client.key"),
            }
        return f"rediss://tq-{role}:pw-{role}@127.0.0.1:{self.port}/0?{urlencode(query)}"

    def root(self) -> redis.Redis:
        return redis.Redis(
            port=self.port, password=ROOT_PASSWORD, ssl=True, ssl_ca_certs=str(self.ca)
        )

    def acl_log(self) -> list[dict]:
        with self.root() as conn:
            return conn.acl_log(count=1000)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    folder = tmp_path_factory.mktemp("tls")
    make_certificates(folder)
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary is not None
    cmd = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", "server.crt", "--tls-key-file", "server.key",
        "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "optional",
        "--requirepass", ROOT_PASSWORD, "--save", "", "--appendonly", "no",
        "--dir", str(folder),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tls = TlsRedis(folder, port, proc)

    def answers() -> bool:
        try:
            with tls.root() as conn:
                return bool(conn.ping())
        except redis.RedisError:
            assert proc.poll() is None, "redis-server with TLS did not start"
            return False

    try:
        wait_for(answers, timeout=10, interval=0.05)
        with tls.root() as conn:
            version = version_tuple(conn.info("server")["redis_version"])
            for role in ROLES:
                models = (MODEL,) if role == "worker" else ()
                rules = acl_rules(role, NAMESPACE, models, version).split()
                conn.acl_setuser(f"tq-{role}", enabled=True, passwords=[f"+pw-{role}"])
                conn.execute_command("ACL", "SETUSER", f"tq-{role}", *rules)
        yield tls
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, server: TlsRedis) -> Iterator[WorkerProcess]:
    """As the worker role, with a client certificate."""
    root = tmp_path_factory.mktemp("tls-worker")
    model = make_tiny_llama_dir(root / "tiny")
    url = server.url("worker", client_cert=True)
    with WorkerProcess(model, url, NAMESPACE, root / "worker.log") as proc:
        with server.root() as conn:
            wait_for(lambda: conn.zcard(f"{NAMESPACE}:workers") == 1, timeout=120)
        yield proc


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, server: TlsRedis, worker: WorkerProcess
) -> Iterator[GatewayProcess]:
    """As the gateway role, with keys, limits and the batch runner all at work."""
    log = tmp_path_factory.mktemp("tls-gw") / "gateway.log"
    proc = GatewayProcess(
        server.url("gateway"), NAMESPACE, log, "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
        "--requests-per-minute", "1000", "--tokens-per-minute", "1000000",
        "--max-concurrent-jobs", "8", "--batch-poll", "0.2",
    )  # fmt: skip
    yield proc
    proc.close()


def tokenq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenq.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TOKENQ_NAMESPACE": NAMESPACE},
    )


def test_every_role_runs_jobs_end_to_end_over_tls_within_its_acl(
    server: TlsRedis, gateway: GatewayProcess, tmp_path: Path
) -> None:
    try:
        run_every_role(server, gateway, tmp_path)
    finally:
        # Nothing any of them sent since the users were made (the worker's and the
        # gateway's start included), in a script or not, was refused.
        assert server.acl_log() == []


def run_every_role(server: TlsRedis, gateway: GatewayProcess, tmp_path: Path) -> None:
    # client: Client, the Celery bridge's side, `tokenq batch run`
    with Client(server.url("client"), namespace=NAMESPACE, model=MODEL) as client:
        done = client.submit("Hello", max_tokens=4, ignore_eos=True).result(timeout=60)
        assert done.usage.completion_tokens == 4
        bridge = Bridge(client, RevokeWatcher(client, set(), 0.1))
        task = f"celery-{uuid.uuid4().hex}"
        out = bridge.run(task, None, {"prompt": "Hi", "max_tokens": 3}, lambda meta: None)
        assert out["usage"]["completion_tokens"] == 3
    lines = tmp_path / "in.jsonl"
    lines.write_bytes(jsonl([line(i) for i in range(3)]))
    run = tokenq(
        "batch", "run", str(lines), str(tmp_path / "out.jsonl"), "--no-progress",
        "--redis-url", server.url("client"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3

    # dispatcher: a job's webhook events (the client lists the stream, the worker writes)
    secret = new_secret()
    hook = Receiver(secret)
    hook.start()
    log = tmp_path / "dispatcher.log"
    try:
        with Dispatcher(
            server.url("dispatcher"), NAMESPACE, secret, log, "--allow-private-webhooks"
        ):
            with Client(server.url("client"), namespace=NAMESPACE, model=MODEL) as client:
                everything = ["start", "output", "completed"]
                job = client.submit(
                    "Hook", max_tokens=3, webhook=hook.url, webhook_events_filter=everything
                )
                text = job.result(timeout=60).text
            wait_for(lambda: job.id in hook.completed(), timeout=30)
        assert hook.completed()[job.id]["data"]["text"] == text and not hook.bad
    finally:
        hook.stop()

    # gateway: the OpenAI API (limits counted, an Idempotency-Key bound), Files and
    # Batches, the operator's routes
    sdk = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key=API_KEY)
    chat = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        extra_headers={"Idempotency-Key": f"tls-{uuid.uuid4().hex}"},
    )  # fmt: skip
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    stream = sdk.completions.create(model=MODEL, prompt="Go", max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)
    batch = sdk.batches.create(
        input_file_id=upload(sdk, jsonl([line(i) for i in range(2)])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    done_batch = wait_status(sdk, batch.id, "completed", timeout=60)
    assert done_batch.request_counts.completed == 2
    assert sdk.files.delete(done_batch.output_file_id).deleted
    admin_headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    metrics = httpx.get(f"{gateway.base}/metrics", headers=admin_headers, timeout=10)
    assert "tokenq:redis_up 1.0" in metrics.text
    data = httpx.get(f"{gateway.base}/dashboard/data", headers=admin_headers, timeout=10)
    assert data.status_code == 200 and data.json()["workers"]

    # admin: inspect, result, cancel, dlq, the exporter
    admin = server.url("admin")
    inspect = tokenq("inspect", "--json", "--redis-url", admin)
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["workers"]
    result = tokenq("result", task, "--redis-url", admin)
    assert result.returncode == 0, result.stderr
    assert tokenq("cancel", task, "--redis-url", admin).returncode == 0
    assert tokenq("dlq", "list", "--redis-url", admin).returncode == 0
    made = tokenq(
        "webhooks", "add", "https://hooks.example.com/tq", "--redis-url", admin,
        "--webhook-secret", secret,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    endpoint = json.loads(made.stdout)["id"]
    assert endpoint in tokenq("webhooks", "list", "--redis-url", admin).stdout
    assert tokenq("webhooks", "remove", endpoint, "--redis-url", admin).returncode == 0
    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "tokenq.cli", "exporter", "--redis-url", admin,
         "--namespace", NAMESPACE, "--port", str(port), "--addr", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def scraped() -> str:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                return ""

        wait_for(lambda: "tokenq:redis_up 1.0" in scraped(), timeout=30, interval=0.2)
        assert "tokenq:workers_live" in scraped()
    finally:
        exporter.terminate()
        exporter.wait(timeout=10)


def test_each_role_is_refused_outside_its_line(server: TlsRedis) -> None:
    outside = {
        "client": [
            ("FLUSHALL",), ("GET", "other:key"), ("HSET", f"{NAMESPACE}:worker:x", "a", "b"),
            ("KEYS", "*"), ("XREADGROUP", "GROUP", "workers", "c", "STREAMS",
                            f"{NAMESPACE}:jobs:{MODEL}:0:-", ">"),
        ],
        "worker": [
            ("XADD", f"{NAMESPACE}:jobs:other:0:-", "*", "a", "b"),
            ("SET", f"{NAMESPACE}:gw:rate:x", "1"), ("CONFIG", "GET", "*"), ("FLUSHDB",),
        ],
        "gateway": [("FLUSHDB",), ("CONFIG", "SET", "maxmemory", "1"), ("GET", "other:key")],
        "admin": [("FLUSHALL",), ("ACL", "LIST"), ("SHUTDOWN",), ("SET", "other:key", "1")],
    }  # fmt: skip
    for role, commands in outside.items():
        with redis.Redis.from_url(server.url(role)) as conn:
            assert conn.ping()
            for command in commands:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    conn.execute_command(*command)
    log = server.acl_log()
    assert {entry["username"] for entry in log} == {f"tq-{role}" for role in outside}
    with server.root() as root:
        assert root.ping()  # still up: the refused SHUTDOWN did nothing
        assert not root.exists("other:key")


def test_only_tls_with_the_servers_ca_connects(server: TlsRedis) -> None:
    with pytest.raises(redis.ConnectionError):  # plain TCP to the TLS port
        redis.Redis(port=server.port, password=ROOT_PASSWORD, socket_timeout=2).ping()
    with pytest.raises(redis.ConnectionError):  # TLS, but the system's CAs
        redis.Redis(port=server.port, password=ROOT_PASSWORD, ssl=True, socket_timeout=2).ping()
    with pytest.raises(redis.AuthenticationError):  # the CA, a wrong password
        redis.Redis.from_url(server.url("client").replace("pw-client", "nope")).ping()


def test_the_acl_lines_in_the_docs_are_the_roles_rules() -> None:
    """docs/security.md shows each role's line as `acl_rules` writes it."""
    docs = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    for role in ROLES:
        models = ("smollm2-135m",) if role == "worker" else ()
        password = f"{role.upper()}_PASSWORD"
        line = f"ACL SETUSER tq-{role} on >{password} {acl_rules(role, 'tokenq', models)}"
        assert line in docs, role
