"""`generate`: the signature of the bridge's task, sent through the current app."""

from __future__ import annotations

from typing import Any

from celery.canvas import Signature
from celery.result import AsyncResult

from tokenq.celery.bridge import DEFAULT_QUEUE, TASK_NAME


class GenerateSignature(Signature):
    """A signature of ``tokenq.generate`` that can also make signatures, as a task does."""

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """For chains, groups and chords. In a chain the previous result is the positional
        argument: it is the prompt, or fills ``{previous}`` in ``prompt`` or ``messages``."""
        return self.clone(args, kwargs)

    def si(self, *args: Any, **kwargs: Any) -> Signature:
        """Immutable: in a chain it ignores the previous task's result."""
        return self.clone(args, kwargs).set(immutable=True)

    def apply_async(
        self, args: Any = None, kwargs: dict[str, Any] | None = None, **options: Any
    ) -> AsyncResult:
        """Send through the app current now. A signature remembers the app it first sent
        through; sending a fresh copy keeps this shared one unbound."""
        return self.clone().apply_async(args, kwargs, **options)


generate = GenerateSignature(TASK_NAME, options={"queue": DEFAULT_QUEUE})
