"""Incremental detokenization across multi-byte characters, and stop strings, in both ways the
detokenizer works: the byte table (byte-level tokenizers) against one decode of the whole
output, and the decode window (any tokenizer) against the same scheme decoded from scratch
each token."""

import random

import pytest

from tandem.engine.detokenizer import CONTEXT_TOKENS, ByteTable, IncrementalDetokenizer
from tandem.engine.tokenizer import build_byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


BOTH_WAYS = pytest.mark.parametrize("byte_level", [True, False], ids=["byte-table", "window"])


def stream(tok, text, stop=(), byte_level=True):
    prompt_ids = tok.encode("prompt: ", add_special_tokens=False)
    return lean_stream(tok, prompt_ids, tok.encode(text, add_special_tokens=False), stop, byte_level)


def test_byte_level_tokenizers_get_a_byte_table(tok):
    assert ByteTable.of(tok) is ByteTable.of(tok)  # built once per tokenizer
    assert IncrementalDetokenizer(tok, [1], [])._token_bytes is not None
    assert IncrementalDetokenizer(tok, [1], [], byte_level=False)._token_bytes is None


@BOTH_WAYS
def test_multibyte_characters_are_never_split(tok, byte_level):
    text = "héllo 日本語 🎉!"
    pieces, _ = stream(tok, text, byte_level=byte_level)
    assert len(tok.encode("🎉", add_special_tokens=False)) == 4  # one token per byte
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@BOTH_WAYS
def test_stop_string_cuts_output_and_is_never_streamed(tok, byte_level):
    pieces, stopped = stream(tok, "alpha beta STOP gamma", stop=["STOP"], byte_level=byte_level)
    assert stopped
    assert "".join(pieces) == "alpha beta "
    assert not any("S" in p for p in pieces)


@BOTH_WAYS
def test_text_that_only_starts_like_a_stop_string_is_released(tok, byte_level):
    pieces, stopped = stream(tok, "a ST b STA c", stop=["STOP"], byte_level=byte_level)
    assert not stopped and "".join(pieces) == "a ST b STA c"


def reference_stream(tok, prompt_ids, ids, stop=()):
    """The scheme decoded from scratch each token: tokens[prefix_offset:read_offset] and
    tokens[prefix_offset:], as in vLLM, with the same stop-string rules. The lean
    IncrementalDetokenizer must emit exactly this text."""
    tokens = list(prompt_ids[-CONTEXT_TOKENS:])
    prefix_offset, read_offset = 0, len(tokens)
    max_stop = max((len(s) for s in stop), default=0)
    text, emitted, pieces = "", 0, []
    for i, t in enumerate(ids):
        tokens.append(t)
        prefix_text = tok.decode(tokens[prefix_offset:read_offset], skip_special_tokens=True)
        full_text = tok.decode(tokens[prefix_offset:], skip_special_tokens=True)
        stopped = False
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            prefix_offset, read_offset = read_offset, len(tokens)
            search_from = max(0, len(text) - max_stop + 1)
            text += full_text[len(prefix_text):]
            hits = [j for j in (text.find(s, search_from) for s in stop) if j >= 0]
            if hits:
                text, stopped = text[: min(hits)], True
        finished = stopped or i == len(ids) - 1
        end = len(text) if finished or max_stop <= 1 else max(emitted, len(text) - (max_stop - 1))
        pieces.append(text[emitted:end])
        emitted = end
        if stopped:
            break
    return pieces, stopped


def lean_stream(tok, prompt_ids, ids, stop=(), byte_level=False):
    detok = IncrementalDetokenizer(tok, prompt_ids, list(stop), byte_level=byte_level)
    pieces, stopped = [], False
    for i, t in enumerate(ids):
        stopped = detok.add_tokens([t])
        pieces.append(detok.take_new_text(finished=stopped or i == len(ids) - 1))
        if stopped:
            break
    return pieces, stopped


def random_cases(vocab_size, special_ids, seed):
    """Random prompts and outputs: random ids (often invalid UTF-8 for a byte vocab, so
    characters are split and held back), prompts cut mid-character, special tokens."""
    rng = random.Random(seed)
    emoji = "héllo 日本語 🎉 naïve café 👩‍👩‍👧 ok"
    for case in range(60):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))] or [1]
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        if case % 3 == 0:
            ids[rng.randrange(len(ids))] = rng.choice(special_ids)
        stop = rng.choice([(), ("e",), ("日本", "ok"), ("é",), (" 🎉", "xyz")])
        yield prompt, ids, stop, emoji


def check_agrees(tok, vocab_size, special_ids, seed):
    for prompt, ids, stop, emoji in random_cases(vocab_size, special_ids, seed):
        assert lean_stream(tok, prompt, ids, stop) == reference_stream(tok, prompt, ids, stop)
        text_ids = tok.encode(emoji, add_special_tokens=False)
        cut = len(prompt) % len(text_ids)
        # The prompt ends part-way into the text (maybe mid-character); the output is the rest.
        prompt_ids, output_ids = prompt + text_ids[:cut], text_ids[cut:]
        assert lean_stream(tok, prompt_ids, output_ids, stop) == reference_stream(tok, prompt_ids, output_ids, stop)


def test_lean_detokenizer_agrees_with_fresh_decodes_byte_tokenizer(tok):
    check_agrees(tok, len(tok), [256, 257, 258], seed=0)


def smollm2_tokenizer():
    from tandem.engine.model.loader import models_cache_dir
    from tandem.engine.tokenizer import load_tokenizer

    path = models_cache_dir() / "smollm2-135m"
    if not (path / "tokenizer.json").is_file():
        pytest.skip("smollm2-135m has not been converted on this machine")
    return load_tokenizer(path)


def test_lean_detokenizer_agrees_with_fresh_decodes_smollm2_tokenizer():
    smol = smollm2_tokenizer()
    check_agrees(smol, len(smol), smol.all_special_ids, seed=1)


@BOTH_WAYS
def test_full_stream_equals_one_decode_on_emoji_text(tok, byte_level):
    text = "naïve 👩‍👩‍👧 café 日本語 🎉"
    ids = tok.encode(text, add_special_tokens=False)
    pieces, _ = lean_stream(tok, tok.encode("q: ", add_special_tokens=False), ids, byte_level=byte_level)
    assert "".join(pieces) == tok.decode(ids) == text


def check_byte_table(tok, vocab_size, special_ids, seed):
    """The byte table's text is one decode of the output ids (random ids: invalid UTF-8,
    characters cut at either end, special tokens), cut at the first stop string; on valid
    UTF-8 it is the decode window's text (which may release a character's bytes later: the
    window holds a token back until all of its text is complete, the byte table only the
    incomplete character)."""
    for prompt, ids, stop, emoji in random_cases(vocab_size, special_ids, seed):
        whole = tok.decode(ids, skip_special_tokens=True)
        hits = [i for i in (whole.find(s) for s in stop) if i >= 0]
        pieces, stopped = lean_stream(tok, prompt, ids, stop, byte_level=True)
        assert ("".join(pieces), stopped) == ((whole[: min(hits)], True) if hits else (whole, False))
        text_ids = tok.encode(emoji, add_special_tokens=False)
        by_bytes = lean_stream(tok, prompt, text_ids, stop, byte_level=True)
        by_window = reference_stream(tok, prompt, text_ids, stop)
        assert ("".join(by_bytes[0]), by_bytes[1]) == ("".join(by_window[0]), by_window[1])


def test_byte_table_equals_one_decode_byte_tokenizer(tok):
    check_byte_table(tok, len(tok), [256, 257, 258], seed=2)


def test_byte_table_equals_one_decode_smollm2_tokenizer():
    smol = smollm2_tokenizer()
    assert ByteTable.of(smol) is not None
    check_byte_table(smol, len(smol), smol.all_special_ids, seed=3)


@BOTH_WAYS
def test_stop_strings_anywhere_cut_the_text_at_their_first_occurrence(tok, byte_level):
    """Random texts with several stop strings of different lengths, fed a token at a time: the
    streamed text is the whole text up to the earliest stop string (or all of it), wherever
    the stop strings fall against token and hand-over boundaries."""
    rng = random.Random(7)
    stops = ["</s>", "ab", "END OF TEXT", "x"]
    for _ in range(60):
        words = [rng.choice(["hello", "a", "b", "END", "OF", "TEXT", "</", "s>", "日本", "ok", "x"])
                 for _ in range(rng.randrange(1, 30))]
        text = rng.choice(["", " "]).join(words)
        pieces, stopped = stream(tok, text, stop=stops, byte_level=byte_level)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        assert "".join(pieces) == (text[: min(hits)] if hits else text), text
        assert stopped == bool(hits)
