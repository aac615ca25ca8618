"""Typing of tool-call argument values from the request's tool schema, and from nothing else.

`tool_param_types(tools)` maps tool name -> {param: frozenset of JSON type names}; an empty set
means no schema information, so the value stays the raw string. `convert_value` never raises: a
value that fits none of its allowed types stays the raw (unstripped) string.
"""

import json
import math
import re
from collections.abc import Mapping

JSON_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "object", "array"})
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def tool_param_types(tools: list | None) -> dict[str, dict[str, frozenset[str]]]:
    """Tool name -> parameter name -> allowed JSON types, for OpenAI-format `tools`."""
    result = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        if not isinstance(properties, Mapping):
            properties = {}
        result[function["name"]] = {str(key): schema_types(value) for key, value in properties.items()}
    return result


def schema_types(schema) -> frozenset[str]:
    """JSON types a property schema allows: `type` (string or list), else the types of `enum` /
    `const` values, plus those of every `anyOf` / `oneOf` member."""
    if not isinstance(schema, Mapping):
        return frozenset()
    found = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        found.add(declared)
    elif isinstance(declared, list):
        found.update(t for t in declared if isinstance(t, str))
    elif isinstance(schema.get("enum"), list):
        found.update(_type_of(value) for value in schema["enum"])
    elif "const" in schema:
        found.add(_type_of(schema["const"]))
    for keyword in ("anyOf", "oneOf"):
        if isinstance(schema.get(keyword), list):
            for member in schema[keyword]:
                found |= schema_types(member)
    return frozenset(found & JSON_TYPES)


def is_plain_string(types: frozenset[str]) -> bool:
    """Whether every value of a parameter stays its raw text (so it can stream as it arrives)."""
    return not types or types == {"string"}


def convert_value(raw: str, types: frozenset[str]):
    """The typed value of `raw`: null, boolean, integer, number, object, array tried in that
    order when allowed, else the raw string."""
    text = raw.strip()
    if "null" in types and text.lower() == "null":
        return None
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"integer", "number"} and _INTEGER.fullmatch(text):
        try:
            return int(text)
        except ValueError:
            pass
    if "number" in types and _NUMBER.fullmatch(text):
        number = float(text)
        if math.isfinite(number):
            return number
    if types & {"object", "array"}:
        value = _load_json(text)
        if isinstance(value, dict) and "object" in types or isinstance(value, list) and "array" in types:
            return value
    return raw


def _load_json(text: str):
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _type_of(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"
