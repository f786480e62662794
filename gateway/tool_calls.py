"""Tool calling in /v1/chat/completions, as vLLM's server does it.

    tool_choice "none"       tools rendered by the chat template, output is plain content
    tool_choice "required"   output constrained (structured outputs) to a JSON array of
                             {"name", "parameters"} calls of the given tools (one with
                             parallel_tool_calls false); every choice ends in tool calls
    a named function         output constrained to that function's parameters schema: the
                             whole output is the call's arguments
    tool_choice "auto"       free output; the --tool-call-parser (hermes, llama3_json) pulls the
                             calls out of it (needs --enable-auto-tool-choice)

Responses carry message.tool_calls and finish_reason "tool_calls"; a stream sends the calls as
delta.tool_calls once a choice has finished (whole arguments in one delta per call).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured_output import StructuredOutputKind, StructuredOutputSpec
from pdserve.gateway.errors import ApiError

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ParsedCall:
    """One call the model made."""

    name: str
    arguments: str
    """The arguments as JSON text."""


@dataclass(frozen=True)
class ToolOutput:
    """A finished choice split into content and calls."""

    content: str | None
    calls: list[ParsedCall]


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _function(tool: Any, index: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ApiError.bad_request(f"tools[{index}] must be a function tool", "tools")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError.bad_request(f"tools[{index}].function needs a name", "tools")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ApiError.bad_request(f"tools[{index}].function.parameters must be an object", "tools")
    return {**function, "parameters": parameters}


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The tools' function objects (a 400 for malformed ones)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError.bad_request("tools must be a list", "tools")
    return [_function(tool, i) for i, tool in enumerate(tools)]


def named_choice(tool_choice: Any) -> str | None:
    """The function name of a named tool_choice ({"type": "function", "function": {"name"}})."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict):
            raise ApiError.bad_request("tool_choice must name a function", "tool_choice")
        name = function.get("name")
        if not isinstance(name, str):
            raise ApiError.bad_request("tool_choice.function needs a name", "tool_choice")
        return name
    return None


def resolve_tool_choice(
    tool_choice: Any, functions: list[dict[str, Any]], auto_enabled: bool
) -> Any:
    """The effective tool_choice: "none", "auto", "required" or a function name (a dict)."""
    if tool_choice is None:
        return "auto" if functions and auto_enabled else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not functions:
            raise ApiError.bad_request(f'tool_choice "{tool_choice}" needs tools', "tool_choice")
        if tool_choice == "auto" and not auto_enabled:
            raise ApiError.bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                "tool_choice",
            )
        return tool_choice
    name = named_choice(tool_choice)
    if name is None:
        raise ApiError.bad_request(
            'tool_choice must be "none", "auto", "required" or a named function', "tool_choice"
        )
    if name not in {f["name"] for f in functions}:
        raise ApiError.bad_request(
            f"tool_choice names {name!r}, which is not in tools", "tool_choice"
        )
    return tool_choice


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of calls of the given functions."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": f["parameters"],
            },
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def constraint(
    tool_choice: Any, functions: list[dict[str, Any]], parallel: bool
) -> StructuredOutputSpec | None:
    """The structured output that enforces a required or named tool_choice (None otherwise)."""
    if tool_choice == "required":
        schema = required_schema(functions, parallel)
    elif isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        schema = next(f["parameters"] for f in functions if f["name"] == name)
    else:
        return None
    return StructuredOutputSpec(StructuredOutputKind.JSON, json.dumps(schema))


# -- parsing finished output ------------------------------------------------------------------


def parse_output(text: str, tool_choice: Any, parser: str | None) -> ToolOutput:
    """Split a finished choice's text by the request's tool_choice (and the auto parser)."""
    if tool_choice == "required":
        try:
            calls = json.loads(text)
            return ToolOutput(
                None,
                [
                    ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                    for c in calls
                ],
            )
        except (ValueError, TypeError, KeyError):  # cut short (length): not a complete call
            return ToolOutput(text, [])
    if isinstance(tool_choice, dict):
        return ToolOutput(None, [ParsedCall(tool_choice["function"]["name"], text)])
    if tool_choice == "auto" and parser is not None:
        return PARSERS[parser](text)
    return ToolOutput(text, [])


def _call(obj: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(obj["name"], text)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ToolOutput:
    """Hermes / Qwen style: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks;
    the text before the first one is the content."""
    start = text.find("<tool_call>")
    if start == -1:
        return ToolOutput(text, [])
    calls = []
    for block in _HERMES.findall(text[start:]):
        try:
            call = _call(json.loads(block), "arguments")
        except ValueError:
            call = None
        if call is None:
            return ToolOutput(text, [])  # malformed: vLLM returns the text as content
        calls.append(call)
    content = text[:start].strip()
    return ToolOutput(content or None, calls)


def parse_llama3_json(text: str) -> ToolOutput:
    """Llama 3 style: the output is {"name": ..., "parameters": {...}} (optionally after
    <|python_tag|>), several separated by ";"."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ToolOutput(text, [])
    decoder = json.JSONDecoder()
    calls, position = [], 0
    while position < len(body):
        try:
            obj, end = decoder.raw_decode(body, position)
        except ValueError:
            return ToolOutput(text, [])
        call = _call(obj, "parameters")
        if call is None:
            return ToolOutput(text, [])
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \n\t;":
            position += 1
    return ToolOutput(None, calls)


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as chat templates expect them: assistant tool_calls with their arguments
    as objects (vLLM's convention), tool results with their tool_call_id and name."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _template_call(call: Any) -> dict[str, Any]:
    function = dict(call.get("function") or {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass
    return {**call, "function": function}
