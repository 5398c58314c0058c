"""tokenq installs as one package, `tokenq`, and its command fails in one clear line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

from tests.faults import RedisServer, free_port
from tokenq import protocol
from tokenq.protocol.params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_one_top_level_package_that_imports_the_same_way(tmp_path: Path) -> None:
    # Built from a copy: setuptools leaves a build/ folder behind in the tree it builds.
    src = tmp_path / "src"
    for part in ("tokenq", "engine", "worker", "producer", "kernels"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(src)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("tokenq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(info).decode().split() == ["tokenq"]
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"tokenq"}
    assert {"tokenq/kernels/cpu_ops.c", "tokenq/kernels/cpu_ops_typed.h"} <= set(names)
    assert "tokenq/server/dashboard.html" in names  # the gateway's /dashboard page
    lua = {n.removeprefix("tokenq/protocol/scripts/") for n in names if n.endswith(".lua")}
    assert lua == {p.name for p in (ROOT / "tokenq/protocol/scripts").glob("*.lua")}
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    script = textwrap.dedent(
        """
        import sys
        import tokenq, tokenq.engine, tokenq.worker.worker, tokenq.kernels.cpu_ops
        from tokenq import AsyncClient, Client, JobFailed, QueueFull
        from tokenq.engine import LLM, SamplingParams
        assert tokenq.engine.__file__.startswith(sys.argv[1]), tokenq.engine.__file__
        assert not {"engine", "worker", "producer", "kernels"} & set(sys.modules)
        from tokenq.protocol.scripts import source
        assert "local function start_job" in source("take")  # its include, from the wheel
        """
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(site)],
        cwd=tmp_path,  # away from the repository's own folders
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith(("torch.", "triton")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTorch())
"""


def test_a_client_only_install_says_what_to_install_for_worker_commands() -> None:
    for command in ("worker", "demo", "bench"):
        script = NO_TORCH + f"import tokenq.cli; sys.exit(tokenq.cli.main([{command!r}]))"
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"tokenq {command}: torch is not installed: pip install 'tokenq[worker]'"
        ]


def test_submit_to_a_redis_that_does_not_answer_prints_one_line() -> None:
    url = f"redis://user:secret@127.0.0.1:{free_port()}/0"
    script = (
        "import sys, tokenq.cli; "
        f"sys.exit(tokenq.cli.main(['submit', 'hi', '--redis-url', {url!r}, '--retry-for', '0.2']))"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("tokenq: cannot reach Redis at redis://user:***@127.0.0.1:")
    assert "secret" not in line


def test_a_malformed_redis_url_is_one_line_of_usage_error_before_anything_starts() -> None:
    """From the flag or the environment, for the worker (which loaded its model first, then
    died in a traceback) as for the client's commands; the password stays hidden."""
    bad = "redis://user:pw-hunter2@127.0.0.1:sixthreeseventynine/0"
    for argv, env in (
        (["worker", "--model", "/no/such/model", "--redis-url", bad], {}),
        (["submit", "hi", "--redis-url", bad], {}),
        (["models", "--redis-url", bad], {}),
        (["serve", "--redis-url", bad], {}),
        (["inspect"], {"TOKENQ_REDIS_URL": "localhost:6379"}),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "tokenq.cli", *argv],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=120,
        )
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr and "hunter2" not in proc.stderr, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert "Port could not be cast" in last or "Redis URL must specify" in last, last
        if env:
            assert last.startswith("tokenq: TOKENQ_REDIS_URL: localhost:6379: "), last
        else:
            assert f"tokenq {argv[0]}: error: argument --redis-url: redis://user:***@" in last


def test_a_command_redis_refuses_is_one_line_from_every_client_command(tmp_path: Path) -> None:
    """A server that answers but refuses (here a cluster node serving no slot; a full
    server under noeviction, a replica or an ACL refuse the same way): one line and
    status 2 from each command, never a traceback."""
    batch_input = tmp_path / "in.jsonl"
    batch_input.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
        '"body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}\n'
    )
    batch_run = ["batch", "run", str(batch_input), str(tmp_path / "out.jsonl"), "--no-progress"]
    with RedisServer(tmp_path / "redis", aof=False, cluster=True) as server:
        for argv in (["submit", "hi"], ["models"], ["inspect"], batch_run):
            proc = subprocess.run(
                [sys.executable, "-m", "tokenq.cli", *argv, "--redis-url", server.url],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert proc.returncode == 2, (argv, proc.stderr)
            who = "tokenq batch" if argv[0] == "batch" else "tokenq"
            refused = f"{who}: Redis at {server.url} refused: Hash slot not served"
            assert proc.stderr.strip().splitlines() == [refused], (argv, proc.stderr)


def test_the_protocols_sampling_parameters_are_the_engines() -> None:
    fields = {f for f in SamplingParams.__dataclass_fields__}
    assert protocol.SAMPLING_PARAMS == fields


# What each room may import from tokenq (docs/design.md, "Rooms"): every room may import the
# contract, which imports nothing else of tokenq; the servers and tools import the producer
# (and one another); worker -> engine -> kernels; nothing runs back up. The command line
# (tokenq/cli/), the benchmarks, the demo and the package root may use any room.
CONTRACT = "protocol"
TOOLS = {"server", "batch", "ops", "celery", "webhooks"}
ALLOWED = {
    CONTRACT: {CONTRACT},
    "producer": {"producer", CONTRACT},
    **{tool: TOOLS | {"producer", CONTRACT} for tool in TOOLS},
    "kernels": {"kernels"},
    "engine": {"engine", "kernels", CONTRACT},
    "worker": {"worker", "engine", "kernels", CONTRACT},
}
FOLDERS = {room: ROOT / room for room in ("producer", "kernels", "engine", "worker")}


def test_imports_run_one_way() -> None:
    import ast

    wrong = []
    for part, allowed in ALLOWED.items():
        folder = FOLDERS.get(part, ROOT / "tokenq" / part)
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "tokenq" and (len(parts) == 1 or parts[1] not in allowed):
                        wrong.append(f"{part}/{path.name} imports {name}")
    assert not wrong, wrong
