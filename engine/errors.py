"""Errors of the engine itself: a lifecycle bug, and a step that failed for reasons no
single request explains. A request the engine refuses raises the contract's
`InvalidRequest` (tokenq.protocol.errors)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenq.engine.outputs import RequestOutput


class InvalidTransition(RuntimeError):
    """A request state change that the lifecycle does not allow (a bug, never input)."""


class StepFailed(RuntimeError):
    """The forward pass failed for every request of the step, each of them run alone too: the
    fault is the engine's (out of memory, a broken device), not any one job's, so no request
    is blamed and none has advanced. ``outputs`` are what the step had already finished
    before the forward pass (deadline expiries): the caller must still deliver them.
    The original exception is the ``__cause__``."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs
