"""Endpoints: URLs registered for event types, by the namespace's operator (`tokenq webhooks
add`, owner "") or by an API key through the gateway (owner: its principal id). Each record
keeps a nonce, never a secret: the secret is derived from the namespace's (signing.py) and
shown once, when the endpoint is made."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as aioredis

from tokenq.protocol import Keys
from tokenq.protocol.webhooks import ENDPOINT_TYPES, check_webhook
from tokenq.webhooks.whsec import endpoint_secret


@dataclass
class Endpoint:
    id: str
    url: str
    events: list[str]
    owner: str = ""  # "" the namespace's; else the API key's principal id
    nonce: str = field(default_factory=lambda: os.urandom(16).hex())
    created: float = field(default_factory=lambda: round(time.time(), 3))
    disabled: str = ""  # why deliveries stopped (410 Gone), or "" while enabled

    def shown(self) -> dict[str, Any]:
        """What listing an endpoint shows: everything but the nonce."""
        out = asdict(self)
        del out["nonce"]
        return out


def check_events(events: list[str]) -> str | None:
    """Why a list of endpoint event types is refused, or None."""
    if not events or any(e not in ENDPOINT_TYPES for e in events):
        return f"events must be a non-empty list of {', '.join(ENDPOINT_TYPES)}"
    return None


async def add(
    conn: aioredis.Redis, keys: Keys, url: str, events: list[str], owner: str, secret: str
) -> tuple[Endpoint, str]:
    """Register an endpoint; returns it with its secret (shown once). ValueError if the URL
    or the event types are refused."""
    refused = check_webhook(url, None) or check_events(events)
    if refused:
        raise ValueError(refused)
    endpoint = Endpoint("we_" + os.urandom(12).hex(), url, list(dict.fromkeys(events)), owner)
    await conn.hset(keys.webhook_endpoints, endpoint.id, json.dumps(asdict(endpoint)))
    return endpoint, endpoint_secret(secret, endpoint.id, endpoint.nonce)


async def listed(conn: aioredis.Redis, keys: Keys, owner: str | None = None) -> list[Endpoint]:
    """Every endpoint (owner None), or one owner's, oldest first."""
    rows = await conn.hgetall(keys.webhook_endpoints)
    found = [Endpoint(**json.loads(raw)) for raw in rows.values()]
    return sorted((e for e in found if owner is None or e.owner == owner), key=lambda e: e.created)


async def remove(
    conn: aioredis.Redis, keys: Keys, endpoint_id: str, owner: str | None = None
) -> bool:
    """Delete an endpoint (of `owner`, when given); False if there is none such."""
    raw = await conn.hget(keys.webhook_endpoints, endpoint_id)
    if raw is None or (owner is not None and json.loads(raw)["owner"] != owner):
        return False
    return bool(await conn.hdel(keys.webhook_endpoints, endpoint_id))


async def disable(conn: aioredis.Redis, keys: Keys, endpoint_id: str, why: str) -> None:
    raw = await conn.hget(keys.webhook_endpoints, endpoint_id)
    if raw is not None:
        record = json.loads(raw)
        record["disabled"] = why
        await conn.hset(keys.webhook_endpoints, endpoint_id, json.dumps(record))
