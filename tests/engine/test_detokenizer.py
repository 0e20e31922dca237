"""Incremental detokenization across multi-byte characters, and stop strings."""

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import build_byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def stream(tok, text, stop=()):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt: ", add_special_tokens=False), list(stop))
    pieces, stopped = [], False
    for i, t in enumerate(ids):
        stopped = detok.add_tokens([t])
        pieces.append(detok.take_new_text(finished=stopped or i == len(ids) - 1))
        if stopped:
            break
    return pieces, stopped


def test_multibyte_characters_are_never_split(tok):
    text = "héllo 日本語 🎉!"
    pieces, _ = stream(tok, text)
    assert len(tok.encode("🎉", add_special_tokens=False)) == 4  # one token per byte
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_output_and_is_never_streamed(tok):
    pieces, stopped = stream(tok, "alpha beta STOP gamma", stop=["STOP"])
    assert stopped
    assert "".join(pieces) == "alpha beta "
    assert not any("S" in p for p in pieces)


def test_text_that_only_starts_like_a_stop_string_is_released(tok):
    pieces, stopped = stream(tok, "a ST b STA c", stop=["STOP"])
    assert not stopped and "".join(pieces) == "a ST b STA c"
