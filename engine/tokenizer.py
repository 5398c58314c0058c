"""Tokenization and chat templates.

A thin layer over the `tokenizers` library: one `Tokenizer` class whether the vocabulary comes
from a folder's `tokenizer.json` or from a GGUF file's metadata, so the engine never cares which.
transformers is deliberately not used at run time: it is slow to import and its GGUF tokenizer
conversion does not know every llama.cpp pre-tokenizer (it splits SmolLM2 text differently from
the model's own tokenizer; see `_PRE_TOKENIZER_FAMILIES`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp's `tokenizer.ggml.pre` names, grouped by the pre-tokenization they stand for
# (llama-vocab.cpp). "digits" is SmolLM2's: every digit split off on its own first, then the
# GPT-2 regex, which is what the model's original tokenizer.json does
# (Sequence[Digits(individual_digits), ByteLevel]). Splitting digits first changes more than
# digits: in "\n\n1." the newlines become one piece ("ĊĊ") instead of two.
_PRE_TOKENIZER_FAMILIES: dict[str, tuple[str, ...]] = {
    "gpt2": ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"),
    "digits": ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"),
    "llama3": ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "stablelm2"),
}


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    family = next((f for f, names in _PRE_TOKENIZER_FAMILIES.items() if pre in names), None)
    if family is None:
        logger.warning("unknown GGUF pre-tokenizer %r; using the GPT-2 split", pre)
        family = "gpt2"
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "gpt2":
        return gpt2
    if family == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    split = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class Tokenizer:
    """Encode/decode plus the chat template and the special ids the engine stops on."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = list(eos_token_ids)
        self.chat_template = chat_template
        # bos_token/eos_token/unk_token/pad_token strings, as chat templates see them.
        self.special_tokens = dict(special_tokens or {})

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token text in `text` (e.g. `<|im_start|>`) maps to its id, as in HF.

        `add_special_tokens` adds what the tokenizer's post-processor adds (BOS for Llama-style
        vocabularies). Leave it off for chat-template output: templates write BOS themselves.

        Goes through `encode_batch` because that releases the GIL while it works and `encode`
        does not (tokenizers 0.23): a megabyte of text is ~0.4 s during which every other
        Python thread of the process would stand still. Same ids, same speed.
        """
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def max_token_chars(self) -> int | None:
        """At most how many characters of text one token stands for, so that a text of more
        than ``n * max_token_chars()`` characters is known to exceed ``n`` tokens without
        tokenizing it. None when this tokenizer gives no such bound.

        The bound is the longest vocabulary string, and it holds for byte-level BPE: every
        byte of the text lands in exactly one token, whose vocabulary string has one symbol
        per byte (an added token, its own text). It fails when text can vanish or merge
        before that: a normalizer (NFC composes characters; others strip them), a
        pre-tokenizer that removes what it splits on, an added token that swallows the
        whitespace beside it, or a non-byte-level model (WordPiece turns a long word into
        one unknown token).
        """
        be = self.backend
        if be.normalizer is not None or type(be.model).__name__ != "BPE":
            return None
        if any(t.lstrip or t.rstrip for t in be.get_added_tokens_decoder().values()):
            return None
        if be.pre_tokenizer is None:
            return None
        state = json.loads(be.pre_tokenizer.__getstate__())
        nodes = [n for n in _json_nodes(state) if "type" in n]  # not e.g. a Split's pattern
        if not any(n.get("type") == "ByteLevel" for n in nodes) or any(
            n.get("type") not in _KEEPING_PRE_TOKENIZERS or n.get("behavior") == "Removed"
            for n in nodes
        ):
            return None
        return max(map(len, be.get_vocab(with_added_tokens=True)))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the chat template as transformers does (same sandbox, globals and options).

        Extra keyword arguments (tools, documents, ...) are passed to the template as variables.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        template = _compile_template(self.chat_template)
        variables = {**self.special_tokens, **kwargs}
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def save_pretrained(self, folder: str | Path) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json` (e.g. a GGUF's tokenizer into a
        safetensors model folder), readable by `loader.load_tokenizer` and by transformers."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """A Hugging Face tokenizer folder: `tokenizer.json`, optionally `tokenizer_config.json`
        (chat template, special tokens), `chat_template.jinja`, `config.json` and
        `generation_config.json` (further EOS ids)."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        tok_config = _read_json(folder / "tokenizer_config.json")
        special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(tok_config.get(name))) is not None
        }

        def token_id(name: str) -> int | None:
            return backend.token_to_id(special[name]) if name in special else None

        model_config = _read_json(folder / "config.json")
        generation_config = _read_json(folder / "generation_config.json")
        bos = token_id("bos_token")
        if bos is None:
            bos = model_config.get("bos_token_id")
        eos = _unique_ids(
            [token_id("eos_token")],
            _id_list(generation_config.get("eos_token_id")),
            _id_list(model_config.get("eos_token_id")),
        )
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            chat_template=_folder_chat_template(folder, tok_config),
            special_tokens=special,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], eos_token_ids: Sequence[int]) -> Tokenizer:
        """Byte-level BPE (``tokenizer.ggml.model`` gpt2) or SentencePiece BPE (llama)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        if kind == "gpt2":
            backend = _byte_level_backend(meta, tokens)
        elif kind == "llama":
            tokens, backend = _sentencepiece_backend(meta, tokens)
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
            meta = {"tokenizer.ggml.add_bos_token": True, **meta}
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r}: byte-level BPE ('gpt2') and "
                "SentencePiece BPE ('llama') are; use a folder with tokenizer.json for others"
            )
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        # Control tokens (<|im_start|> ...) are special: matched whole in text, skipped when
        # decoding with skip_special_tokens. User-defined ones are matched whole but kept.
        backend.add_special_tokens(
            [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, kind in enumerate(types)
                if kind == _TOKEN_CONTROL
            ]
        )
        vocab = backend.get_vocab()
        backend.add_tokens(
            [
                AddedToken(tokens[i], special=False, normalized=False)
                for i, kind in enumerate(types)
                if kind == _TOKEN_USER_DEFINED and vocab.get(tokens[i]) == i
            ]
        )

        def special_text(key: str) -> str | None:
            token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

        special = {
            name: text
            for name, key in (
                ("bos_token", "bos"),
                ("eos_token", "eos"),
                ("unk_token", "unknown"),
                ("pad_token", "padding"),
            )
            if (text := special_text(key)) is not None
        }
        backend.post_processor = _bos_eos_post_processor(meta, tokens)
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_token_ids,
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens=special,
        )


def _byte_level_backend(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    vocab: dict[str, int] = {}
    for index, text in enumerate(tokens):
        vocab.setdefault(text, index)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


_SPACE = "\u2581"  # SentencePiece's visible space


def _sentencepiece_backend(
    meta: dict[str, Any], tokens: list[str]
) -> tuple[list[str], tokenizers.Tokenizer]:
    """A SentencePiece BPE vocabulary (the tokens and their scores, no merges) as a
    `tokenizers` BPE with byte fallback, the way transformers reads the same file: merges
    are every split of a token into two tokens, the better-scored token's first. Gemma's
    scores do not follow its merge order, its tokens' order in the file does; and its
    whitespace-only tokens are stored as spaces where its pieces spell them with the
    visible space. Returns the tokens as the vocabulary spells them, and the backend."""
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    if gemma:
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    else:
        scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for index, text in enumerate(tokens):
        vocab.setdefault(text, index)
    merges: list[tuple[str, str, float]] = []
    for text, score in zip(tokens, scores, strict=True):
        pairs = [
            (text[:i], text[i:], score)
            for i in range(1, len(text))
            if text[:i] in vocab and text[i:] in vocab
        ]
        merges += sorted(pairs, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for a, b, _ in merges],
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # no space prefix: spaces become the visible space, nothing more
        backend.normalizer = normalizers.Replace(" ", _SPACE)
    else:
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            decode.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(decode)
    return tokens, backend


def _bos_eos_post_processor(
    meta: dict[str, Any], tokens: list[str]
) -> processors.PostProcessor | None:
    """llama.cpp's add_bos_token / add_eos_token flags, as a tokenizers post-processor."""

    def flagged(key: str) -> list[tuple[str, int]]:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not meta.get(f"tokenizer.ggml.add_{key}_token") or token_id is None:
            return []
        return [(tokens[token_id], token_id)]

    head, tail = flagged("bos"), flagged("eos")
    if not head and not tail:
        return None
    pre = [text for text, _ in head]
    post = [text for text, _ in tail]
    return processors.TemplateProcessing(
        single=[*pre, "$A", *post],
        pair=[*pre, "$A", *post, *pre, "$B:1", *post],
        special_tokens=list(dict.fromkeys(head + tail)),
    )


# Pre-tokenizers that keep every character of the text (unless told to remove a pattern).
_KEEPING_PRE_TOKENIZERS = frozenset({"Sequence", "ByteLevel", "Digits", "Split", "Punctuation"})


def _json_nodes(node: Any) -> Iterator[dict[str, Any]]:
    """Every dict inside a tokenizer component's JSON, the component itself first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _json_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _json_nodes(value)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _folder_chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    return template


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _unique_ids(*groups: Sequence[int | None]) -> list[int]:
    seen: dict[int, None] = {}
    for group in groups:
        for token_id in group:
            if token_id is not None:
                seen.setdefault(int(token_id), None)
    return list(seen)


# --- chat templates ---------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
            lineno
        )

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &), which would corrupt prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # Templates come from model files, i.e. untrusted: the immutable sandbox stops them from
    # touching Python internals or mutating the messages they are given.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
