"""`tokenq bench gateway`: what the OpenAI API adds to the queue on W1: the official SDK
through `tokenq serve` against tokenq's Client, all at once, then one request at a time."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

from tokenq.bench.common import (
    GREEDY,
    WARM_UP,
    add_engine_options,
    add_warm_up_option,
    engine_from,
    warm_up,
)
from tokenq.bench.queue import (
    BENCH_NAME,
    RunResult,
    connect,
    delete_namespace,
    percentile,
    run_queue,
)
from tokenq.producer.client import Client, make_request
from tokenq.protocol import DoneEvent, ErrorEvent, TokenEvent
from tokenq.protocol.connection import DEFAULT_REDIS_URL
from tokenq.server.gateway import GatewayConfig
from tokenq.worker.logs import configure_logging


def stream_text_jobs(client: Client, prompts: list[list[int]], params: dict[str, Any]) -> RunResult:
    """`Client` side, all at once; TTFT is the first event with text (the gateway's first
    chunk)."""
    start = time.monotonic()
    jobs = client.submit_many(make_request(prompt_token_ids=ids, **params) for ids in prompts)
    first: dict[str, float] = {}
    tokens = 0
    for job, event in client.stream_many(jobs, timeout=3600):
        if isinstance(event, TokenEvent) and event.text:
            first.setdefault(job.id, time.monotonic() - start)
        elif isinstance(event, DoneEvent):
            tokens += event.usage.completion_tokens
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(f"job {job.id} failed: {event.code}: {event.message}")
    return RunResult(time.monotonic() - start, tokens, list(first.values()))


def _bench_client(url: str, namespace: str) -> Client:
    """The `Client` side with the gateway's reader settings: only the HTTP path differs."""
    return Client(
        url, namespace=namespace, model=BENCH_NAME, require_worker=False,
        block_ms=GatewayConfig.block_ms,
    )  # fmt: skip


def _completion(ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """The SDK's arguments for the same request as `Client`'s, streamed."""
    return {
        "model": BENCH_NAME,
        "prompt": ids,
        "max_tokens": params["max_tokens"],
        "temperature": 0,
        "stream": True,
        "extra_body": {"ignore_eos": True},
    }


def _client_ttft(client: Client, ids: list[int], params: dict[str, Any]) -> float:
    """One request through `Client`: seconds from its submit to its first token with text."""
    sent = time.monotonic()
    first = None
    for event in client.submit(prompt_token_ids=ids, **params).stream(timeout=600):
        if first is None and isinstance(event, TokenEvent) and event.text:
            first = time.monotonic() - sent
    if first is None:
        raise RuntimeError("a latency request produced no text")
    return first


def _sdk_ttft(sdk: Any, ids: list[int], params: dict[str, Any]) -> float:
    """The same request through the OpenAI SDK and the gateway, streamed."""
    sent = time.monotonic()
    first = None
    for chunk in sdk.completions.create(**_completion(ids, params)):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic() - sent
    if first is None:
        raise RuntimeError("a latency request produced no text")
    return first


def _paired_process(
    base_url: str,
    url: str,
    namespace: str,
    prompts: list[list[int]],
    params: dict[str, Any],
    results: Any,
) -> None:
    """Latency: each prompt through `Client` and the SDK back to back, in turn first, so
    that the machine's drift hits both sides of a pair alike."""
    import openai

    try:
        client = _bench_client(url, namespace)
        sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        with client, sdk:
            while BENCH_NAME not in [m.id for m in sdk.models.list().data]:
                time.sleep(0.05)
            pairs = []
            for i, ids in enumerate(prompts):
                if i % 2:
                    through = _sdk_ttft(sdk, ids, params)
                    direct = _client_ttft(client, ids, params)
                else:
                    direct = _client_ttft(client, ids, params)
                    through = _sdk_ttft(sdk, ids, params)
                pairs.append((direct, through))
        results.put({"result": pairs})
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def _keys_paired_process(
    open_url: str,
    keyed_url: str,
    url: str,
    namespace: str,
    prompts: list[list[int]],
    params: dict[str, Any],
    results: Any,
) -> None:
    """`--keys`: latency pairs as `_paired_process`'s, both through the SDK: the gateway
    without keys, and one with an API key and per-key limits (counted in Redis, set too
    high to refuse anything). The median difference is what they add to a request."""
    import openai

    try:
        plain = openai.OpenAI(base_url=f"{open_url}/v1", api_key="none", max_retries=0)
        keyed = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=BENCH_KEY, max_retries=0)
        with plain, keyed:
            while BENCH_NAME not in [m.id for m in keyed.models.list().data]:
                time.sleep(0.05)
            pairs = []
            for i, ids in enumerate(prompts):
                if i % 2:
                    on = _sdk_ttft(keyed, ids, params)
                    off = _sdk_ttft(plain, ids, params)
                else:
                    off = _sdk_ttft(plain, ids, params)
                    on = _sdk_ttft(keyed, ids, params)
                pairs.append((off, on))
        results.put({"result": pairs})
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def _client_process(
    url: str, namespace: str, prompts: list[list[int]], params: dict[str, Any], results: Any
) -> None:
    try:
        with _bench_client(url, namespace) as client:
            results.put({"result": stream_text_jobs(client, prompts, params)})
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


async def _sdk_run(base_url: str, prompts: list[list[int]], params: dict[str, Any]) -> RunResult:
    import openai

    sdk = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    async with sdk:
        # The worker registers as it starts: wait for it (the gateway refuses unknown models).
        while BENCH_NAME not in [m.id for m in (await sdk.models.list()).data]:
            await asyncio.sleep(0.05)
        start = time.monotonic()

        async def one(ids: list[int]) -> tuple[float | None, int]:
            stream = await sdk.completions.create(
                **_completion(ids, params), stream_options={"include_usage": True}
            )
            first, tokens = None, 0
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.monotonic() - start
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return first, tokens

        done = await asyncio.gather(*(one(ids) for ids in prompts))
    seconds = time.monotonic() - start
    return RunResult(seconds, sum(t for _, t in done), [f for f, _ in done if f is not None])


def _sdk_process(
    base_url: str,
    url: str,
    namespace: str,
    prompts: list[list[int]],
    params: dict[str, Any],
    results: Any,
) -> None:
    try:
        results.put({"result": asyncio.run(_sdk_run(base_url, prompts, params))})
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


BENCH_KEY = "sk-bench"
# Keys on, with every limit counted and none reached.
KEYED = [
    "--api-key", BENCH_KEY, "--requests-per-minute", "100000000",
    "--tokens-per-minute", "100000000000", "--max-concurrent-jobs", "100000",
]  # fmt: skip


def start_gateway(
    url: str, namespace: str, port: int, log: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    import httpx

    cmd = [
        sys.executable, "-m", "tokenq.cli", "serve", "--redis-url", url,
        "--namespace", namespace, "--port", str(port),
        "--request-timeout", "86400",  # a slow machine's run is slow, not late
        *extra,
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the gateway did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
    from tokenq.bench.engine import w1

    ap = argparse.ArgumentParser(prog="tokenq bench gateway", description=__doc__)
    add_engine_options(ap)
    ap.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    ap.add_argument("--port", type=int, default=8765, help="the gateway's")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument(
        "--repeat", type=int, default=2, help="alternate the two sides; keep each side's best"
    )
    ap.add_argument(
        "--latency-requests", type=int, default=32, help="sent one at a time: latency phase"
    )
    ap.add_argument(
        "--log",
        type=Path,
        default=Path(tempfile.gettempdir()) / "tokenq-bench-gateway.log",
        help="the gateway's log",
    )
    ap.add_argument(
        "--keys",
        action="store_true",
        help="latency: a gateway with an API key and limits against one without (port + 1)",
    )
    add_warm_up_option(ap)
    args = ap.parse_args(argv)

    configure_logging(json=False, level="warning")
    conn = connect(
        args.redis_url,
        required=f"tokenq bench gateway: no Redis at {args.redis_url} (the gateway needs one)",
    )
    engine = engine_from(args)
    workload = w1(args.requests, args.prompt_len, args.gen)
    params = {**GREEDY, "max_tokens": args.gen}
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    gateway = start_gateway(args.redis_url, namespace, args.port, args.log)
    sdk_side = partial(_sdk_process, f"http://127.0.0.1:{args.port}")
    paired_side = partial(_paired_process, f"http://127.0.0.1:{args.port}")
    keyed = None
    if args.keys:
        keyed_log = args.log.with_suffix(".keyed.log")
        keyed = start_gateway(args.redis_url, namespace, args.port + 1, keyed_log, tuple(KEYED))
        base = "http://127.0.0.1"
        paired_side = partial(
            _keys_paired_process, f"{base}:{args.port}", f"{base}:{args.port + 1}"
        )
    # Latency: short prompts one at a time, a few tokens each.
    alone_prompts = [ids[:16] for ids in w1(args.latency_requests, 16, 1).prompts]
    alone = {**params, "max_tokens": 4}
    direct_runs: list[RunResult] = []
    gateway_runs: list[RunResult] = []
    pairs: list[tuple[float, float]] = []
    try:
        if args.warm_up:
            warm_up(engine, workload.prompts)
            run_queue(engine, conn, namespace, workload.prompts, WARM_UP, _client_process)
            run_queue(engine, conn, namespace, workload.prompts, WARM_UP, sdk_side)
        for _ in range(args.repeat):  # alternating, so drifting machine load hits both sides
            direct_runs.append(
                run_queue(engine, conn, namespace, workload.prompts, params, _client_process)
            )
            gateway_runs.append(
                run_queue(engine, conn, namespace, workload.prompts, params, sdk_side)
            )
            pairs += run_queue(engine, conn, namespace, alone_prompts, alone, paired_side)
    finally:
        for proc in (gateway, keyed):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        delete_namespace(conn, namespace)
    direct = max(direct_runs, key=lambda r: r.tokens_per_s)
    through = max(gateway_runs, key=lambda r: r.tokens_per_s)
    layers = engine.model_config.num_layers
    print(f"{layers}-layer model on {engine.device}, best of {args.repeat}")
    print(f"{workload.name}, all sent at once:")
    _table(direct, through)
    print(
        f"gateway/Client throughput {through.tokens_per_s / direct.tokens_per_s:.3f}; "
        f"TTFT difference p50 {_added(direct, through, 50)}, p99 {_added(direct, through, 99)}"
    )
    spread = " ".join(
        f"{d.tokens_per_s:.1f}/{g.tokens_per_s:.1f}"
        for d, g in zip(direct_runs, gateway_runs, strict=True)
    )
    print(f"every run, Client/gateway tok/s: {spread}")
    print(
        f"{len(pairs)} requests of 16 tokens + 4 each way, one at a time, in pairs:\n"
        f"{'':<10}{'TTFT p50':>12}{'TTFT p99':>12}"
    )
    names = ("keys off", "keys on") if args.keys else ("Client", "gateway")
    for name, ttfts in ((names[0], [d for d, _ in pairs]), (names[1], [g for _, g in pairs])):
        p50, p99 = percentile(ttfts, 50) * 1000, percentile(ttfts, 99) * 1000
        print(f"{name:<10}{p50:>10.2f}ms{p99:>10.2f}ms")
    added = [g - d for d, g in pairs]
    what = "keys and limits added to TTFT" if args.keys else "added TTFT"
    print(
        f"{what}, median of the pairs' differences {percentile(added, 50) * 1000:+.2f} ms "
        f"(p99 of them {percentile(added, 99) * 1000:+.2f} ms)"
    )


def _table(direct: RunResult, through: RunResult) -> None:
    print(f"{'':<10}{'tok/s':>10}{'TTFT p50':>12}{'TTFT p99':>12}")
    for name, run in (("Client", direct), ("gateway", through)):
        p50, p99 = percentile(run.ttft, 50), percentile(run.ttft, 99)
        print(f"{name:<10}{run.tokens_per_s:>10.1f}{p50 * 1000:>10.1f}ms{p99 * 1000:>10.1f}ms")


def _added(direct: RunResult, through: RunResult, q: float) -> str:
    return f"{(percentile(through.ttft, q) - percentile(direct.ttft, q)) * 1000:+.1f} ms"
