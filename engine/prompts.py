"""From a request's input to the token ids the engine runs: validation, chat template,
tokenization and the context check.

Kept apart from the engine and free of torch, so that a worker's queue side, in a process
of its own, tokenizes and refuses prompts exactly as the engine would (a `Prompts` pickles:
the tokenizer travels as its JSON).
"""

from __future__ import annotations

from typing import Any

from tokenq.engine.tokenizer import Tokenizer
from tokenq.protocol.errors import InvalidRequest, clip
from tokenq.protocol.params import are_token_ids


class Prompts:
    """What a prompt may be for one model: its vocabulary and its context."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # Text longer than this cannot tokenize to fewer than max_model_len tokens (None:
        # this tokenizer gives no such bound, so every prompt is tokenized to be measured).
        chars = tokenizer.max_token_chars()
        self.max_prompt_chars = None if chars is None else max_model_len * chars

    def encode(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """A request's input (exactly one of the three) validated and tokenized, and checked
        to fit the context; ``InvalidRequest`` (``invalid_input``, ``empty_prompt``,
        ``prompt_too_long``) otherwise.

        Thread-safe: it reads only what ``__init__`` set and never changes, so a caller can
        tokenize big prompts on other threads (the tokenizer releases the GIL) while the
        engine steps, then pass the ids to ``add_request``. Text too long for the context
        whatever its tokens (see ``max_prompt_chars``) is refused without tokenizing it.
        """
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise InvalidRequest(
                "invalid_input", "give exactly one of prompt, prompt_token_ids, messages"
            )
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequest("invalid_input", "prompt must be a string")
            ids = self._encode_text(prompt, add_special_tokens=True)
        elif messages is not None:
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise InvalidRequest(
                    "invalid_input",
                    "messages must be a non-empty list of {role: str, content: str}",
                )
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except Exception as exc:  # the template's own raise_exception, bad roles
                raise InvalidRequest(
                    "invalid_input", f"chat template failed: {clip(str(exc))}"
                ) from None
            ids = self._encode_text(text, add_special_tokens=False)
        else:
            vocab = self.vocab_size
            if not isinstance(prompt_token_ids, list):
                raise InvalidRequest("invalid_input", "prompt_token_ids must be a list")
            if len(prompt_token_ids) >= self.max_model_len:  # before a pass over a huge list
                raise self._too_long(f"{len(prompt_token_ids)} tokens")
            ids = list(prompt_token_ids)
            if not are_token_ids(ids, vocab):
                raise InvalidRequest(
                    "invalid_input", f"prompt_token_ids must be a list of ids in [0, {vocab})"
                )
        if not ids:
            raise InvalidRequest("empty_prompt", "the prompt has no tokens")
        if len(ids) >= self.max_model_len:
            raise self._too_long(f"{len(ids)} tokens")
        return ids

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise self._too_long(
                f"{len(text)} characters, more than {self.max_model_len} tokens of this "
                f"vocabulary can spell ({self.max_prompt_chars})"
            )
        if not text.isascii():
            try:  # a lone surrogate ("\ud800" is valid JSON) is no UTF-8: no tokens for it
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequest(
                    "invalid_input", f"the prompt is not valid text: {exc.reason} at {exc.start}"
                ) from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _too_long(self, size: str) -> InvalidRequest:
        return InvalidRequest(
            "prompt_too_long",
            f"prompt has {size}; this worker's limit is {self.max_model_len - 1} tokens "
            f"(context {self.max_model_len})",
        )
