"""Incremental detokenization across multi-byte characters, and stop strings; the lean
detokenizer against the same scheme decoded from scratch each token."""

import random

import pytest

from tandem.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from tandem.engine.tokenizer import build_byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def stream(tok, text, stop=()):
    prompt_ids = tok.encode("prompt: ", add_special_tokens=False)
    return lean_stream(tok, prompt_ids, tok.encode(text, add_special_tokens=False), stop)


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


def lean_stream(tok, prompt_ids, ids, stop=()):
    detok = IncrementalDetokenizer(tok, prompt_ids, list(stop))
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


def test_lean_detokenizer_agrees_with_fresh_decodes_smollm2_tokenizer():
    from tandem.engine.model.loader import models_cache_dir
    from tandem.engine.tokenizer import load_tokenizer

    path = models_cache_dir() / "smollm2-135m"
    if not (path / "tokenizer.json").is_file():
        pytest.skip("smollm2-135m has not been converted on this machine")
    smol = load_tokenizer(path)
    check_agrees(smol, len(smol), smol.all_special_ids, seed=1)


def test_full_stream_equals_one_decode_on_emoji_text(tok):
    text = "naïve 👩‍👩‍👧 café 日本語 🎉"
    ids = tok.encode(text, add_special_tokens=False)
    pieces, _ = lean_stream(tok, tok.encode("q: ", add_special_tokens=False), ids)
    assert "".join(pieces) == tok.decode(ids) == text
