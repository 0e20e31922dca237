"""The front's detokenization (actors/output_text.py) without an engine: the text of packed
outputs is the engine detokenizer's, chunk for chunk; a stop string ends the stream at once
and asks for an abort, and what the core still sends for that request is dropped."""

from __future__ import annotations

import pytest

from tandem.actors.output_text import OutputText
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import build_byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def packed(req_id, token_ids, finished=False, reason=None, index=0):
    """engine_core.pack_output's tuple, text empty as a core that does not detokenize sends it."""
    return (req_id, token_ids, "", finished, reason, 3, 1, 0, 1.0, 1.5, 2.0, 3.0 if finished else None, index, None)


def test_text_is_the_engine_detokenizers_chunk_for_chunk(tok):
    prompt, text = [5, 6, 7], "héllo 日本 🎉 world"
    ids = tok.encode(text, add_special_tokens=False)
    texts = OutputText(tok)
    assert texts.track("r", prompt, SamplingParams(stop=["zzz"])) is False  # the front makes the text
    engine_side = IncrementalDetokenizer(tok, prompt, ["zzz"])
    got, want = [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        outputs, ended = texts.apply([packed("r", [token], finished=last, reason="length" if last else None)])
        assert ended == [] and len(outputs) == 1
        got.append(outputs[0][2])
        engine_side.add_tokens([token])
        want.append(engine_side.take_new_text(last))
    assert got == want and "".join(got) == text


def test_a_stop_string_ends_the_stream_and_the_cores_later_outputs_are_dropped(tok):
    texts = OutputText(tok)
    texts.track("r", [1], SamplingParams(stop=["END"], max_tokens=100))
    texts.track("other", [1], SamplingParams(max_tokens=100))
    ids = tok.encode("ab END cd", add_special_tokens=False)
    seen = []
    for token in ids:
        outputs, ended = texts.apply([packed("r", [token]), packed("other", [token])])
        seen.extend(outputs)
        if ended:
            break
    assert ended == ["r"]
    mine = [t for t in seen if t[0] == "r"]
    assert "".join(t[2] for t in mine) == "ab " and mine[-1][3] and mine[-1][4] == "stop"
    assert mine[-1][11] is not None  # a finish time, for the front's e2e metric
    # a token already under way, then the abort's last output: dropped; the other request goes on
    outputs, _ = texts.apply([packed("r", [9]), packed("other", [9])])
    assert [t[0] for t in outputs] == ["other"]
    outputs, _ = texts.apply([packed("r", [], finished=True, reason="abort")])
    assert outputs == [] and not texts._stopped


def test_a_stop_string_on_the_last_token_wins_and_asks_for_no_abort(tok):
    texts = OutputText(tok)
    texts.track("r", [1], SamplingParams(stop=["!"], max_tokens=1))
    outputs, ended = texts.apply([packed("r", tok.encode("!", add_special_tokens=False), True, "length")])
    assert ended == [] and outputs[0][3] and outputs[0][4] == "stop" and outputs[0][2] == ""


def test_several_choices_and_forgotten_requests_keep_the_engines_text(tok):
    texts = OutputText(tok)
    assert texts.track("group", [1], SamplingParams(n=2)) is True
    texts.track("refused", [1], SamplingParams())
    texts.forget("refused")
    out = [("group", [65], "A", False, None, 3, 1, 0, 1.0, 1.5, 2.0, None, 1, None), packed("refused", [65])]
    assert texts.apply(out) == (out, [])
