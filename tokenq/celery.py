"""tokenq from a Celery app: `generate`, a ready signature of the task ``tokenq.generate``
that the bridge (``tokenq celery``) runs::

    from tokenq.celery import generate

    r = generate.delay(prompt="Name three rivers.", max_tokens=32, temperature=0)
    r.get(timeout=60)["text"]
    (generate.s(prompt="Name a river.") | generate.s(prompt="Where does {previous} flow?"))()

Its keyword arguments are `Client.submit`'s; the job id is the Celery task id. Importing
this module needs celery, not torch and not a running bridge: `generate` names the task
and its queue (``tokenq``; ``.set(queue=...)`` for another) and is sent through the app
that is current when it is called (`celery.current_app`: the app created last, or the one
made current with ``app.set_current()``), as a name-only signature, so the task needs no
registration in the app. Importing it also imports `tokenq.producer.errors`, which lets a
task's failure come back as `JobFailed` (with ``.code``) or `QueueFull`: Celery rebuilds an
exception class only from a module already imported.
"""

from __future__ import annotations

from typing import Any

from celery.canvas import Signature
from celery.result import AsyncResult

from tokenq.producer.celery_bridge import DEFAULT_QUEUE, PREVIOUS, PROGRESS, TASK_NAME
from tokenq.producer.errors import JobFailed, QueueFull

__all__ = ["PREVIOUS", "PROGRESS", "TASK_NAME", "JobFailed", "QueueFull", "generate"]


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
