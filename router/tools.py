"""response_format, tools and tool_choice -> a StructuredOutput, and tool calls back out of text.

Shared by the OpenAI HTTP API and gRPC. Errors name the request field. tool_choice:
- "required": the output is constrained to a JSON array of {"name", "arguments"} objects, one
  per call (exactly one when parallel_tool_calls is false);
- a named function: the output is constrained to that function's `parameters` schema;
- "auto": unconstrained; tool calls are parsed from the text in the chat template's own format
  where the template defines one (the Hermes / Qwen `<tool_call>{...}</tool_call>` blocks);
- "none": unconstrained, nothing parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from engine.sampling_params import InvalidRequest, describe
from engine.structured import FIELD, StructuredOutput

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES_MARK = "<tool_call>"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _renamed(field_name: str, build):
    try:
        return build()
    except InvalidRequest as e:
        if e.field != FIELD:
            raise
        raise InvalidRequest(field_name, e.message) from None


def from_response_format(value) -> StructuredOutput | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest("response_format", f"must be an object with a type, got {describe(value)}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise InvalidRequest("response_format.type", f"must be text, json_object or json_schema, "
                             f"got {describe(kind)}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise InvalidRequest("response_format.json_schema", "must be {name, schema: {...}}")
    schema = spec.get("schema", {})  # OpenAI: a missing schema allows any JSON
    return _renamed("response_format.json_schema.schema", lambda: StructuredOutput.json_schema(schema))


def from_extension(value) -> StructuredOutput | None:
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""
    if value is None:
        return None
    keys = [k for k in STRUCTURED_KEYS if isinstance(value, dict) and value.get(k) not in (None, False)]
    if not isinstance(value, dict) or len(keys) != 1 or set(value) - set(STRUCTURED_KEYS):
        raise InvalidRequest("structured_outputs", f"must set exactly one of {', '.join(STRUCTURED_KEYS)}")
    key, spec = keys[0], value[keys[0]]
    where = f"structured_outputs.{key}"

    def build():
        if key == "json":
            return StructuredOutput.json_schema(json.loads(spec) if isinstance(spec, str) else spec)
        if key == "json_object":
            return StructuredOutput("json_object")
        if key == "choice":
            if not isinstance(spec, list):
                raise InvalidRequest(FIELD, "must be a list of strings")
            return StructuredOutput.choice(spec)
        if not isinstance(spec, str):
            raise InvalidRequest(FIELD, f"must be a string, got {type(spec).__name__}")
        return StructuredOutput(key, spec)

    try:
        return _renamed(where, build)
    except ValueError as e:  # json.loads of a schema given as text
        if isinstance(e, InvalidRequest):
            raise
        raise InvalidRequest(where, f"not valid JSON: {e}") from None


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    functions: dict[str, dict] = field(default_factory=dict)  # name -> parameters schema
    named: str | None = None
    parse_format: str | None = None  # "hermes" when "auto" can parse the template's calls

    def structured(self, parallel: bool) -> StructuredOutput | None:
        if self.mode == "named":
            return _renamed("tools", lambda: StructuredOutput.json_schema(self.functions[self.named]))
        if self.mode != "required":
            return None
        call = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": name}, "arguments": params}}
                for name, params in self.functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not parallel:
            schema["maxItems"] = 1
        return _renamed("tools", lambda: StructuredOutput.json_schema(schema))

    def calls(self, text: str) -> tuple[list[dict], str | None]:
        """(tool calls in OpenAI's shape, the remaining content) from finished output text."""
        if self.mode == "named":
            return [_call(self.named, text)], None
        if self.mode == "required":
            try:  # complete under the grammar unless a stop string cut it
                return [_call(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)], None
            except (ValueError, TypeError, KeyError):
                return [], text
        if self.mode != "auto" or self.parse_format != "hermes":
            return [], text
        calls = []
        for block in HERMES_CALL.findall(text):
            try:
                call = json.loads(block)
            except ValueError:
                continue
            if isinstance(call, dict) and call.get("name") in self.functions:
                args = call.get("arguments", call.get("parameters", {}))
                calls.append(_call(call["name"], args if isinstance(args, str) else json.dumps(args)))
        if not calls:
            return [], text
        rest = HERMES_CALL.sub("", text).strip()
        return calls, rest or None


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_plan(tools, tool_choice, template: str | None) -> ToolPlan | None:
    """None when the request has no tools; InvalidRequest naming tools / tool_choice if bad."""
    if tools in (None, []):
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools", "must be a list of {type: function, function: {...}}")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
            raise InvalidRequest(f"tools[{i}]", "must be {type: function, function: {name: "
                                 "[A-Za-z0-9_-]{1,64}, parameters: {...}}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters", "must be a JSON schema object")
        _renamed(f"tools[{i}].function.parameters", lambda params=params: StructuredOutput.json_schema(params))
        functions[fn["name"]] = params
    parse_format = "hermes" if template and HERMES_MARK in template else None
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolPlan(tool_choice or "auto", functions, parse_format=parse_format)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise InvalidRequest("tool_choice", "must be none, auto, required or {type: function, "
                             f"function: {{name}}}}, got {describe(tool_choice)}")
    if name not in functions:
        raise InvalidRequest("tool_choice", f"names {describe(name)}, which is not in tools")
    return ToolPlan("named", functions, named=name)
