"""Who may use the gateway (docs/security.md): API keys, the principal each one is, what
it may do, and `Guard`, the ASGI layer in front of every route.

- A key is looked up by its SHA-256: how long a refusal takes depends on the digest of
  what was sent, never on how much of a real key it matched (constant time in the key).
  Keys are kept only as digests, so a key file may hold digests alone; the admin key is
  compared with `hmac.compare_digest`.
- A principal is named by `id`, 16 hex digits of its key's SHA-256: what Redis keys, job
  ids and logs carry. No key, nor anything that leads back to one, is logged, shown in
  metrics or put in an error.
- Without any key configured the gateway is open as it always was: one principal,
  `ANONYMOUS`, for everyone.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenq.protocol import (
    BATCH,
    DEFAULT,
    LANES,
    MAX_PRIORITY,
    TENANT_RE,
    lane_of,
)
from tokenq.server.openai_api import BadRequest, error_body

ANONYMOUS = "-"  # the one principal of a gateway without keys
ADMIN_PATHS = frozenset({"/metrics", "/dashboard", "/dashboard/data"})
DIGEST_PREFIX = "sha256:"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_SIZE = re.compile(r"^(\d+)([KMGT]?)(?:i?B)?$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
log = logging.getLogger("tokenq.gateway")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Policy:
    """What one key may do: its limits (0: none) and where in the queue it may go."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    concurrent_jobs: int = 0
    storage_bytes: int = 1 << 30  # its files' bytes at once
    lanes: frozenset[str] = frozenset({DEFAULT, BATCH})
    min_priority: int = 0
    max_priority: int = MAX_PRIORITY

    @property
    def limited(self) -> bool:
        """Whether a request must be counted in Redis."""
        return bool(self.requests_per_minute or self.tokens_per_minute or self.concurrent_jobs)

    def check_priority(self, priority: int) -> None:
        """403 for a priority outside the key's range or lanes: one public client cannot
        put itself ahead of everyone."""
        lane = lane_of(priority)
        if lane not in self.lanes:
            allowed = ", ".join(x for x in LANES if x in self.lanes)
            raise BadRequest(
                f"this API key may not use the {lane} lane (allowed: {allowed})",
                "priority",
                403,
                "permission_error",
                "lane_not_allowed",
            )
        if not self.min_priority <= priority <= self.max_priority:
            raise BadRequest(
                f"this API key may use priorities {self.min_priority} to {self.max_priority}, "
                f"not {priority}",
                "priority",
                403,
                "permission_error",
                "priority_not_allowed",
            )


OPEN_POLICY = Policy(lanes=frozenset(LANES), min_priority=-MAX_PRIORITY)


@dataclass(frozen=True)
class Principal:
    """Who a request is: one API key (or everyone, without keys), its tenant (fair share
    between tenants; None: the queue of jobs without one) and its policy."""

    id: str
    tenant: str | None
    policy: Policy

    @property
    def anonymous(self) -> bool:
        return self.id == ANONYMOUS

    def job_id(self, idempotency_key: str) -> str:
        """The job an Idempotency-Key names for this principal: another key sending the
        same header gets a job of its own. Without keys the header is the job id."""
        if self.anonymous:
            return idempotency_key
        return hashlib.sha256(f"{self.id}\n{idempotency_key}".encode()).hexdigest()[:32]


class KeyFileError(ValueError):
    """A key file that cannot be read; the message names the line, never the key."""


def digest_of(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def principal_id(digest: bytes) -> str:
    return digest.hex()[:16]


def _size(text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 512M, 2GiB, 1048576)")
    return int(match[1]) * _UNITS[match[2].upper()]


def _priorities(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("..")
    if not sep:
        raise ValueError("priority must be LOW..HIGH, e.g. -10..100")
    low_n, high_n = int(low), int(high)
    if not -MAX_PRIORITY <= low_n <= high_n <= MAX_PRIORITY:
        raise ValueError(f"priority range must lie within +-{MAX_PRIORITY}, low first")
    return low_n, high_n


def _lanes(text: str) -> frozenset[str]:
    lanes = frozenset(text.split(","))
    if not lanes <= set(LANES):
        raise ValueError(f"lanes must be among {', '.join(LANES)}")
    return lanes


def _option(policy: Policy, name: str, value: str) -> Policy:
    if name == "rpm":
        return replace(policy, requests_per_minute=int(value))
    if name == "tpm":
        return replace(policy, tokens_per_minute=int(value))
    if name == "concurrent":
        return replace(policy, concurrent_jobs=int(value))
    if name == "storage":
        return replace(policy, storage_bytes=_size(value))
    if name == "lanes":
        return replace(policy, lanes=_lanes(value))
    if name == "priority":
        low, high = _priorities(value)
        return replace(policy, min_priority=low, max_priority=high)
    raise ValueError(f"unknown option {name!r} (rpm, tpm, concurrent, storage, lanes, priority)")


def parse_keys(text: str, defaults: Policy) -> dict[bytes, Principal]:
    """A key file: one key a line, `KEY TENANT [NAME=VALUE ...]`; `#` starts a comment.
    KEY is the key itself or `sha256:` and its SHA-256 in hex; TENANT `-` for none.
    Options override `defaults`: rpm, tpm, concurrent, storage (bytes, K/M/G/T),
    lanes (comma-separated), priority (LOW..HIGH). Refused whole on any bad line."""
    out: dict[bytes, Principal] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) < 2:
            raise KeyFileError(f"line {number}: needs a key and a tenant ('-' for none)")
        key, tenant, options = words[0], words[1], words[2:]
        if key.startswith(DIGEST_PREFIX):
            hexdigest = key[len(DIGEST_PREFIX) :].lower()
            if not _HEX64.fullmatch(hexdigest):
                raise KeyFileError(f"line {number}: sha256: must be followed by 64 hex digits")
            digest = bytes.fromhex(hexdigest)
        else:
            digest = digest_of(key)
        if tenant != "-" and not TENANT_RE.fullmatch(tenant):
            raise KeyFileError(f"line {number}: tenant must match {TENANT_RE.pattern}")
        policy = defaults
        for option in options:
            name, sep, value = option.partition("=")
            if not sep:
                raise KeyFileError(f"line {number}: options are NAME=VALUE")
            try:
                policy = _option(policy, name, value)
            except ValueError as exc:
                raise KeyFileError(f"line {number}: {exc}") from None
        if digest in out:
            raise KeyFileError(f"line {number}: the same key twice")
        out[digest] = Principal(principal_id(digest), None if tenant == "-" else tenant, policy)
    return out


@dataclass
class KeyRing:
    """The keys a gateway accepts: `--api-key`s (no tenant, the default policy) and those
    of `--api-keys-file`, which `reload` reads again (SIGHUP)."""

    keys: tuple[str, ...] = ()
    file: Path | None = None
    defaults: Policy = field(default_factory=Policy)
    # Without keys: everyone, with every lane open, as before keys existed.
    anonymous: Principal = field(default_factory=lambda: Principal(ANONYMOUS, None, OPEN_POLICY))
    table: dict[bytes, Principal] = field(init=False)  # by the key's SHA-256

    def __post_init__(self) -> None:
        self.table = self._read()

    @property
    def open(self) -> bool:
        """No key configured: anyone may use the gateway."""
        return not self.keys and self.file is None

    def _read(self) -> dict[bytes, Principal]:
        table = {}
        for key in self.keys:
            digest = digest_of(key)
            table[digest] = Principal(principal_id(digest), None, self.defaults)
        if self.file is not None:
            try:
                text = self.file.read_text()
            except OSError as exc:
                raise KeyFileError(f"cannot read {self.file}: {exc.strerror}") from None
            table.update(parse_keys(text, self.defaults))
        return table

    def reload(self) -> None:
        """Read the key file again; on any error the keys in use stay, and it is logged."""
        try:
            self.table = self._read()
        except KeyFileError as exc:
            log.error("API keys not reloaded, the previous ones stay: %s", exc)
            return
        log.info("API keys reloaded: %d", len(self.table))

    def authenticate(self, presented: bytes | None) -> Principal | None:
        """The principal of a bearer token; None if it is no key of ours. The token is
        compared as its SHA-256 (the table's keys): whatever the lookup's timing reveals is
        about that digest, which says nothing of how close the token came to a real key."""
        if self.open:
            return self.anonymous
        if not presented:
            return None
        return self.table.get(digest_of(presented))

    def policy_of(self, principal: str) -> Policy:
        """A principal's policy now (a batch outlives requests): the defaults if its key
        was removed since."""
        if principal == ANONYMOUS:
            return self.anonymous.policy
        found = next((p for p in self.table.values() if p.id == principal), None)
        return self.defaults if found is None else found.policy


def apply_principal(kwargs: dict[str, Any], principal: Principal) -> None:
    """A job's tenant is its key's: a body's `user` is kept in its metadata, never a
    tenant of its choosing. Without keys, `user` stays the tenant, as before keys."""
    if principal.anonymous:
        return
    user = kwargs.pop("tenant", None)
    if user is not None:
        metadata = kwargs.get("metadata")
        kwargs["metadata"] = {**(metadata if isinstance(metadata, dict) else {}), "user": user}
    if principal.tenant is not None:
        kwargs["tenant"] = principal.tenant


def bearer(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer` header; the password of a Basic one (what a
    browser sends for the dashboard once asked)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            scheme = scheme.lower()
            if scheme == b"bearer":
                return token.strip()
            if scheme == b"basic":
                try:
                    return base64.b64decode(token.strip(), validate=True).partition(b":")[2]
                except ValueError:
                    return None
            return None
    return None


@dataclass(frozen=True)
class BodyLimits:
    """Bytes a request body may hold: uploads (a batch file and its multipart framing) and
    everything else."""

    upload: int
    other: int

    def of(self, scope: Scope) -> int:
        if scope["method"] == "POST" and scope["path"] == "/v1/files":
            return self.upload
        return self.other


class BodyTooLarge(Exception):
    pass


async def _answer(
    send: Send, status: int, body: dict[str, Any], headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw + list(headers)})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """In front of every route: `/v1/*` needs an API key (401 in OpenAI's shape without
    one), the operator's routes need the admin key, and no request body may pass its
    bound, whichever route reads it (413). A pure ASGI layer: a few microseconds a
    request, where Starlette's BaseHTTPMiddleware costs a task and a stream."""

    def __init__(
        self,
        app: ASGIApp,
        ring: KeyRing,
        body: BodyLimits,
        admin_key: str | None,
        admin_closed: bool,
    ) -> None:
        self.app = app
        self.ring = ring
        self.body = body
        self.admin_digest = None if admin_key is None else digest_of(admin_key)
        # The operator's routes here, with API keys on and no admin key: refused to all.
        self.admin_closed = admin_closed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.startswith("/v1/") or path == "/v1":
            principal = self.ring.authenticate(bearer(scope))
            if principal is None:
                await self._unauthorized(scope, send)
                return
            scope.setdefault("state", {})["principal"] = principal
        elif path in ADMIN_PATHS and not self._admin_allowed(scope):
            await self._admin_refused(send)
            return
        await self._bounded(scope, receive, send)

    def _admin_allowed(self, scope: Scope) -> bool:
        if self.admin_closed:
            return False
        if self.admin_digest is None:
            return True
        token = bearer(scope)
        return token is not None and hmac.compare_digest(digest_of(token), self.admin_digest)

    async def _unauthorized(self, scope: Scope, send: Send) -> None:
        given = any(name == b"authorization" for name, _ in scope["headers"])
        message = (
            "Incorrect API key provided."
            if given
            else "You didn't provide an API key: send it as 'Authorization: Bearer <key>'."
        )
        body = error_body(message, "invalid_request_error", None, "invalid_api_key")
        await _answer(send, 401, body, [(b"www-authenticate", b'Bearer realm="tokenq"')])

    async def _admin_refused(self, send: Send) -> None:
        if self.admin_closed:
            message = (
                "the operator's routes are closed while API keys are on: give the gateway "
                "--admin-key, or serve them on --admin-host/--admin-port"
            )
        else:
            message = "the operator's routes need the admin key (Authorization: Bearer)"
        body = error_body(message, "invalid_request_error", None, "invalid_admin_key")
        await _answer(send, 401, body, [(b"www-authenticate", b'Basic realm="tokenq admin"')])

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.body.of(scope)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _answer(send, 413, _too_large(limit).body())
                return
        seen = 0
        started = False

        async def counted() -> MutableMapping[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return message

        async def watched(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            if not started:
                await _answer(send, 413, _too_large(limit).body())


def _too_large(limit: int) -> BadRequest:
    message = f"the request body is over {limit} bytes"
    return BadRequest(message, None, 413, code="payload_too_large")
