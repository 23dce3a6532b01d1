"""IncrementalDetokenizer on the tiny byte-level BPE tokenizer: exact text, no split characters, stops."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer
from tests.tiny_tokenizer import make_tokenizer

REPLACEMENT = "\ufffd"
SAMPLES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "Emoji: 😀🎉 🚀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "Café naïve façade — jalapeño, Ångström; déjà vu ü ß",
    "mixed 中文 and English 😀 with ñ accents\nnew line\ttab",
    "こんにちは 안녕하세요 Привет",
]
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return make_tokenizer(Path(tmp_path_factory.mktemp("tiny-tokenizer")))


def _chunks(ids: list[int], sizes: list[int]) -> Iterator[list[int]]:
    """Split ``ids`` into consecutive chunks of the given sizes (cycled), as engine steps would."""
    pos, i = 0, 0
    while pos < len(ids):
        size = sizes[i % len(sizes)] if sizes else 1
        yield ids[pos : pos + size]
        pos += size
        i += 1


def _stream(
    tok: PreTrainedTokenizerFast,
    output: list[int],
    prompt: list[int] | None = None,
    stop: list[str] | None = None,
    sizes: list[int] | None = None,
    skip_special_tokens: bool = True,
) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tok, prompt or [], stop or [], skip_special_tokens)
    deltas = [detok.add_tokens(chunk) for chunk in _chunks(output, sizes or [1])]
    deltas.append(detok.flush())
    return detok, deltas


# ---------------------------------------------------------------- the tokenizer itself


def test_tiny_tokenizer_shape(tok: PreTrainedTokenizerFast) -> None:
    assert len(tok) <= 512
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    for text in ["😀", "🎉", "中", "好"]:
        assert len(tok.encode(text, add_special_tokens=False)) >= 2, text  # split across byte tokens
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for text in SAMPLES:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


# ---------------------------------------------------------------- exact text


@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_real_text_token_by_token(tok: PreTrainedTokenizerFast, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok, deltas = _stream(tok, ids, prompt=tok.encode("Say something:", add_special_tokens=False))
    assert "".join(deltas) == detok.text == text
    assert not any(REPLACEMENT in d for d in deltas)
    assert not detok.stopped


def test_leading_space_is_kept_with_prompt_context(tok: PreTrainedTokenizerFast) -> None:
    prompt = tok.encode("Hello", add_special_tokens=False)
    output = tok.encode(" world, and more", add_special_tokens=False)
    detok, deltas = _stream(tok, output, prompt=prompt)
    assert detok.text == " world, and more"
    assert deltas[0].startswith(" ")


def test_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    ids = [*tok.encode("hi", add_special_tokens=False), 2, 0, *tok.encode(" there", add_special_tokens=False)]
    assert _stream(tok, ids)[0].text == "hi there"
    detok, _ = _stream(tok, ids, skip_special_tokens=False)
    assert detok.text == "hi<|im_end|><|endoftext|> there" == tok.decode(ids, skip_special_tokens=False)


@HYPOTHESIS
@given(
    output=st.lists(st.integers(0, 511), max_size=60),
    prompt=st.lists(st.integers(0, 511), max_size=8),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    skip=st.booleans(),
)
def test_random_ids_concatenate_to_decode(
    tok: PreTrainedTokenizerFast, output: list[int], prompt: list[int], sizes: list[int], skip: bool
) -> None:
    """Any id sequence (partial UTF-8, special tokens, any prompt): deltas join to ``decode``."""
    detok, deltas = _stream(tok, output, prompt=prompt, sizes=sizes, skip_special_tokens=skip)
    expected = tok.decode(output, skip_special_tokens=skip)
    assert "".join(deltas) == detok.text == expected
    if REPLACEMENT not in expected:
        assert not any(REPLACEMENT in d for d in deltas)


_TEXT = st.lists(st.sampled_from([*"abc xyz,.!\n", "é", "ñ", "中", "好", "😀", "🎉", "👍🏽", "the", " world"]))


@HYPOTHESIS
@given(pieces=_TEXT, sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_no_replacement_char_ever_streamed(tok: PreTrainedTokenizerFast, pieces: list[str], sizes: list[int]) -> None:
    text = "".join(pieces)
    _, deltas = _stream(tok, tok.encode(text, add_special_tokens=False), sizes=sizes)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_decode_windows_stay_short(tok: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step decodes a few ids around the new ones, never the whole output: O(new tokens)."""
    lengths: list[int] = []
    real_decode = tok.decode

    def spy(ids: list[int], *args: Any, **kwargs: Any) -> Any:
        lengths.append(len(ids))
        return real_decode(ids, *args, **kwargs)

    monkeypatch.setattr(tok, "decode", spy)
    ids = tok.encode(" ".join(SAMPLES) * 10, add_special_tokens=False)
    detok, _ = _stream(tok, ids, prompt=[5, 6, 7, 8, 9, 10, 11])
    assert len(ids) > 1000
    assert max(lengths) <= 16
    monkeypatch.undo()
    assert detok.text == tok.decode(ids)


# ---------------------------------------------------------------- stop strings


def _check_stop(tok: PreTrainedTokenizerFast, text: str, stop: list[str], sizes: list[int] | None = None) -> None:
    """Stream ``text`` with ``stop``: exact cut before the earliest stop, never a partial stop released."""
    ids = tok.encode(text, add_special_tokens=False)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    expected = text[: min(hits)] if hits else text
    detok = IncrementalDetokenizer(tok, [], stop)
    released = ""
    for chunk in _chunks(ids, sizes or [1]):
        released += detok.add_tokens(chunk)
        assert expected.startswith(released)  # nothing past the cut is ever streamed
    released += detok.flush()
    assert released == detok.text == expected
    assert detok.stopped == bool(hits)


def test_stop_string_spanning_token_boundaries(tok: PreTrainedTokenizerFast) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    stop = "fox jumps"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert not any("fox jumps" in p.replace("Ġ", " ") for p in pieces)  # really spans tokens
    _check_stop(tok, text, [stop])


def test_stop_cut_exactly_and_nothing_after(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("Hello world! How are you today?", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], ["! How"])
    out = "".join(detok.add_tokens([i]) for i in ids)
    assert out == detok.text == "Hello world"
    assert detok.stopped
    assert detok.add_tokens(tok.encode(" more", add_special_tokens=False)) == ""
    assert detok.flush() == ""
    assert detok.text == "Hello world"


def test_earliest_of_several_stop_strings_wins(tok: PreTrainedTokenizerFast) -> None:
    text = "alpha beta gamma delta"
    _check_stop(tok, text, ["delta", "beta", "gam"])
    _check_stop(tok, text, ["a gamma", "gamma d"])  # overlapping candidates: "a gamma" starts first
    _check_stop(tok, text, ["zzz", "qq"])  # none hit: everything released on flush


def test_stop_at_start_and_unicode_stops(tok: PreTrainedTokenizerFast) -> None:
    _check_stop(tok, "Hello there", ["Hel"])
    _check_stop(tok, "一二三 😀🎉 done", ["😀🎉"])
    _check_stop(tok, "一二三 😀🎉 done", ["三 😀"])
    _check_stop(tok, "Café naïve", ["é n"])


def test_held_back_text_is_released_on_flush(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], ["a long stop string"])
    streamed = detok.add_tokens(tok.encode("short", add_special_tokens=False))
    assert streamed == ""  # "short" could still be the start of the stop string's window
    assert detok.flush() == "short"
    assert detok.text == "short" and not detok.stopped


@HYPOTHESIS
@given(
    pieces=_TEXT,
    stops=st.lists(st.text(alphabet="abc xyz中😀", min_size=1, max_size=4), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_random_stop_strings(
    tok: PreTrainedTokenizerFast, pieces: list[str], stops: list[str], sizes: list[int]
) -> None:
    _check_stop(tok, "".join(pieces), stops, sizes)


# ---------------------------------------------------------------- min_tokens and include_stop_str


def _decode(tok: PreTrainedTokenizerFast, ids: list[int]) -> str:
    text = tok.decode(ids)
    assert isinstance(text, str)  # a flat id list decodes to one string
    return text


def _vllm_cut(tok: PreTrainedTokenizerFast, ids: list[int], stop: str, min_tokens: int, include: bool) -> str:
    """vLLM's v1 detokenizer for one stop string: none counts until the output has more than
    ``min_tokens`` tokens, and then only an occurrence ending in text after the ``min_tokens``-th token
    (for ASCII text, whose decoding is context-free and never incomplete)."""
    text = _decode(tok, ids)
    if len(ids) <= min_tokens:
        return text
    exempt = len(_decode(tok, ids[:min_tokens]))
    at = text.find(stop, max(0, exempt - len(stop) + 1))
    if at < 0:
        return text
    return text[: at + len(stop)] if include else text[:at]


def _stream_cut(
    tok: PreTrainedTokenizerFast, ids: list[int], stop: str, min_tokens: int, include: bool, sizes: list[int]
) -> tuple[IncrementalDetokenizer, str]:
    detok = IncrementalDetokenizer(tok, [], [stop], min_tokens=min_tokens, include_stop_str=include)
    released = ""
    for chunk in _chunks(ids, sizes):
        released += detok.add_tokens(chunk)
    released += detok.flush()
    assert released == detok.text
    return detok, released


@pytest.mark.parametrize("sizes", [[1], [3], [2, 5]])
def test_min_tokens_exempts_the_first_tokens_text(tok: PreTrainedTokenizerFast, sizes: list[int]) -> None:
    """vLLM's own case (tests/detokenizer/test_min_tokens.py): stop "e" with min_tokens=5 skips the e's of
    the first 5 tokens and cuts at the next one; chunks spanning the 5th token (speculative runs) too."""
    text = " is Lee, and I'm a student in the college of engineering"
    ids = tok.encode(text, add_special_tokens=False)
    exempt = _decode(tok, ids[:5])
    assert "e" in exempt and len(ids) > 5  # the case under test: a stop inside the exempt text
    for min_tokens in (0, 5, len(ids)):
        expected = _vllm_cut(tok, ids, "e", min_tokens, include=False)
        detok, released = _stream_cut(tok, ids, "e", min_tokens, include=False, sizes=sizes)
        assert released == expected, min_tokens
        assert detok.stopped == (expected != text)
    assert _vllm_cut(tok, ids, "e", 0, include=False) == " is L"
    assert len(_vllm_cut(tok, ids, "e", 5, include=False)) > len(exempt)


def test_stop_string_spanning_the_min_tokens_boundary_counts(tok: PreTrainedTokenizerFast) -> None:
    """An occurrence that starts in the exempt text but ends after it is a stop (vLLM searches from
    ``len(stop) - 1`` characters before the new text)."""
    ids = tok.encode("Hello world! How are you today?", add_special_tokens=False)
    k = next(k for k in range(1, len(ids)) if _decode(tok, ids[:k]).endswith("world"))
    _, released = _stream_cut(tok, ids, "world!", k, include=False, sizes=[1])
    assert released == "Hello "


def test_include_stop_str_keeps_the_stop_string(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("Hello world! How are you today?", add_special_tokens=False)
    detok, released = _stream_cut(tok, ids, "! How", 0, include=True, sizes=[1])
    assert released == "Hello world! How" and detok.stopped


_ASCII = st.lists(st.sampled_from([*"abc xyz,.!\n", "the", " world", "ab"]))


@HYPOTHESIS
@given(
    pieces=_ASCII,
    stop=st.text(alphabet="abc xyz", min_size=1, max_size=4),
    min_tokens=st.integers(0, 8),
    include=st.booleans(),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_min_tokens_stop_strings_as_vllm(
    tok: PreTrainedTokenizerFast, pieces: list[str], stop: str, min_tokens: int, include: bool, sizes: list[int]
) -> None:
    ids = tok.encode("".join(pieces), add_special_tokens=False)
    _, released = _stream_cut(tok, ids, stop, min_tokens, include, sizes)
    assert released == _vllm_cut(tok, ids, stop, min_tokens, include)
