"""The shape of each streamed chunk, read raw from the real server and checked against the
openai client's own models of a chunk (`openai.types.chat.ChatCompletionChunk`,
`openai.types.Completion`): every chunk validates, and carries exactly the keys OpenAI sends.
A chat delta holds only what it adds (the role in the first chunk, then content, tool calls at
the end, `{}` for an end with nothing left), never `"role": null` or `"tool_calls": null`; no
chunk has a `usage` key but the last one, and that one only when stream_options.include_usage
asks for it."""

from __future__ import annotations

import contextlib
import json

import pytest
from pydantic import ValidationError
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from tests.cluster.conftest import MODEL

pytestmark = pytest.mark.slow  # starts Ray (CI runs the slow tests too)

CHUNK_KEYS = {"id", "object", "created", "model", "choices", "tandem"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
CHAT_CHOICE_KEYS = {"index", "delta", "logprobs", "finish_reason"}
COMPLETION_CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["zone"]}}}


def stream_events(http, path: str, body: dict) -> list[dict]:
    """The JSON of each `data:` event of one streamed request, up to `[DONE]` (which must come)."""
    events = []
    with http.stream("POST", path, json={"model": MODEL, "stream": True, "temperature": 0, **body}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: "):]))
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")


def check_usage_chunk(raw: dict, model_cls: type) -> None:
    assert set(raw) == CHUNK_KEYS | {"usage"} and raw["choices"] == [], raw
    assert set(raw["usage"]) == USAGE_KEYS and set(raw["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    parsed = model_cls.model_validate(raw)
    assert parsed.usage.completion_tokens >= 1 and parsed.usage.total_tokens == (
        parsed.usage.prompt_tokens + parsed.usage.completion_tokens)


def check_chat_chunk(raw: dict) -> tuple[int, dict, str | None]:
    """Validates one choice chunk; returns (index, delta as sent, finish_reason)."""
    assert set(raw) == CHUNK_KEYS and raw["object"] == "chat.completion.chunk", raw
    parsed = ChatCompletionChunk.model_validate(raw)
    assert parsed.model_fields_set == CHUNK_KEYS and set(parsed.model_extra) == {"tandem"}  # ours, as an extra
    assert len(raw["choices"]) == 1 and set(raw["choices"][0]) == CHAT_CHOICE_KEYS, raw
    choice, delta = raw["choices"][0], raw["choices"][0]["delta"]
    assert parsed.choices[0].delta.model_fields_set == set(delta), delta  # the client's model saw just these
    assert None not in delta.values(), delta
    return choice["index"], delta, choice["finish_reason"]


@pytest.mark.parametrize("include_usage", [True, False], ids=["usage", "no-usage"])
def test_chat_chunks_carry_only_what_they_add(http, include_usage):
    body = {"messages": QUESTION, "max_tokens": 8, "n": 2, "ignore_eos": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    events = stream_events(http, "/v1/chat/completions", body)
    if include_usage:
        check_usage_chunk(events.pop(), ChatCompletionChunk)
    deltas: dict[int, list[tuple[dict, str | None]]] = {0: [], 1: []}
    for raw in events:
        index, delta, reason = check_chat_chunk(raw)
        deltas[index].append((delta, reason))
    for index, chunks in deltas.items():
        first, *rest = chunks
        assert first == ({"role": "assistant", "content": ""}, None), (index, first)
        assert rest and all(reason is None for _, reason in rest[:-1]) and rest[-1][1] == "length", chunks
        for delta, _ in rest:
            assert delta == {} or (set(delta) == {"content"} and delta["content"]), (index, delta)
        assert "".join(delta.get("content", "") for delta, _ in rest), chunks


def test_chat_chunks_with_logprobs(http):
    events = stream_events(http, "/v1/chat/completions",
                           {"messages": QUESTION, "max_tokens": 3, "ignore_eos": True, "logprobs": True,
                            "top_logprobs": 2})
    first, *rest = [check_chat_chunk(raw) for raw in events]
    assert first == (0, {"role": "assistant", "content": ""}, None)
    assert events[0]["choices"][0]["logprobs"] is None
    for raw, (_, delta, _) in zip(events[1:], rest):
        assert set(delta) <= {"content"}, delta
        logprobs = raw["choices"][0]["logprobs"]
        assert set(logprobs) == {"content", "refusal"} and logprobs["content"], logprobs
        assert all(set(token) == {"token", "logprob", "bytes", "top_logprobs"} and len(token["top_logprobs"]) == 2
                   for token in logprobs["content"])
    assert rest[-1][2] == "length"


def test_a_streamed_tool_call_is_a_delta_of_tool_calls_only(http):
    events = stream_events(http, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "What time is it in Paris?"}], "tools": [CLOCK],
                            "tool_choice": "required", "max_tokens": 64})
    first, *rest = [check_chat_chunk(raw) for raw in events]
    assert first == (0, {"role": "assistant", "content": ""}, None)
    assert len(rest) == 1, rest  # a forced call sends nothing until the end, then the call whole
    _, delta, reason = rest[0]
    assert reason == "tool_calls" and set(delta) == {"tool_calls"} and len(delta["tool_calls"]) == 1, delta
    call = delta["tool_calls"][0]
    assert set(call) == {"index", "id", "type", "function"} and set(call["function"]) == {"name", "arguments"}
    parsed = ChatCompletionChunk.model_validate(events[-1]).choices[0].delta.tool_calls[0]
    assert parsed.function.name == "get_time" and json.loads(parsed.function.arguments)["zone"]


def validate_completion_chunk(raw: dict) -> Completion:
    """`Completion.model_validate`, where the one thing openai's model refuses in a chunk is the
    `"finish_reason": null` of a choice still going: its `CompletionChoice` types a finished
    choice, while OpenAI's own streams send null until the end (the client's stream reader builds
    chunks without validating them). Such a chunk is validated as its finished form."""
    going = [i for i, choice in enumerate(raw["choices"]) if choice["finish_reason"] is None]
    with pytest.raises(ValidationError) if going else contextlib.nullcontext() as refused:
        parsed = Completion.model_validate(raw)
    if not going:
        return parsed
    assert [(e["loc"], e["type"], e["input"]) for e in refused.value.errors()] == [
        (("choices", i, "finish_reason"), "literal_error", None) for i in going]
    finished = {**raw, "choices": [{**choice, "finish_reason": choice["finish_reason"] or "length"}
                                   for choice in raw["choices"]]}
    return Completion.model_validate(finished)


@pytest.mark.parametrize("include_usage", [True, False], ids=["usage", "no-usage"])
def test_completion_chunks(http, include_usage):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    events = stream_events(http, "/v1/completions", body)
    if include_usage:
        check_usage_chunk(events.pop(), Completion)
    assert events
    for raw in events:
        assert set(raw) == CHUNK_KEYS and raw["object"] == "text_completion", raw
        parsed = validate_completion_chunk(raw)
        assert parsed.model_fields_set == CHUNK_KEYS and set(parsed.model_extra) == {"tandem"}  # ours, as an extra
        assert len(raw["choices"]) == 1 and set(raw["choices"][0]) == COMPLETION_CHOICE_KEYS, raw
    reasons = [raw["choices"][0]["finish_reason"] for raw in events]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert "".join(raw["choices"][0]["text"] for raw in events)
