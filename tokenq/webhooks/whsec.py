"""Webhook secrets (`whsec_`, as Standard Webhooks writes them). A job's own webhook is
signed with the namespace's secret; each endpoint's secret is derived from that secret and
a nonce kept with the endpoint, so Redis holds nothing a reader could sign with. Standard
library only: the gateway makes endpoints without the dispatcher's packages."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os

PREFIX = "whsec_"


def new_secret() -> str:
    """A fresh `whsec_` secret (24 random bytes), for `--webhook-secret`."""
    return PREFIX + base64.b64encode(os.urandom(24)).decode()


def secret_bytes(secret: str) -> bytes:
    """The key of a `whsec_` secret; ValueError (naming no part of it) if it is not one."""
    if not secret.startswith(PREFIX):
        raise ValueError("a webhook secret starts with whsec_ (tokenq webhooks secret makes one)")
    try:
        key = base64.b64decode(secret[len(PREFIX) :], validate=True)
    except binascii.Error:
        raise ValueError("a webhook secret is whsec_ and base64") from None
    if len(key) < 16:
        raise ValueError("a webhook secret holds at least 16 bytes")
    return key


def endpoint_secret(namespace_secret: str, endpoint_id: str, nonce: str) -> str:
    """An endpoint's secret: HMAC-SHA256 of its id and nonce under the namespace's key."""
    message = f"tokenq endpoint secret:{endpoint_id}:{nonce}".encode()
    mac = hmac.new(secret_bytes(namespace_secret), message, hashlib.sha256).digest()
    return PREFIX + base64.b64encode(mac).decode()
