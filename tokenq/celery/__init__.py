"""tokenq from a Celery app: `generate`, a ready signature of the task ``tokenq.generate``
that the bridge (``tokenq celery``) runs::

    from tokenq.celery import generate

    r = generate.delay(prompt="Name three rivers.", max_tokens=32, temperature=0)
    r.get(timeout=60)["text"]
    (generate.s(prompt="Name a river.") | generate.s(prompt="Where does {previous} flow?"))()

Its keyword arguments are `Client.submit`'s; the job id is the Celery task id. Using it
needs celery, not torch and not a running bridge: `generate` names the task
and its queue (``tokenq``; ``.set(queue=...)`` for another) and is sent through the app
that is current when it is called (`celery.current_app`: the app created last, or the one
made current with ``app.set_current()``), as a name-only signature, so the task needs no
registration in the app. Importing it also imports `tokenq.producer.errors`, which lets a
task's failure come back as `JobFailed` (with ``.code``) or `QueueFull`: Celery rebuilds an
exception class only from a module already imported.

`generate` is loaded on first use: the `tokenq` command imports the bridge from here to
declare `tokenq celery`, on installs without celery too.
"""

from __future__ import annotations

from typing import Any

from tokenq.celery.bridge import PREVIOUS, PROGRESS, TASK_NAME
from tokenq.producer.errors import JobFailed, QueueFull

__all__ = ["PREVIOUS", "PROGRESS", "TASK_NAME", "JobFailed", "QueueFull", "generate"]


def __getattr__(name: str) -> Any:
    if name == "generate":
        from tokenq.celery.signature import generate

        return generate
    raise AttributeError(f"module 'tokenq.celery' has no attribute {name!r}")
