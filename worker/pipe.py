"""What crosses the pipe between a worker's two processes (worker/host.py, worker/remote.py).

Queue process -> engine: `Add` lists, `Abort`, `Pause`. Engine -> queue process: `READY`
once, `Stop` (a signal came), and (outputs, Snapshot) pairs whose deltas travel as tuples
(`to_wire`, `from_wire`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenq.engine.outputs import RequestDelta
from tokenq.engine.sequence import RequestMetrics

READY = "ready"  # the queue process's first message: its worker is built


@dataclass
class Pause:
    """The Redis side owes Redis too many events: no step until it says otherwise."""

    paused: bool


@dataclass
class Stop:
    """Stop taking jobs; give in-flight ones `grace` seconds (None: the configured)."""

    grace: float | None


def to_wire(outputs: list[Any]) -> list[Any]:
    """Each step's deltas as tuples of their fields (pickled at C speed, where a dataclass
    costs a reduce call each); a running request's without its metrics, which grow every
    step (pickling them each step would cost time quadratic in a reply's length)."""
    return [
        [_delta_fields(d) for d in output] if isinstance(output, list) else output
        for output in outputs
    ]


def _delta_fields(d: RequestDelta, inner: bool = False) -> tuple[Any, ...]:
    """``inner``: an output's last delta inside its request's last (which is among them:
    its own outputs are not sent again)."""
    metrics = d.metrics if d.finished else None
    fields = (
        d.request_id, d.new_token_ids, d.new_text, d.finished, d.finish_reason,
        d.prompt_tokens, d.completion_tokens, metrics, d.logprobs, d.text, d.token_ids,
        d.error, d.error_code,
    )  # fmt: skip
    if d.index or d.outputs is not None or d.prompt_logprobs is not None:
        # n outputs, scoring: the rest, the outputs' last deltas as tuples themselves
        outputs = None
        if d.outputs is not None and not inner:
            outputs = [_delta_fields(o, inner=True) for o in d.outputs]
        fields += (d.index, outputs, d.prompt_logprobs, d.prompt_token_ids, d.prompt_text)
    return fields


# A running request's delta in the queue process: its metrics stay in the engine's process.
NOT_SENT = RequestMetrics(arrival=0.0)


def from_wire(fields: tuple[Any, ...]) -> RequestDelta:
    delta = RequestDelta(*fields)
    if delta.outputs is not None:
        delta.outputs = [from_wire(o) for o in delta.outputs]
    if delta.metrics is None:
        delta.metrics = NOT_SENT
    return delta
