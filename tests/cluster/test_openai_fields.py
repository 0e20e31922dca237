"""Strictness at the API edge, without a cluster: every optional field takes an explicit null,
every field Tandem does not implement is a 400 naming it, unknown fields too, and the few
harmless labels pass."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.engine.errors import InvalidRequestError
from tandem.cluster.protocol import HARMLESS_FIELDS, UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
NULLABLE_COMMON = ["max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
                   "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "min_tokens",
                   "ignore_eos", "min_p", "repetition_penalty", "stop_token_ids", "metadata", "store",
                   "service_tier", "best_of", "suffix", "echo", "parallel_tool_calls"]
# (field, a value Tandem would have to ignore to accept) for at least ten known fields.
REFUSED = [("best_of", 2), ("echo", True), ("suffix", "tail"), ("audio", {"voice": "alloy", "format": "wav"}),
           ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
           ("web_search_options", {}), ("functions", [{"name": "f"}]), ("function_call", "auto"),
           ("reasoning_effort", "low"), ("service_tier", "flex"), ("store", True), ("use_beam_search", True),
           ("prompt_logprobs", 1), ("guided_grammar", "root ::= 'a'"), ("chat_template", "{{ x }}")]


@pytest.mark.parametrize("field", NULLABLE_COMMON)
@pytest.mark.parametrize("cls, body", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)],
                         ids=["chat", "completion"])
def test_explicit_null_is_the_default(cls, body, field):
    assert cls.model_validate({**body, field: None}) == cls.model_validate(body)


def test_chat_only_nulls():
    for field in ("max_completion_tokens", "logprobs", "top_logprobs"):
        assert ChatCompletionRequest.model_validate({**CHAT, field: None}).num_logprobs is None


def test_required_fields_stay_required_when_null():
    with pytest.raises(ValidationError, match="model"):
        CompletionRequest.model_validate({**COMPLETION, "model": None})
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest.model_validate({**CHAT, "messages": None})


def test_at_least_ten_known_fields_are_refused():
    assert len(UNSUPPORTED_FIELDS) >= 10 and len(REFUSED) >= 10


@pytest.mark.parametrize("field, value", REFUSED, ids=[f for f, _ in REFUSED])
@pytest.mark.parametrize("cls, body", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)],
                         ids=["chat", "completion"])
def test_unimplemented_field_is_a_400_naming_it(cls, body, field, value):
    with pytest.raises(InvalidRequestError) as info:
        cls.model_validate({**body, field: value})
    assert info.value.param == field and info.value.message.startswith(f"{field}:")


@pytest.mark.parametrize("field, value", [("best_of", 1), ("echo", False), ("suffix", ""), ("store", False),
                                          ("service_tier", "auto"), ("modalities", ["text"]),
                                          ("skip_special_tokens", True), ("metadata", {"team": "a"}),
                                          ("prompt_cache_key", "k"), ("user", "u")])
def test_values_that_ask_for_nothing_pass(field, value):
    """Accepted, and the request is the one without the field: nothing reaches the completion."""
    parsed = CompletionRequest.model_validate({**COMPLETION, field: value})
    plain = CompletionRequest.model_validate(COMPLETION)
    if field in CompletionRequest.model_fields:  # a label Tandem keeps (user): it changes nothing else
        assert getattr(parsed, field) == value
        assert parsed.model_copy(update={field: None}) == plain
    else:  # dropped at the edge
        assert field not in parsed.model_dump() and parsed == plain


def test_best_of_equal_to_n_is_harmless():
    assert CompletionRequest.model_validate({**COMPLETION, "n": 3, "best_of": 3}).n == 3
    with pytest.raises(InvalidRequestError, match="best_of"):
        CompletionRequest.model_validate({**COMPLETION, "n": 2, "best_of": 3})


def test_unknown_field_is_refused_by_name():
    with pytest.raises(InvalidRequestError) as info:
        ChatCompletionRequest.model_validate({**CHAT, "temprature": 0.5})
    assert info.value.param == "temprature" and "unknown field" in info.value.message
    assert "metadata" in HARMLESS_FIELDS


def test_sampling_fields_parse():
    r = CompletionRequest.model_validate({**COMPLETION, "n": 3, "logprobs": 5, "presence_penalty": 1.5,
                                          "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.1,
                                          "logit_bias": {"42": -100, "7": 3.5}, "stop_token_ids": [2]})
    assert (r.n, r.num_logprobs, r.logit_bias_ids()) == (3, 5, {42: -100.0, 7: 3.5})
    chat = ChatCompletionRequest.model_validate({**CHAT, "logprobs": True, "top_logprobs": 4})
    assert chat.num_logprobs == 4
    assert ChatCompletionRequest.model_validate({**CHAT, "logprobs": True}).num_logprobs == 0


@pytest.mark.parametrize("patch, field", [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"min_p": 1.5}, "min_p"),
])
def test_out_of_range(patch, field):
    with pytest.raises(ValidationError, match=field):
        CompletionRequest.model_validate({**COMPLETION, **patch})


def test_chat_logprob_rules():
    with pytest.raises(ValidationError, match="top_logprobs"):
        ChatCompletionRequest.model_validate({**CHAT, "top_logprobs": 2})
    with pytest.raises(ValidationError, match="top_logprobs"):
        ChatCompletionRequest.model_validate({**CHAT, "logprobs": True, "top_logprobs": 21})
