"""`tokenq webhooks`: the dispatchers that deliver webhook events (signed, retried, in
order per job) and the endpoints registered for them (docs/protocol.md, "Webhooks")."""
