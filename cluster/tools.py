"""Structured outputs and tool calls at the HTTP edge: what a request's fields ask the engine
to constrain, what the chat template is given, and how the generated text becomes OpenAI
`tool_calls`.

One request can constrain its output one way: `response_format` (`json_object`, or
`json_schema` with `name`, `schema`, `strict`), vLLM's `guided_json` / `guided_regex` /
`guided_choice`, or a forced tool call. Each becomes a `StructuredOutputParams` on the
request's `SamplingParams`; the engine compiles it into a grammar (engine/structured_output.py)
and masks every sampled token with it.

Tools (`tools` with `tool_choice`):

- `"none"`: the tools are not shown to the model and nothing is parsed.
- `"required"` or a named function: forced through the grammar. The model must write one call
  as `{"name": ..., "arguments": {...}}`, the name one of the tools (or the named one) and the
  arguments valid against that function's `parameters`; the text is returned as one
  `tool_calls` entry (arguments as a JSON string, as OpenAI sends them) with finish_reason
  `"tool_calls"`. Streamed, the call comes whole in one delta when the output ends.
- `"auto"` (the default when tools are given): the model decides, so its own call format is
  parsed afterwards. Tandem knows Qwen2.5's (`<tool_call>{"name": ..., "arguments": ...}
  </tool_call>`, recognised by that tag in the model's chat template); for any other template
  the request is refused with a 400 naming `tool_choice`, rather than returning calls as text.
  Streamed, text before the first `<tool_call>` streams as content and the calls come in one
  delta at the end.

Tool messages (`role: "tool"`) and assistant messages with `tool_calls` go to the chat template
as transformers expects them (arguments as objects), along with the tool definitions, so a
template that renders tools (Qwen2.5's does; SmolLM2's ignores them) shows the model the
conversation as it was.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling_params import InvalidRequestError
from tandem.engine.structured_output import StructuredOutputParams, check_enforceable

QWEN_TOOL_CALL_TAG = "<tool_call>"
_QWEN_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128


# -- request fields --------------------------------------------------------------------------
class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr = Field(pattern=_FUNCTION_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int = 0


# -- what a request asks for -----------------------------------------------------------------
@dataclass(frozen=True)
class OutputPlan:
    """How one request's output is constrained and read back."""

    structured_output: StructuredOutputParams | None = None
    template_tools: list[dict[str, Any]] | None = None  # the tools the chat template renders
    tool_mode: Literal["none", "auto", "forced"] = "none"
    tool_names: tuple[str, ...] = field(default=())

    def tool_stream(self) -> ToolCallStream | None:
        """A per-choice reader of streamed text, or None when the output is plain text."""
        return None if self.tool_mode == "none" else ToolCallStream(self.tool_mode)

    def read(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content, tool_calls, finish_reason) of a finished choice's text."""
        if self.tool_mode == "forced":
            return read_forced_call(text, finish_reason)
        if self.tool_mode == "auto":
            return read_qwen_tool_calls(text, finish_reason)
        return text, None, finish_reason


def plan_output(body: Any, chat_template: str | None) -> OutputPlan:
    """The request's constraint and tool handling; `InvalidRequestError` naming the field otherwise.
    `body` is a completion or chat request (cluster/protocol.py)."""
    constraints = _constraints(body)
    tools = getattr(body, "tools", None) or []
    tool_choice = getattr(body, "tool_choice", None)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice not in ("none", "auto"):
            raise InvalidRequestError("tool_choice: a forced tool call needs tools", param="tool_choice")
        return OutputPlan(structured_output=_single(constraints))
    names = tuple(t.function.name for t in tools)
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique", param="tools")
    if tool_choice == "none":
        return OutputPlan(structured_output=_single(constraints))
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if tool_choice == "auto":
        if QWEN_TOOL_CALL_TAG not in (chat_template or ""):
            raise InvalidRequestError(
                "tool_choice: 'auto' needs a model whose chat template writes tool calls in a format Tandem "
                "parses (Qwen2.5's <tool_call>); this model's does not. Use tool_choice 'required' or name "
                "a function to force a call through the grammar", param="tool_choice")
        return OutputPlan(structured_output=_single(constraints), template_tools=template_tools,
                          tool_mode="auto", tool_names=names)
    if tool_choice != "required":
        if tool_choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice: no tool is named {tool_choice.function.name[:64]!r}",
                                      param="tool_choice")
        tools = [t for t in tools if t.function.name == tool_choice.function.name]
    constraints.append(("tool_choice", _call_schema(tools)))
    return OutputPlan(structured_output=_single(constraints), template_tools=template_tools,
                      tool_mode="forced", tool_names=names)


def _constraints(body: Any) -> list[tuple[str, StructuredOutputParams]]:
    """(field, params) for each field of `body` that constrains the output."""
    found = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", StructuredOutputParams(json_object=True)))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise InvalidRequestError("response_format: type json_schema needs a json_schema object",
                                      param="response_format")
        found.append(("response_format", _schema_params(response_format.json_schema.schema_,
                                                        "response_format.json_schema.schema")))
    guided_json = getattr(body, "guided_json", None)
    if guided_json is not None:
        found.append(("guided_json", _schema_params(_as_schema(guided_json), "guided_json")))
    for name, kwargs in (("guided_regex", lambda v: {"regex": v}), ("guided_choice", lambda v: {"choice": tuple(v)})):
        value = getattr(body, name, None)
        if value is not None:
            try:
                found.append((name, StructuredOutputParams(**kwargs(value))))
            except InvalidRequestError as exc:
                raise InvalidRequestError(str(exc), param=name) from None
    return found


def _schema_params(schema: Any, path: str) -> StructuredOutputParams:
    param = path.split(".")[0]
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{path} must be a JSON object", param=param)
    try:
        check_enforceable(schema, path)
        return StructuredOutputParams.from_json_schema(schema)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param=param) from None


def _as_schema(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise InvalidRequestError("guided_json: a string must hold a JSON schema", param="guided_json") from None
    return value


def _single(constraints: list[tuple[str, StructuredOutputParams]]) -> StructuredOutputParams | None:
    if len(constraints) > 1:
        fields = [name for name, _ in constraints]
        raise InvalidRequestError(f"{fields[1]}: only one of response_format, guided_json, guided_regex, guided_choice "
                                  f"and a forced tool_choice may constrain the output (got {', '.join(fields)})",
                                  param=fields[1])
    return constraints[0][1] if constraints else None


def _call_schema(tools: list[ToolDefinition]) -> StructuredOutputParams:
    """The JSON schema of one call to any of `tools`: `{"name": <its name>, "arguments": <an
    object valid against its parameters>}`. Each function's `$defs` move to the root under a
    per-function prefix, so `$ref`s inside its parameters still resolve."""
    options, defs = [], {}
    for i, tool in enumerate(tools):
        parameters = tool.function.parameters or {"type": "object", "properties": {}}
        try:
            check_enforceable(parameters, f"tools[{i}].function.parameters")
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), param="tools") from None
        prefix = f"f{i}_"
        local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
        defs.update({prefix + name: _prefix_refs(sub, prefix) for name, sub in local.items()})
        arguments = _prefix_refs({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}, prefix)
        options.append({"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    try:
        return StructuredOutputParams.from_json_schema(schema)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param="tools") from None


def _prefix_refs(value: Any, prefix: str) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "$ref" and isinstance(item, str):
                out[key] = re.sub(r"^#/(\$defs|definitions)/", f"#/$defs/{prefix}", item)
            else:
                out[key] = _prefix_refs(item, prefix)
        return out
    if isinstance(value, list):
        return [_prefix_refs(item, prefix) for item in value]
    return value


# -- messages for the chat template ----------------------------------------------------------
def template_message(role: str, content: str, tool_calls: list[Any] | None, tool_call_id: str | None,
                     name: str | None) -> dict[str, Any]:
    """One chat message as transformers' chat templates expect it: an assistant's tool calls
    with their arguments as objects (OpenAI sends them as JSON text), a tool result with the id
    of the call it answers."""
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    if name is not None and role == "tool":
        message["name"] = name
    return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequestError("messages: a tool call's arguments must be a JSON object, as text",
                                  param="messages") from None


# -- reading the output ----------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_forced_call(text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """The grammar's `{"name", "arguments"}` as one tool call. Cut short (max_tokens), the text
    is not a whole call: it is returned as content with its own finish reason."""
    try:
        call = json.loads(text)
        name, arguments = call["name"], call["arguments"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return text, None, finish_reason
    tool_call = ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=json.dumps(arguments)))
    return None, [tool_call], "tool_calls"


def read_qwen_tool_calls(text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """Qwen2.5's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks as tool calls,
    the rest as content. A block that is not a call (bad JSON, no name) stays in the content."""
    calls, kept, last = [], [], 0
    for match in _QWEN_TOOL_CALL.finditer(text):
        call = _qwen_call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    if not calls:
        return text, None, finish_reason
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls, "tool_calls"


def _qwen_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body.strip())
        name, arguments = call["name"], call.get("arguments", {})
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(name, str):
        return None
    if isinstance(arguments, str):
        arguments = _loads_or_none(arguments) or {}
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=json.dumps(arguments)))


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ToolCallStream:
    """One streamed choice's text, split into content to send now and tool calls to send at
    the end. Forced calls send nothing until the end. In auto mode, text streams as content
    until a `<tool_call>` tag may be starting (a partial tag is held back), and everything from
    there on is read when the output ends."""

    def __init__(self, mode: Literal["auto", "forced"]) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.in_calls = mode == "forced"

    def feed(self, new_text: str) -> str:
        """Content to send for this piece of text (possibly empty)."""
        self.text += new_text
        if self.in_calls:
            return ""
        tag_at = self.text.find(QWEN_TOOL_CALL_TAG, self.sent)
        if tag_at >= 0:
            self.in_calls = True
            return self._send_until(tag_at)
        return self._send_until(len(self.text) - _partial_tag_len(self.text))

    def finish(self, finish_reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content not sent yet, tool calls, finish reason) once the output has ended."""
        if self.mode == "forced":
            return read_forced_call(self.text, finish_reason)
        content, calls, reason = read_qwen_tool_calls(self.text[self.sent:], finish_reason)
        if calls is None:
            return self.text[self.sent:] or None, None, finish_reason
        return content, calls, reason

    def _send_until(self, end: int) -> str:
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


def _partial_tag_len(text: str) -> int:
    """Length of the longest end of `text` that is a proper start of the tool-call tag."""
    for n in range(min(len(QWEN_TOOL_CALL_TAG) - 1, len(text)), 0, -1):
        if QWEN_TOOL_CALL_TAG.startswith(text[-n:]):
            return n
    return 0


def delta_tool_calls(calls: list[ToolCall]) -> list[DeltaToolCall]:
    return [DeltaToolCall(index=i, **call.model_dump()) for i, call in enumerate(calls)]
