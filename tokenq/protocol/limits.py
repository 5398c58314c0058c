"""Size bounds of one job, shared by the client, the gateway and the worker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MAX_PRIORITY = 2**31 - 1


@dataclass(frozen=True)
class Limits:
    """Size bounds of one job, checked by the client before anything reaches Redis and by
    the worker before anything reaches the engine (so a producer that skips the client
    meets the same bounds). A bound is what keeps one hostile job from stalling a worker:
    each of these, unbounded, was measured to freeze a worker for seconds.

    The defaults admit any realistic request for a model with a 128k-token context."""

    max_payload_bytes: int = 4 << 20  # the msgpack ``data`` field
    max_prompt_chars: int = 1_000_000  # prompt, or all message contents together
    max_messages: int = 1024
    max_prompt_token_ids: int = 262_144
    # Stop strings cost every step of their job (held-back text is matched against each):
    # 16 x 256 characters keeps that well under a millisecond.
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # each stop string
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # entries
    max_metadata_bytes: int = 64 << 10  # metadata, packed
    max_structured_chars: int = 256 << 10  # structured_outputs, as JSON text
    # Outputs of one job (``n``): each holds its own KV blocks and a share of every step.
    max_n: int = 16

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = Limits()
