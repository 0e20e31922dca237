"""Structured outputs and tool calls through the official `openai` client against the shared
real cluster (two CPU backends, SmolLM2): every constrained output parses and validates
against its schema, forced tool calls come back as OpenAI `tool_calls`, and what Tandem cannot
do is a 400 that names the field. Schemas are small and bounded (maxLength, maxItems, enums)
so each answer takes a few dozen tokens on 2 cores."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.cluster.conftest import MODEL

pytestmark = pytest.mark.slow
pytest.importorskip("xgrammar")

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["color", "size", "count"]},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2}},
        "required": ["tags", "scores"]},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Describe a person who lives in a city, as JSON."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, stream=False, **kwargs):
    """(content, finish_reason) of a chat completion, streamed or not."""
    kwargs = {"model": MODEL, "messages": ASK, "max_tokens": 64, "temperature": 0, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("name, stream", [("nested", False), ("enums", True), ("arrays", False), ("nested", True)])
def test_json_schema_output_validates(openai_client, name, stream):
    schema = SCHEMAS[name]
    text, reason = chat(openai_client, stream, response_format={
        "type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_is_a_json_object(openai_client):
    ask = [{"role": "user", "content": "Return a JSON object describing a cat with its name and age."}]
    text, reason = chat(openai_client, messages=ask, response_format={"type": "json_object"}, max_tokens=48)
    assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_guided_choice_and_regex(openai_client):
    text, _ = chat(openai_client, extra_body={"guided_choice": ["yes", "no"]})
    assert text in ("yes", "no")
    text, reason = chat(openai_client, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert reason == "stop" and len(text) == 6 and text[:3].isdigit() and text[3] == "-", text


@pytest.mark.parametrize("tool_choice, stream", [("required", True), ("named", False)])
def test_forced_tool_call_returns_a_valid_tool_call(openai_client, tool_choice, stream):
    choice = "required" if tool_choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER, CLOCK], tool_choice=choice,
                  max_tokens=64, temperature=0)
    if stream:
        chunks = [c for c in openai_client.chat.completions.create(stream=True, **kwargs) if c.choices]
        calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
        reason = chunks[-1].choices[0].finish_reason
        assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        message = openai_client.chat.completions.create(**kwargs).choices[0]
        calls, reason = message.message.tool_calls, message.finish_reason
        assert message.message.content is None
    assert reason == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    if tool_choice == "named":
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_tool_history_goes_through_the_template(openai_client):
    messages = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    response = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                     tool_choice="none", max_tokens=4, temperature=0)
    assert response.choices[0].message.content and response.choices[0].message.tool_calls is None


@pytest.mark.parametrize("kwargs, param, match", [
    ({"tools": [WEATHER]}, "tool_choice", "'auto' needs"),  # SmolLM2's template has no <tool_call>
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "'auto' needs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"extra_body": {"guided_regex": "([a-z"}}, None, "regex could not be compiled"),  # the engine's refusal
])
def test_unsupported_requests_are_400s_that_say_why(openai_client, kwargs, param, match):
    with pytest.raises(openai.BadRequestError, match=match) as info:
        openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param
