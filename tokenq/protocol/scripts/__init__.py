"""The Lua scripts of the protocol, one file each beside this module.

Each script runs atomically and guards itself, so a call re-sent after a lost reply does
nothing twice (docs/protocol.md). A line `-- include: <name>.lua` stands for that file's
text: the fragments several scripts share (`start_job`, `queues`) and the SUBMIT that
`replay` runs as its last step are written once.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
INCLUDE = re.compile(r"^-- include: (\w+)\.lua$", re.MULTILINE)


@cache
def source(name: str) -> str:
    """The text of script `name` (its file's stem), its includes in place."""
    text = (FOLDER / f"{name}.lua").read_text()
    return INCLUDE.sub(lambda match: source(match.group(1)), text)
