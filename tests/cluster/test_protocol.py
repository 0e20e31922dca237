"""OpenAI request validation: what is accepted, and that errors name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.cluster.protocol import ChatCompletionRequest, CompletionRequest, UsageInfo


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
    ({"n": 2}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"prompt": ["a", "b"]}, "one prompt"),
    ({"prompt": 5}, "prompt"),
    ({"model": 3}, "model"),
    ({"logprobs": 1}, "logprobs"),
])
def test_completion_rejects(patch, field):
    with pytest.raises(ValidationError, match=field):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", **patch})


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
