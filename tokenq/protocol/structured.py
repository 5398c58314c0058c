"""Structured outputs, vLLM's ``structured_outputs`` parameter: exactly one of ``json`` (a
JSON Schema), ``json_object``, ``regex``, ``choice`` or ``grammar`` (Lark, or GBNF as
llguidance reads it). Checked at every door (client, gateway, worker intake) by compiling
it with llguidance, so a constraint the checker cannot enforce is refused before it reaches
Redis, never silently dropped. llguidance has no dependencies: the client side can hold it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import llguidance

from tokenq.protocol.errors import InvalidRequest, clip, quote

KINDS = ("json", "json_object", "regex", "choice", "grammar")
PARAM = "structured_outputs"
# What ``json_object`` means: any JSON object (OpenAI's JSON mode), as vLLM has it.
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Compact JSON (vLLM's disable_any_whitespace): with free whitespace a small model may emit
# newlines until max_tokens. A schema's own "x-guidance" options override this.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


def _bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest("invalid_params", message, param)


def normalize(spec: Any, param: str = PARAM) -> dict[str, Any]:
    """The spec with its one kind, values of the right type; a JSON Schema given as a string
    is parsed. Refuses anything else, naming it."""
    if not isinstance(spec, dict):
        raise _bad(f"{param} must be a mapping with one of {', '.join(KINDS)}", param)
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    unknown = [k for k in given if k not in KINDS]
    if unknown:
        names = ", ".join(quote(k, 40) for k in unknown[:5])
        raise _bad(f"{param}: unknown key(s) {names}; one of {', '.join(KINDS)} is", param)
    if len(given) != 1:
        found = ", ".join(given) or "none"
        raise _bad(f"{param} needs exactly one of {', '.join(KINDS)} (got {found})", param)
    ((kind, value),) = given.items()
    where = f"{param}.{kind}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise _bad(f"{where} is not valid JSON: {clip(str(exc))}", param) from None
        if not isinstance(value, dict | bool):
            raise _bad(f"{where} must be a JSON Schema (an object)", param)
    elif kind == "json_object":
        value = True
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise _bad(f"{where} must be a non-empty string", param)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise _bad(f"{where} must be a non-empty list of strings", param)
    return {kind: value}


def grammar_text(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a normalized spec (not yet checked: `check` compiles it)."""
    ((kind, value),) = spec.items()
    try:
        return _grammar_text(kind, value)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise _bad(f"{PARAM}.{kind}: {clip(str(exc), 300)}", PARAM) from None


def _grammar_text(kind: str, value: Any) -> str:
    if kind in ("json", "json_object"):
        schema = ANY_OBJECT if kind == "json_object" else value
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.grammar_from("choice", value)
    return llguidance.grammar_from("grammar", value)  # Lark, or GBNF converted to it


def check(spec: Any, param: str = PARAM) -> dict[str, Any]:
    """Normalize and compile the spec without a tokenizer (well under a millisecond for a
    realistic schema); an error or a feature llguidance does not enforce (an unimplemented
    JSON Schema keyword, an unknown format, a look-around) is refused with its message."""
    spec = normalize(spec, param)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(spec))
    if failed:
        (kind,) = spec
        why = clip(" ".join(messages).strip(), 300)
        raise _bad(f"{param}.{kind} cannot be enforced: {why}", param)
    return spec


def digest(spec: dict[str, Any]) -> str:
    """A stable name for a normalized spec: the worker's compiled-grammar cache key (with
    the tokenizer's)."""
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
