"""/v1/webhooks: an API key's own endpoints, as OpenAI's project webhooks: registered for
event types (job.completed, batch.*), each with a secret shown once, at creation. A key
sees and deletes only its own (another's id answers 404). The gateway marks the jobs of a
key that has job.completed endpoints, so that their ends are told there."""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from tokenq.protocol import Keys, quote
from tokenq.protocol.webhooks import JOB_COMPLETED
from tokenq.server.auth import Principal
from tokenq.server.openai_api import BadRequest
from tokenq.webhooks import endpoints

OWNERS_TTL_S = 2.0  # how stale the list of keys with job.completed endpoints may be


class EndpointOwners:
    """The owners with a job.completed endpoint, reread at most every OWNERS_TTL_S."""

    def __init__(self, conn: aioredis.Redis, keys: Keys) -> None:
        self.redis = conn
        self.keys = keys
        self._owners: frozenset[str] = frozenset()
        self._at = 0.0

    async def hears_jobs(self, owner: str) -> bool:
        now = time.monotonic()
        if now - self._at > OWNERS_TTL_S:
            found = await endpoints.listed(self.redis, self.keys)
            self._owners = frozenset(
                e.owner for e in found if JOB_COMPLETED in e.events and not e.disabled
            )
            self._at = now
        return owner in self._owners


def _refused(exc: BadRequest) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _shown(endpoint: endpoints.Endpoint) -> dict[str, Any]:
    out = endpoint.shown()
    del out["owner"]
    return {"object": "webhook_endpoint", **out}


def webhooks_router() -> APIRouter:
    router = APIRouter()

    def context(request: Request) -> tuple[aioredis.Redis, Keys, Principal]:
        keys = Keys(request.app.state.config.namespace)
        return request.app.state.redis, keys, request.state.principal

    @router.post("/v1/webhooks")
    async def create_endpoint(request: Request) -> Response:
        conn, keys, principal = context(request)
        secret = request.app.state.config.webhook_secret
        if not secret:
            message = "webhooks are not enabled on this gateway (--webhook-secret)"
            return _refused(BadRequest(message, None, 501, code="webhooks_not_enabled"))
        try:  # bounded before it is read (Guard)
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError, RecursionError):
            body = None
        if not isinstance(body, dict):
            return _refused(BadRequest("the request body must be a JSON object"))
        url, events = body.get("url"), body.get("events", [JOB_COMPLETED])
        if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
            return _refused(BadRequest("events must be a list of event types", "events"))
        try:
            endpoint, its_secret = await endpoints.add(
                conn, keys, url, events, principal.id, secret
            )
        except ValueError as exc:
            param = "events" if str(exc).startswith("events") else "url"
            return _refused(BadRequest(str(exc), param))
        return JSONResponse({**_shown(endpoint), "secret": its_secret}, status_code=201)

    @router.get("/v1/webhooks")
    async def list_endpoints(request: Request) -> Response:
        conn, keys, principal = context(request)
        found = await endpoints.listed(conn, keys, principal.id)
        return JSONResponse({"object": "list", "data": [_shown(e) for e in found]})

    @router.delete("/v1/webhooks/{endpoint_id}")
    async def delete_endpoint(request: Request, endpoint_id: str) -> Response:
        conn, keys, principal = context(request)
        if not await endpoints.remove(conn, keys, endpoint_id, principal.id):
            message = f"no webhook endpoint with id {quote(endpoint_id)}"
            return _refused(BadRequest(message, "id", 404))
        return JSONResponse({"id": endpoint_id, "object": "webhook_endpoint", "deleted": True})

    return router
