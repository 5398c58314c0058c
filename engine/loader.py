"""From a model name or path to a ``Checkpoint``, by file format: a ``.gguf`` file
(``gguf_loader``) or a Hugging Face folder (``hf_loader``)."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenq.engine import downloads
from tokenq.engine.checkpoint import Checkpoint
from tokenq.engine.gguf_loader import GGUF_SUFFIX, load_gguf, load_gguf_tokenizer
from tokenq.engine.hf_loader import load_hf_folder
from tokenq.engine.tokenizer import Tokenizer


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, keep_quantized: bool = False
) -> Checkpoint:
    """Load a `.gguf` file or a folder with `config.json` and `*.safetensors`;
    ``keep_quantized``: a GGUF's matrices that the quantized kernels run stay quantized."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return load_gguf(path, dtype, keep_quantized)
    if path.is_dir():
        return load_hf_folder(path, dtype)
    raise ValueError(f"not a .gguf file or a model folder: {path}")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a model alone: a `.gguf` file or a folder with `tokenizer.json`."""
    path = Path(path)
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return load_gguf_tokenizer(path)
    if path.is_dir():
        return Tokenizer.from_folder(path)
    raise FileNotFoundError(f"no tokenizer at {path}: expected a .gguf file or a model folder")


def resolve_model(name_or_path: str | Path) -> Path:
    """Map a known alias (`smollm2-135m`) to its cached file, fetching it if needed; pass
    `.gguf` files and model folders through."""
    text = str(name_or_path)
    if text in downloads.KNOWN_MODELS:
        return downloads.ensure_model(text)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    known = ", ".join(sorted(downloads.KNOWN_MODELS))
    if path.exists():
        raise ValueError(f"{path} is neither a .gguf file nor a model folder")
    raise FileNotFoundError(
        f"model {text!r} not found: expected a known alias ({known}), a .gguf file, "
        "or a folder with config.json and *.safetensors"
    )
