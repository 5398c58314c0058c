"""``python -m tokenq.cli``, as the `tokenq` command."""

from tokenq.cli.dispatch import main

raise SystemExit(main())
