"""Per-key limits that every gateway shares: requests and tokens a minute and jobs at once,
counted in Redis (tokenq/protocol/scripts/rate_admit.lua) in the same script call that
submits the request's job (admit_submit.lua: `AsyncClient.submit(gate=)`), and settled
when the request ends (rate_settle.lua). The same call binds an Idempotency-Key to the job
it was first sent for.

Tokens are charged up front as the prompt's estimate (its token ids, or a token per
`CHARS_PER_TOKEN` characters: the gateway has no tokenizer) plus `max_tokens` (the model's
context when the request sets none), and corrected to the job's real usage at its end.

- `ns:gw:rate:<principal>` (hash): requests (`r:<second>`) and tokens (`t:<second>`) of
  the last minute;
- `ns:gw:running:<principal>` (sorted set): the key's jobs running, scored by when each
  claim lapses;
- `ns:gw:body:<job id>` (string): SHA-256 of the job its Idempotency-Key was first sent
  for (its submit arguments).

On a Redis Cluster the job's keys lie in its shard's slot, not with these: the three are
named `ns:gw:{<principal>}:rate`, `...:running` and `...:body:<job id>` (one slot per
principal), RATE_ADMIT runs in a call of its own before SUBMIT (told whether the job
exists), and the gateway settles what it counted when SUBMIT refuses (docs/security.md).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.cluster import RedisCluster

from tokenq.protocol import JobRequest, Keys
from tokenq.protocol.keys import Layout
from tokenq.protocol.scripts import source
from tokenq.server.auth import Policy, Principal
from tokenq.server.openai_api import BadRequest

CHARS_PER_TOKEN = 4  # English text in common BPE vocabularies; the job's usage settles it
MESSAGE_TOKENS = 4  # a chat template's tokens around each message
DEFAULT_MAX_TOKENS = 16  # a job's without max_tokens (SamplingParams'), as the worker's
CLAIM_MARGIN_S = 90  # a job's slot lapses this long past its deadline (its gateway died)


def estimate_tokens(kwargs: dict[str, Any], context: int | None) -> int:
    """Prompt and completion tokens a job may use, from `Client.submit`'s arguments;
    `context`: the model's, what a job without max_tokens may run to."""
    if kwargs.get("prompt_token_ids") is not None:
        prompt = len(kwargs["prompt_token_ids"])
    elif kwargs.get("prompt") is not None:
        prompt = math.ceil(len(kwargs["prompt"]) / CHARS_PER_TOKEN)
    else:
        messages = kwargs.get("messages") or []
        chars = sum(len(m["content"]) for m in messages)
        prompt = math.ceil(chars / CHARS_PER_TOKEN) + MESSAGE_TOKENS * len(messages)
    asked = kwargs.get("max_tokens", DEFAULT_MAX_TOKENS)
    completion = asked if asked is not None else (context or 0)
    n = kwargs.get("n", 1)  # each of a job's n outputs may run to max_tokens
    return prompt + completion * (n if isinstance(n, int) and n > 0 else 1)


def estimate_request(req: JobRequest) -> int:
    """`estimate_tokens` of a job built already (a batch line's); no context known."""
    fields = {
        "prompt": req.prompt, "messages": req.messages, "prompt_token_ids": req.prompt_token_ids
    }  # fmt: skip
    return estimate_tokens({**fields, **req.params}, None)


def reset_text(ms: int) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* headers write it: 20ms, 1s, 6m0s."""
    if ms < 1000:
        return f"{ms}ms"
    seconds = math.ceil(ms / 1000)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


@dataclass
class Admission:
    """A request let through: what it was charged, to settle at its end, and the
    x-ratelimit-* headers of its answer."""

    principal: Principal
    job_id: str
    second: int  # the window's second the tokens were charged to
    tokens: int  # charged (0 for a job that existed already)
    claimed: bool  # holds one of the key's concurrent slots
    headers: dict[str, str]
    settled: bool = False


def _headers(policy: Policy, answer: list[Any], offset: int) -> dict[str, str]:
    """OpenAI's headers from the script's counts (`offset`: where they start)."""
    requests, tokens, reset_r, reset_t = (int(x) for x in answer[offset : offset + 4])
    out = {}
    if policy.requests_per_minute:
        limit = policy.requests_per_minute
        out["x-ratelimit-limit-requests"] = str(limit)
        out["x-ratelimit-remaining-requests"] = str(max(0, limit - requests))
        out["x-ratelimit-reset-requests"] = reset_text(reset_r)
    if policy.tokens_per_minute:
        limit = policy.tokens_per_minute
        out["x-ratelimit-limit-tokens"] = str(limit)
        out["x-ratelimit-remaining-tokens"] = str(max(0, limit - tokens))
        out["x-ratelimit-reset-tokens"] = reset_text(reset_t)
    return out


class Limited(BadRequest):
    """429: a key over one of its limits, with Retry-After and its x-ratelimit-* headers."""

    def __init__(self, what: str, message: str, retry_after: int, headers: dict[str, str]):
        super().__init__(message, None, 429, "rate_limit_error", "rate_limit_exceeded")
        self.what = what  # requests, tokens, concurrent, or too_large (never fits)
        self.retry_after = retry_after
        self.headers = {**headers, "Retry-After": str(retry_after)}


def _outcome(principal: Principal, job_id: str, tokens: int, answer: list[Any]) -> Admission:
    """The script's answer as an Admission, or the refusal it means."""
    policy = principal.policy
    kind = answer[0].decode()
    if kind == "reused":
        raise BadRequest(
            "this Idempotency-Key was first sent with another request: a new request needs "
            "a new key",
            "Idempotency-Key",
            422,
            "invalid_request_error",
            "idempotency_key_reused",
        )
    if kind == "limited":
        what, wait_ms = answer[1].decode(), int(answer[2])
        headers = _headers(policy, answer, 3)
        retry = max(1, math.ceil(wait_ms / 1000))
        if what == "requests":
            message = f"over this key's {policy.requests_per_minute} requests a minute"
        elif what == "tokens":
            message = (
                f"over this key's {policy.tokens_per_minute} tokens a minute "
                f"(this request counts {tokens}: prompt and max_tokens)"
            )
        elif what == "concurrent":
            message = f"this key already runs {policy.concurrent_jobs} jobs at once"
        else:
            message = (
                f"this request counts {tokens} tokens (prompt and max_tokens), over this "
                f"key's {policy.tokens_per_minute} a minute: lower max_tokens"
            )
            retry = 60
        raise Limited(what, message, retry, headers)
    existed = bool(int(answer[6]))
    return Admission(
        principal,
        job_id,
        int(answer[1]),
        0 if existed else tokens,
        not existed and policy.concurrent_jobs > 0,
        _headers(policy, answer, 2),
    )


class RateKeys:
    """The keys of the per-key limits; `sharded` (a Redis Cluster): each principal's in a
    slot of its own, without the job key (RATE_ADMIT is then told whether it exists)."""

    def __init__(self, namespace: str, sharded: bool = False) -> None:
        self.ns = namespace
        self.jobs = Keys(namespace)
        self.sharded = sharded

    def counts(self, principal: str) -> str:
        if self.sharded:
            return f"{self.ns}:gw:{{{principal}}}:rate"
        return f"{self.ns}:gw:rate:{principal}"

    def running(self, principal: str) -> str:
        if self.sharded:
            return f"{self.ns}:gw:{{{principal}}}:running"
        return f"{self.ns}:gw:running:{principal}"

    def body(self, principal: str, job_id: str) -> str:
        if self.sharded:
            return f"{self.ns}:gw:{{{principal}}}:body:{job_id}"
        return f"{self.ns}:gw:body:{job_id}"

    def admit(self, principal: Principal, job_id: str) -> list[str]:
        keys = [
            self.counts(principal.id),
            self.running(principal.id),
            self.body(principal.id, job_id),
        ]
        return keys if self.sharded else [*keys, self.jobs.job(job_id)]

    def settle(self, principal: Principal) -> list[str]:
        return [self.counts(principal.id), self.running(principal.id)]


def _admit_args(
    policy: Policy, job_id: str, tokens: int, hold_s: float, digest: str | None, ttl: int
) -> list[Any]:
    return [
        policy.requests_per_minute,
        policy.tokens_per_minute,
        policy.concurrent_jobs,
        tokens,
        job_id,
        math.ceil(hold_s) + CLAIM_MARGIN_S,
        digest or "",
        ttl,
    ]


class AdmitGate:
    """One request's RATE_ADMIT as a `Gate` of its submit (producer/client.py): checked
    in the script call that queues its job. `admission` holds what was counted once it
    passed; `check` raises Limited, or BadRequest 422 for a reused Idempotency-Key."""

    def __init__(
        self,
        limiter: RateLimiter,
        principal: Principal,
        job_id: str,
        tokens: int,
        hold_s: float,
        digest: str | None,
    ) -> None:
        self.script = limiter.admit_submit
        self.keys = limiter.keys.admit(principal, job_id)
        policy = principal.policy
        self.args = _admit_args(policy, job_id, tokens, hold_s, digest, limiter.digest_ttl)
        self.principal, self.job_id, self.tokens = principal, job_id, tokens
        self.admission: Admission | None = None

    def check(self, answer: Any) -> None:
        self.admission = _outcome(self.principal, self.job_id, self.tokens, answer)


class RateLimiter:
    """The gateway's side (redis.asyncio); `sharded` on a Redis Cluster, where its gates
    run RATE_ADMIT alone, before SUBMIT."""

    def __init__(
        self, conn: aioredis.Redis, namespace: str, digest_ttl: int, sharded: bool = False
    ) -> None:
        self.keys = RateKeys(namespace, sharded)
        self.digest_ttl = digest_ttl
        admit = "rate_admit" if sharded else "admit_submit"
        self.admit_submit = conn.register_script(source(admit))
        self._settle = conn.register_script(source("rate_settle"))

    def gate(
        self,
        principal: Principal,
        job_id: str,
        tokens: int,
        hold_s: float,
        digest: str | None,
    ) -> AdmitGate:
        """The gate that counts one request as its job is submitted (`hold_s`: how long
        its job may run, after which its slot lapses even if nobody settles it)."""
        return AdmitGate(self, principal, job_id, tokens, hold_s, digest)

    async def settle(self, admission: Admission, used: int | None) -> None:
        """The request has ended: free its slot and correct its tokens to `used` (None:
        unknown, the charge stands)."""
        admission.settled = True
        delta = 0 if used is None or not admission.tokens else used - admission.tokens
        if not delta and not admission.claimed:
            return
        job = admission.job_id if admission.claimed else ""
        await self._settle(
            keys=self.keys.settle(admission.principal), args=[admission.second, delta, job]
        )


class SyncMeter:
    """A batch's lines against their owner's requests and tokens a minute (not its jobs at
    once: a batch's own bound is `max_outstanding`), for `BatchRun` (tokenq/batch/runner.py):
    a line waits for room instead of failing."""

    def __init__(
        self,
        conn: redis.Redis | RedisCluster,
        namespace: str,
        principal: Principal,
        layout: Layout | None = None,
    ) -> None:
        self.redis = conn  # on a Redis Cluster (`layout` sharded), redis-py's RedisCluster
        self.layout = layout or Layout(namespace)
        self.keys = RateKeys(namespace, self.layout.sharded)
        self.principal = principal
        self.policy = Policy(
            requests_per_minute=principal.policy.requests_per_minute,
            tokens_per_minute=principal.policy.tokens_per_minute,
        )
        self._admit = conn.register_script(source("rate_admit"))
        self._settle = conn.register_script(source("rate_settle"))
        self.charged: dict[str, tuple[int, int]] = {}  # job id -> (second, tokens)
        self.lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.policy.limited

    def charge(self, request: JobRequest) -> float:
        """Count a line: 0, or the seconds until the key has room for it (nothing counted).
        A line that could never fit is counted as a minute's budget of tokens."""
        principal = Principal(self.principal.id, self.principal.tenant, self.policy)
        job_id = request.job_id or ""
        tokens = estimate_request(request) if self.policy.tokens_per_minute else 0
        existed: list[int] = []
        if self.layout.sharded:  # RATE_ADMIT is told whether the job exists (another slot)
            key = self.layout.of(job_id).job(job_id)
            existed = [int(bool(job_id) and self.redis.exists(key))]
        while True:
            args = _admit_args(self.policy, job_id, tokens, 0, None, 0) + existed
            answer = self._admit(keys=self.keys.admit(principal, job_id), args=args)
            try:
                admission = _outcome(principal, job_id, tokens, answer)
            except Limited as exc:
                if exc.what != "too_large":
                    return exc.retry_after
                tokens = self.policy.tokens_per_minute
                continue
            with self.lock:
                self.charged[job_id] = (admission.second, admission.tokens)
            return 0

    def settle(self, job_id: str, used: int) -> None:
        with self.lock:
            second, tokens = self.charged.pop(job_id, (0, 0))
        if tokens and used != tokens:
            self._settle(keys=self.keys.settle(self.principal), args=[second, used - tokens, ""])
