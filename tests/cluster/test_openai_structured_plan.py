"""cluster/tools.py without a cluster: which constraint a request's fields ask for (and the
400 for a contradictory or unsupported one), the schema of a forced call, the Qwen2.5
`<tool_call>` parser, streamed text split into content and calls, and tool messages through a
chat template."""

import json

import jsonschema
import pytest

from tandem.engine.errors import InvalidRequestError
from tandem.cluster.protocol import ChatCompletionRequest, CompletionRequest
from tandem.cluster.tools import ToolCallStream, plan_output, read_forced_call, read_qwen_tool_calls
from tandem.engine.tokenizer import build_byte_tokenizer, encode_chat

QWEN_LIKE_TEMPLATE = (  # the shape of Qwen2.5's: tools in the system turn, calls in <tool_call> tags
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "$defs": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"]}}}


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def schema_of(plan):
    return json.loads(plan.structured_output.json_schema)


def test_response_format_and_guided_fields_become_one_constraint():
    assert plan_output(chat(), None).structured_output is None
    assert plan_output(chat(response_format={"type": "text"}), None).structured_output is None
    assert plan_output(chat(response_format={"type": "json_object"}), None).structured_output.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    plan = plan_output(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}), None)
    assert schema_of(plan) == schema
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "p", "guided_json": json.dumps(schema)})
    assert schema_of(plan_output(completion, None)) == schema
    assert plan_output(chat(guided_regex="[a-z]+"), None).structured_output.regex == "[a-z]+"
    assert plan_output(chat(guided_choice=["a", "b"]), None).structured_output.choice == ("a", "b")


@pytest.mark.parametrize("fields, param, match", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}}, "response_format",
     r"response_format\.json_schema\.schema: .*'not'"),
    ({"guided_json": "{nope"}, "guided_json", "must hold a JSON schema"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER]}, "tool_choice", "'auto' needs .*<tool_call>"),  # auto is the default with tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "no tool is named 'nope'"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "unique"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "only one of"),
])
def test_contradictory_or_unsupported_requests_name_the_field(fields, param, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        plan_output(chat(**fields), "{{ messages }}")
    assert info.value.param == param


def test_forced_call_schemas_accept_exactly_valid_calls():
    required = plan_output(chat(tools=[WEATHER, TIME], tool_choice="required"), None)
    assert required.tool_mode == "forced" and required.template_tools[0]["function"]["name"] == "get_weather"
    schema = schema_of(required)
    jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC"}}, schema)  # $ref moved to the root
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}, schema)
    for bad in ({"name": "get_time", "arguments": {"zone": "utc"}}, {"name": "get_weather", "arguments": {}},
                {"name": "other", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = schema_of(plan_output(chat(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None))
    assert named["properties"]["name"] == {"const": "get_weather"}
    assert plan_output(chat(tools=[WEATHER], tool_choice="none"), None).template_tools is None


def test_auto_with_a_tool_call_template():
    plan = plan_output(chat(tools=[WEATHER]), QWEN_LIKE_TEMPLATE)
    assert plan.tool_mode == "auto" and plan.structured_output is None


def test_forced_call_text_becomes_a_tool_call():
    content, calls, reason = read_forced_call('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}',
                                              "stop")
    assert content is None and reason == "tool_calls" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo", "unit": "C"}
    assert read_forced_call('{"name": "get_wea', "length") == ('{"name": "get_wea', None, "length")


def test_qwen_tool_calls_are_parsed_and_the_rest_is_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls, reason = read_qwen_tool_calls(text, "stop")
    assert content == "Let me check." and reason == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].function.arguments) == {"zone": "CET"}
    assert read_qwen_tool_calls("no calls here", "stop") == ("no calls here", None, "stop")
    assert read_qwen_tool_calls("<tool_call>not json</tool_call>", "stop")[1] is None  # kept as text


@pytest.mark.parametrize("pieces", [
    ["Sure", ". <tool", "_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"],
    ["Sure. <tool_call>", "\n{\"name\": \"f\", \"arguments\": {}}", "\n</tool_call>"],
])
def test_streamed_auto_sends_content_until_a_call_starts(pieces):
    stream = ToolCallStream("auto")
    sent = "".join(stream.feed(p) for p in pieces)
    rest, calls, reason = stream.finish("stop")
    assert sent == "Sure. " and rest is None and reason == "tool_calls" and calls[0].function.name == "f"


def test_streamed_auto_without_a_call_is_all_content():
    stream = ToolCallStream("auto")
    sent = "".join(stream.feed(p) for p in ["a <", "b", " <tool"])
    assert sent == "a <b " and stream.finish("length") == ("<tool", None, "length")  # a partial tag held back


def test_tool_messages_and_calls_reach_the_template():
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    body = chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"C\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}])
    plan = plan_output(body, tokenizer.chat_template)
    text = tokenizer.decode(encode_chat(tokenizer, body.template_messages(), plan.template_tools))
    assert "<tools>get_weather;</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n4 C<|im_end|>" in text
