"""Development tools (benchmarks, the transformers reference) without their extra installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenq.bench import hf_reference

# An import of a module whose sys.modules entry is None raises ImportError: transformers
# looks uninstalled, though it is there for the rest of the suite.
NO_TRANSFORMERS = "import sys; sys.modules['transformers'] = None; "


def test_the_reference_names_the_extra_when_transformers_is_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(
        ModuleNotFoundError, match=r"'bench' extra \(pip install 'tokenq\[bench\]'\)"
    ):
        hf_reference.greedy_config(4)


def test_bench_engine_without_transformers_exits_2_with_one_line() -> None:
    code = NO_TRANSFORMERS + (
        "from tokenq.cli import main; raise SystemExit(main(['bench', 'engine']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "tokenq[bench]" in line and "--no-hf" in line
    assert done.stdout == ""
