"""The grammar that keeps a forced tool call (tool_choice required / named) well formed.

A forced call's start is already in the prompt (tool_choice.py); this Lark grammar (llguidance's
dialect: `<tag>` is a special token, `%json {schema}` a JSON-schema-constrained value) covers the
rest of the call in GLM-4.7's format, so the arguments always parse and fit the tool's schema:

    [NAME] ( <arg_key> K </arg_key> <arg_value> V </arg_value> )* </tool_call>   then, for
    `required` with parallel calls: ( <tool_call> NAME ... </tool_call> )*

Parameters come in the schema's order, the required ones always. A value the parser keeps as text
(type string, or no type) is raw text: an enum or const as its literals, a pattern as its regex,
min/maxLength as a length; every other value is JSON under its own schema (the parser reads it so).
A text value never contains the characters of `</arg_value>` (the parser would end it there).
"""

from __future__ import annotations

import json

from flint_sched.api.parsers.schema_types import schema_types
from flint_sched.api.parsers.tool_calls import CALL_END, CALL_START, KEY_END, KEY_START, VALUE_END, VALUE_START
from flint_sched.api.tool_choice import ToolPolicy
from flint_sched.structured import StructuredOutputsParams

_ANY = "(?s:.*)"
_NO_END_TAG = f"~/{_ANY}<\\/arg_value>{_ANY}/"
# compact JSON values, as the prompt's tool calls show them
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_grammar(policy: ToolPolicy) -> StructuredOutputsParams | None:
    """The grammar of what follows a forced call's start, or None when no call is forced."""
    if not policy.forces_call:
        return None
    functions = [tool["function"] for tool in policy.parser_tools]
    rules: list[str] = []
    calls = [f"{_literal(f['name'])} {_arguments(rules, i, f, opened=False)} {CALL_END}"
             for i, f in enumerate(functions)]
    forced = policy.forced_function
    if forced is None:                                   # the prompt ends with <tool_call>
        first = _alternatives(calls)
    else:                                                # ... <tool_call>NAME, maybe <arg_key>
        index = functions.index(forced)
        opened = policy.forced_call_start().endswith(KEY_START)
        first = f"{_arguments(rules, index, forced, opened)} {CALL_END}"
    more = ""
    if policy.mode == "required" and policy.parallel_tool_calls:
        more = f" ({CALL_START} {_alternatives(calls)})*"
    return StructuredOutputsParams(grammar="\n".join([f"start: {first}{more}", *rules]))


def _alternatives(items: list[str]) -> str:
    return items[0] if len(items) == 1 else "(" + " | ".join(items) + ")"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _arguments(rules: list[str], i: int, function: dict, opened: bool) -> str:
    """The arguments of function i in order; `opened`: the first `<arg_key>` is already out."""
    parameters = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    required = set(parameters.get("required") or ()) & set(properties)
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    names = list(properties)
    pairs = []
    for k, name in enumerate(names):
        value = f"v{i}_{k}"
        if not any(rule.startswith(value + ":") for rule in rules):      # once per function
            rules.append(f"{value}: {_value(rules, value.upper(), properties[name], defs)}")
        pairs.append(f"{_literal(name)} {KEY_END} {VALUE_START} {value} {VALUE_END}")

    def rest(start: int) -> str:
        return " ".join(f"({KEY_START} {pairs[k]})" + ("" if names[k] in required else "?")
                        for k in range(start, len(names)))

    if not opened:
        return rest(0)
    firsts = []
    for k, name in enumerate(names):                  # any parameter up to the first required one
        firsts.append(f"{pairs[k]} {rest(k + 1)}".strip())
        if name in required:
            break
    return _alternatives([f"({f})" for f in firsts])


def _value(rules: list[str], terminal: str, schema, defs: dict) -> str:
    """The right-hand side of a value's rule (adding a terminal for text values)."""
    types = schema_types(schema)
    if types and types != {"string"}:
        schema = {**schema, **defs, "x-guidance": _JSON_STYLE} if isinstance(schema, dict) else schema
        return f"%json {json.dumps(schema, ensure_ascii=False)}"
    schema = schema if isinstance(schema, dict) else {}
    if "const" in schema:
        return _literal(str(schema["const"]))
    if isinstance(schema.get("enum"), list):
        return " | ".join(_literal(str(v)) for v in schema["enum"])
    rules.append(f"{terminal}: {_text_regex(schema)} & {_NO_END_TAG}")
    return terminal


def _text_regex(schema: dict) -> str:
    """A lark regex for a text value: its pattern (searched, as JSON Schema does) and length."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    length = f"/(?s:.{{{int(low)},{'' if high is None else int(high)}}})/"
    pattern = schema.get("pattern")
    if not isinstance(pattern, str):
        return length
    core = pattern[1:] if pattern.startswith("^") else _ANY + "(?:" + pattern
    if pattern.startswith("^"):
        core = "(?:" + core
    if core.endswith("$") and not core.endswith("\\$"):
        core = core[:-1] + ")"
    else:
        core += ")" + _ANY
    regex = "/" + core.replace("/", "\\/") + "/"
    return regex if (low, high) == (0, None) else f"{regex} & {length}"
