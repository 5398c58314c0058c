"""`tokenq bench`: every target parses its options, and `bench invariance` reports what it
compares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import make_tiny_llama_dir
from tokenq.bench.invariance import first_difference
from tokenq.bench.main import TARGETS
from tokenq.cli import main as tokenq
from tokenq.cli.worker import ENGINE_OPTIONS

ENGINE_TARGETS = (
    "engine",
    "queue",
    "gateway",
    "batch",
    "fleet",
    "invariance",
    "structured",
    "samples",
)


@pytest.mark.parametrize("target", TARGETS)
def test_every_bench_target_parses_its_help(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        tokenq(["bench", target, "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tokenq bench {target}")
    if target in ENGINE_TARGETS:  # tokenq worker's engine flags, every one
        for name in ENGINE_OPTIONS:
            assert f"--{name.replace('_', '-')}" in out, name


def test_first_difference_is_the_first_index_or_the_shorter_length() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_bench_samples_reports_the_prompt_computed_once_and_the_same_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_llama_dir(tmp_path / "tiny")
    argv = ["bench", "samples", "--model", str(model), "--device", "cpu", "--num-threads", "1"]
    argv += ["--num-kv-blocks", "64"]
    assert tokenq([*argv, "--n", "4", "--prompt-len", "40", "--max-tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:22].strip(): line[22:].split() for line in lines[3:5]}
    apart, one = rows["4 separate jobs"], rows["n=4 in one job"]
    assert one[2] == "40" and int(apart[2]) >= 40  # prompt tokens computed
    assert int(one[3]) < int(apart[3])  # peak KV blocks: the prompt's full ones held once
    assert lines[5].endswith("same tokens: yes")


def test_bench_invariance_reports_fp32_batched_equal_to_alone_on_a_tiny_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny model's logits are peaked (tests/helpers.py), so fp32's reordered sums in a
    batch must not move one greedy token; bf16 is reported whatever it does."""
    model = make_tiny_llama_dir(tmp_path / "tiny")
    argv = ["bench", "invariance", "--model", str(model), "--device", "cpu", "--prompts", "5"]
    argv += ["--max-tokens", "8", "--prompt-len", "4", "40", "--dtype", "float32", "bfloat16"]
    assert tokenq(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"# .+ \(amx_bf16: (yes|no), avx512_bf16: (yes|no)\); on the CPU, .+", lines[0]
    )
    assert lines[1].startswith(f"# {model}: 5 prompts of 4-40 random tokens, 8 tokens each")
    rows = [re.fullmatch(r"(\S+)\s+(\d+)/5  (.+)", line) for line in lines[3:]]
    assert [row.group(1) for row in rows if row] == ["float32", "bfloat16"], lines
    fp32, bf16 = rows
    assert (fp32.group(2), fp32.group(3)) == ("0", "-")
    differing = int(bf16.group(2))
    if differing:
        firsts = dict(pair.split(": ") for pair in bf16.group(3).split(", "))
        assert len(firsts) == differing
        assert all(0 <= int(p) < 5 and 0 <= int(i) < 8 for p, i in firsts.items())
    else:
        assert bf16.group(3) == "-"
