"""OpenAI request validation: what is accepted, that errors name the field, and that the body
parser turns hostile JSON into `InvalidRequestError` (a 400 at the edge), never another exception."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.engine.errors import InvalidRequestError
from tandem.cluster.protocol import (
    MAX_JSON_DEPTH,
    MAX_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    UsageInfo,
    parse_json_object,
)


def test_completion_defaults_and_extras():
    r = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "top_k": 5, "ignore_eos": True,
                                          "min_tokens": 2, "seed": 7, "stop": "x", "temperature": 0})
    assert (r.max_tokens, r.top_k, r.ignore_eos, r.min_tokens, r.seed, r.stop_list) == (None, 5, True, 2, 7, ["x"])
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["one"]}).prompt == "one"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]


@pytest.mark.parametrize("patch, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 17}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"prompt": ["a", "b"]}, "one prompt"),
    ({"prompt": 5}, "prompt"),
    ({"model": 3}, "model"),
    ({"logprobs": 21}, "logprobs"),
    ({"seed": MAX_SEED + 1}, "seed"),
    ({"seed": -1}, "seed"),
    ({"top_k": 2**31}, "top_k"),
    ({"min_tokens": 2**40}, "min_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [2**31]}, "prompt"),
])
def test_completion_rejects(patch, field):
    with pytest.raises(ValidationError, match=field):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", **patch})


def test_seed_takes_the_whole_unsigned_64_bit_range():
    """The engine seeds a torch.Generator, whose manual_seed takes [0, 2**64 - 1]."""
    import torch

    for seed in (0, 2**63, MAX_SEED):
        assert CompletionRequest.model_validate({"model": "m", "prompt": "hi", "seed": seed}).seed == seed
        assert torch.Generator().manual_seed(seed).initial_seed() == seed


def test_chat_messages():
    r = ChatCompletionRequest.model_validate({"model": "m", "max_completion_tokens": 9, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert r.max_tokens == 9
    assert r.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("body, field", [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": "m", "messages": "hello"}, "messages"),
])
def test_chat_rejects(body, field):
    with pytest.raises(ValidationError, match=field):
        ChatCompletionRequest.model_validate(body)


def test_usage_carries_cached_tokens():
    usage = UsageInfo.of(10, 5, 8).model_dump()
    assert usage == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                     "prompt_tokens_details": {"cached_tokens": 8}}


@pytest.mark.parametrize("raw, message", [
    (b"[" * 50_000 + b"]" * 50_000, "nested deeper"),
    (b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "nested deeper"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "digits"),
    (b'{"temperature": 1' + b"0" * 70 + b".5}", "digits"),
    (b'{"temperature": 1e999}', "out of range"),
    (b'{"temperature": NaN}', "NaN"),
    (b'{"temperature": -Infinity}', "Infinity"),
    (b'{"prompt": "\\ud800"}', "lone surrogate"),
    (b'{"prompt": ["ok", {"x": "\\udfff"}]}', "lone surrogate"),
    (b'{"\\ud800": 1}', "lone surrogate"),
    (b'{"prompt": "\xff"}', "UTF-8"),
    ("{}".encode("utf-16"), "UTF-8"),
    (b'{"prompt": ', "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'"text"', "JSON object"),
])
def test_hostile_json_is_an_invalid_request(raw, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_json_object(raw)


def test_the_long_number_scans_agree():
    """A long body's digit runs are measured with numpy, a short one's with the regex: both say
    the same of runs at, below and above the limit, anywhere in the text."""
    from tandem.cluster.protocol import MAX_NUMBER_DIGITS, _LONG_NUMBER, _longest_digit_run

    ids = ", ".join(str(i * 7919 % 151_000) for i in range(2000))
    for run in (1, MAX_NUMBER_DIGITS, MAX_NUMBER_DIGITS + 1, 5000):
        digits = "9" * run
        for text in (digits, f'{{"prompt": [{digits}, {ids}]}}', f'{{"prompt": [{ids}], "seed": {digits}}}',
                     f'{{"x": 1e{digits}}}', "", "{}"):
            assert (_longest_digit_run(text) > MAX_NUMBER_DIGITS) == (_LONG_NUMBER.search(text) is not None)
    long_ids = f'{{"prompt": [{ids}], "seed": {"1" * (MAX_NUMBER_DIGITS + 1)}}}'
    with pytest.raises(InvalidRequestError, match="digits"):
        parse_json_object(long_ids.encode())
    assert len(parse_json_object(f'{{"prompt": [{ids}]}}'.encode())["prompt"]) == 2000


def test_text_that_looks_like_structure_is_just_text():
    """Brackets, digits and escaped surrogate pairs inside strings are content, not structure."""
    deep = "[" * 1000 + "{" * 1000
    raw = ('{"prompt": "' + deep + '\\"' + "1" * 100 + '", "stop": ["\\ud83d\\ude00"], "seed": 18446744073709551615}')
    data = parse_json_object(raw.encode())
    assert data == {"prompt": deep + '"' + "1" * 100, "stop": ["\U0001f600"], "seed": MAX_SEED}


def test_each_error_class_is_translated_once_with_no_internals():
    """One status per meaning at the HTTP edge; Retry-After on 429 and 503; the detail meant for
    the log never reaches the body, the request id always does."""
    import json

    from tandem.cluster import errors
    from tandem.engine.errors import BackendUnavailableError, DeadlineUnmetError, OverloadedError, TandemError

    expected = {InvalidRequestError: 400, errors.Unauthorized: 401, errors.RouteNotFound: 404,
                errors.ModelNotFound: 404, errors.MethodNotAllowed: 405, errors.PayloadTooLarge: 413,
                errors.UnsupportedMediaType: 415, OverloadedError: 429, DeadlineUnmetError: 429,
                BackendUnavailableError: 503, TandemError: 500}
    assert set(expected) == set(errors.HTTP_ERRORS)
    for cls, status in expected.items():
        if cls is DeadlineUnmetError:  # carries the router's projection and retry time
            exc = DeadlineUnmetError("what went wrong", projected_ttft_s=1.0, retry_after_s=0.5)
            exc.detail = "Traceback: pid=123 actor_id=abc"
        else:
            exc = cls("what went wrong", detail="Traceback: pid=123 actor_id=abc")
        response = errors.error_response(exc, "req-1")
        body = json.loads(response.body)
        assert response.status_code == status and body["error"]["message"] == "what went wrong"
        assert body["error"]["request_id"] == response.headers["x-tandem-request-id"] == "req-1"
        assert "pid=" not in response.body.decode()
        assert ("retry-after" in response.headers) == (status in (429, 503))
