"""Tokenizer, chat templates and streaming detokenization, against transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jinja2
import pytest

from tests.helpers import default_model_path, default_tokenizer
from tokenq.engine.loader import load_tokenizer
from tokenq.engine.output_processor import IncrementalDetokenizer
from tokenq.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; pi is 3.14159.",
    "x = 12345 + 678",
    "naïve café résumé über Ärger",
    "中文测试，你好世界！",
    "日本語のテキスト、カタカナ",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nCRLF line endings",
    "can't won't I'm they'll we've she'd",
    "Привет, мир! Ελληνικά. مرحبا بالعالم",
    "ℕ ∑ ∫ ≤ ≥ → ∞ x² y³",
    "URL: https://example.com/path?q=1&r=2#frag",
    "",
    "a",
]

# Texts where a whitespace run meets a digit. SmolLM2's tokenizer splits digits off before the
# GPT-2 regex (llama.cpp pre-tokenizer "smollm", and the model's own tokenizer.json), so the
# run stays one piece ("\n\n" -> "ĊĊ"). transformers' GGUF conversion has no "smollm" entry
# and falls back to plain GPT-2 splitting, which cuts the run in two: it is not the reference
# for these, the model's published pre-tokenizer is.
WHITESPACE_BEFORE_DIGITS = [
    "Steps:\n\n1. Mix\n2. Bake",
    "a  1",
    "price\t\t42",
    "line\n\n\n2024",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return default_tokenizer()


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow
def test_ids_equal_transformers_gguf_tokenizer(tok: Tokenizer, hf_tok: Any) -> None:
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.encode(text, add_special_tokens=True) == hf_tok.encode(text), text


@pytest.mark.slow
def test_digits_are_split_before_the_gpt2_regex(tok: Tokenizer, hf_tok: Any) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    # transformers' vocabulary and merges, with the pre-tokenizer of SmolLM2's tokenizer.json.
    reference = Backend.from_str(hf_tok.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in TEXTS + WHITESPACE_BEFORE_DIGITS:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
    steps = tok.encode("Steps:\n\n1.")
    assert [tok.id_to_token(i) for i in steps] == ["Steps", ":", "ĊĊ", "1", "."]


@pytest.mark.slow
def test_decode_round_trips_and_specials(tok: Tokenizer) -> None:
    for text in TEXTS + WHITESPACE_BEFORE_DIGITS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


@pytest.mark.slow
def test_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1  # <|im_start|>
    assert tok.eos_token_ids == [2, 0]  # <|im_end|>, <|endoftext|>
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # add_bos_token=false


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 中文 please 🙂"},
    ],
    [{"role": "user", "content": "  spaces\n\nand newlines  "}],
]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(
    tok: Tokenizer, hf_tok: Any, add_generation_prompt: bool
) -> None:
    for messages in CONVERSATIONS:
        ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        theirs = hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
    rendered = tok.apply_chat_template(CONVERSATIONS[0])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>assistant\n")


# A template using what real ones use: bos_token, raise_exception, loop controls, namespace,
# tojson on tools, whitespace control, and a {% generation %} block.
FEATURE_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0) %}
{%- if tools %}{{ '<tools>' + (tools | tojson) + '</tools>\\n' }}{% endif %}
{%- for m in messages %}
    {%- if m['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + m['role']) }}
    {%- endif %}
    {%- if m['content'] == 'SKIP' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if m['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>
    {%- else %}
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
turns={{ ns.turns }}"""


@pytest.fixture(scope="module")
def feature_folder(tmp_path_factory: pytest.TempPathFactory, tok: Tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    Tokenizer(
        tok.backend,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
        chat_template=FEATURE_TEMPLATE,
        special_tokens=tok.special_tokens,
    ).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_template_features_equal_transformers(feature_folder: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(feature_folder)
    theirs = AutoTokenizer.from_pretrained(str(feature_folder))
    tools = [{"name": "add", "parameters": {"a": "int <&> é"}}]
    messages = CONVERSATIONS[1] + [{"role": "user", "content": "SKIP"}]
    for kwargs in ({}, {"tools": tools}):
        for add_generation_prompt in (True, False):
            expected = theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
            got = ours.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **kwargs
            )
            assert got == expected
    assert "turns=4" in got
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.slow
def test_folder_tokenizer_equals_gguf_tokenizer(
    feature_folder: Path, tok: Tokenizer, tmp_path: Path
) -> None:
    """save_pretrained + load_tokenizer keeps ids, special tokens and the template; transformers
    reads the saved folder to the same ids."""
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    folder_tok = load_tokenizer(tmp_path)
    hf_folder_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS + WHITESPACE_BEFORE_DIGITS:
        ids = tok.encode(text)
        assert folder_tok.encode(text) == ids
        assert hf_folder_tok.encode(text, add_special_tokens=False) == ids
    assert folder_tok.chat_template == tok.chat_template
    assert folder_tok.bos_token_id == tok.bos_token_id
    assert folder_tok.eos_token_ids == [2]  # a bare folder only names eos_token
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_tokenizer(tmp_path).eos_token_ids == [2, 0]


def test_missing_template_and_paths_fail_clearly(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    bare = Tokenizer(Backend(WordLevel({"a": 0}, unk_token="a")))
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


# --- incremental detokenization ---------------------------------------------------------------

MULTIBYTE = [
    "中文测试，你好世界！这是一个流式解码的例子。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done",
    "Ünïcödé àéîõü ÅÄÖ ß ø ñ — “quotes” … ©®™",
    "mixed: 日本語 and العربية and हिन्दी and 한국어",
]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push([i]) for i in ids]


@pytest.mark.slow
@pytest.mark.parametrize("text", MULTIBYTE)
def test_streamed_multibyte_text_joins_to_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text
    # Some characters really are split across tokens, so holding back was exercised.
    assert any(d == "" for d in deltas)


@pytest.mark.slow
def test_streaming_after_a_prompt(tok: Tokenizer) -> None:
    prompt = tok.encode(tok.apply_chat_template(CONVERSATIONS[0]))
    completion = tok.encode("答案是 4 🎉<|im_end|>")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    deltas = stream(detok, completion)
    assert "".join(deltas) == detok.text == "答案是 4 🎉"
    assert all("\ufffd" not in d for d in deltas)
    keep = IncrementalDetokenizer(tok, prompt_token_ids=prompt, skip_special_tokens=False)
    assert "".join(stream(keep, completion)) == "答案是 4 🎉<|im_end|>"


@pytest.mark.slow
def test_push_many_at_once(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE[1])
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(deltas) == MULTIBYTE[1]


@pytest.mark.slow
def test_incomplete_character_is_held_until_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte(s) never arrive
    full = tok.decode(cut)
    assert full.startswith("ok") and full.endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(stream(detok, cut))
    assert streamed.startswith("ok") and "\ufffd" not in streamed
    assert streamed + detok.flush() == detok.text == full


@pytest.mark.slow
def test_random_ids_join_to_full_decode(tok: Tokenizer) -> None:
    """Arbitrary ids, invalid UTF-8 and specials included: deltas + flush == decode(all)."""
    rng = random.Random(0)
    byte_tokens = [i for i in range(tok.vocab_size) if len(tok.id_to_token(i)) == 1]
    for trial in range(20):
        pool = byte_tokens if trial % 2 else range(tok.vocab_size)
        ids = [rng.choice(pool) for _ in range(60)]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            text = "".join(stream(detok, ids)) + detok.flush()
            assert text == tok.decode(ids, skip_special_tokens=skip)


class CountingTokenizer(Tokenizer):
    def __init__(self, inner: Tokenizer) -> None:
        super().__init__(inner.backend)
        self.longest = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # type: ignore[override]
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


@pytest.mark.slow
def test_decoding_window_stays_small(tok: Tokenizer) -> None:
    counting = CountingTokenizer(tok)
    ids = tok.encode(" ".join(MULTIBYTE) * 20)
    detok = IncrementalDetokenizer(counting, prompt_token_ids=list(range(100, 400)))
    assert "".join(stream(detok, ids)) == tok.decode(ids)
    assert len(ids) > 500 and counting.longest <= 12


def test_a_prepared_detokenizer_decodes_once_for_a_first_token(tok: Tokenizer) -> None:
    """The worker prepares a job's detokenizer while its first step runs: that token's
    text then waits for one decode, not three (the context, the window, the next context)."""
    counting = CountingDecodes(tok)
    prompt, ids = tok.encode("Say hello"), tok.encode(" Hello there, how are you?")
    detok = IncrementalDetokenizer(counting, prompt_token_ids=prompt)
    detok.prepare()
    counting.calls = 0
    deltas = [detok.push(ids[:1])]
    assert counting.calls == 1
    deltas += stream(detok, ids[1:])
    assert "".join(deltas) + detok.flush() == tok.decode(ids)
    # Each later token: its context and the window; the flush: the same; nothing after it.
    assert counting.calls == 1 + 2 * (len(ids) - 1) + 2


class CountingDecodes(Tokenizer):
    def __init__(self, inner: Tokenizer) -> None:
        super().__init__(inner.backend)
        self.calls = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # type: ignore[override]
        self.calls += 1
        return super().decode(ids, skip_special_tokens)


def test_encode_gives_the_ids_of_the_backends_own_encode(tok: Tokenizer) -> None:
    # Tokenizer.encode goes through encode_batch (it releases the GIL); same ids.
    for text in TEXTS + WHITESPACE_BEFORE_DIGITS:
        for specials in (False, True):
            want = tok.backend.encode(text, add_special_tokens=specials).ids
            assert tok.encode(text, add_special_tokens=specials) == want


def test_max_token_chars_bounds_every_token_of_a_byte_level_vocabulary(tok: Tokenizer) -> None:
    bound = tok.max_token_chars()
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    assert bound == max(len(t) for t in vocab)
    text = "".join(TEXTS) + "Ġ" * 500 + " " * 500 + "\n" * 500
    assert len(text) <= bound * len(tok.encode(text))


def test_max_token_chars_is_none_where_text_can_vanish_before_tokens(tok: Tokenizer) -> None:
    import tokenizers
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers

    def variant() -> tokenizers.Tokenizer:
        return tokenizers.Tokenizer.from_str(tok.backend.to_str())

    nfc = variant()  # NFC composes characters: fewer of them than the client sent
    nfc.normalizer = normalizers.NFC()
    removing = variant()  # a pre-tokenizer that drops what it splits on
    removing.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel()]
    )
    stripping = variant()  # an added token that swallows the spaces before it
    stripping.add_tokens([AddedToken("<sep>", lstrip=True)])
    for backend in (nfc, removing, stripping):
        assert Tokenizer(backend).max_token_chars() is None
    isolating = variant()  # Llama 3's kind of split keeps every character: the bound holds
    isolating.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated"), pre_tokenizers.ByteLevel()]
    )
    assert Tokenizer(isolating).max_token_chars() == tok.max_token_chars()
