"""The `tokenq` command (`tokenq.cli.dispatch`): one module per family of commands."""

from tokenq.cli.dispatch import EXIT_JOB_FAILED, EXIT_QUEUE_FULL, EXIT_TIMEOUT, EXIT_USAGE, main

__all__ = ["EXIT_JOB_FAILED", "EXIT_QUEUE_FULL", "EXIT_TIMEOUT", "EXIT_USAGE", "main"]
