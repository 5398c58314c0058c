"""Standard Webhooks signatures, made by the `standardwebhooks` package itself."""

from __future__ import annotations

from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook


def headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt (`webhook-timestamp` is the attempt's)."""
    at = datetime.fromtimestamp(timestamp, UTC)
    signature = Webhook(secret).sign(msg_id, at, body.decode())
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature,
        "content-type": "application/json",
        "user-agent": "tokenq-webhooks",
    }
