"""Hypothesis strategies for request bodies, read from the server's own /openapi.json.

`body_strategy(document, name)` draws JSON that follows the component schema `name` most of the time
and breaks it some of the time (a wrong type anywhere, a missing or unknown field), with strings and
integers biased towards the values that reach deep into the server (roles, tags, edge integers).
"""

from __future__ import annotations

from hypothesis import strategies as st

WORDS = ("user", "assistant", "system", "tool", "developer", "function", "text", "auto", "none", "required",
         "get_weather", "city", "", " ", "<tool_call>", "</think>", "<|user|>", "<arg_key>", "héllo 世界",
         '{"city": "Oslo"}', "[[[", "\x00", "\ud800", "flint-scripted", "json_object")
EDGE_INTEGERS = (-2**63, -1, 2**31, 2**63 - 1, 2**64, 10**30)

json_leaf = (st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=False, allow_infinity=False)
             | st.text(max_size=12))
any_json = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
strings = st.sampled_from(WORDS) | st.text(max_size=16)
integers = st.integers(-3, 40) | st.sampled_from(EDGE_INTEGERS)
numbers = st.floats(0, 1) | st.floats(-3, 3) | st.sampled_from((-1e308, 1e308, 0.0, 2.0)) | integers


def schema_strategy(schema: dict, components: dict, depth: int = 0, fields: dict | None = None) -> st.SearchStrategy:
    """JSON that follows `schema` (the subset msgspec writes: $ref, anyOf, type, enum, const, ...);
    `fields` gives the strategy of some properties by name wherever they occur (e.g. "model")."""
    fields = fields or {}
    if depth > 8:
        return st.none()
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: schema_strategy(components[name], components, depth + 1, fields))
    if "anyOf" in schema:
        return st.one_of([schema_strategy(s, components, depth + 1, fields) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([schema_strategy({**schema, "type": k}, components, depth, fields) for k in kind])
    if kind == "object":
        return object_strategy(schema, components, depth, fields)
    if kind == "array":
        items = schema_strategy(schema.get("items", {}), components, depth + 1, fields)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=max(3, schema.get("minItems", 0)))
    return {"string": strings, "integer": integers, "number": numbers, "boolean": st.booleans(),
            "null": st.none()}.get(kind, any_json)


def object_strategy(schema: dict, components: dict, depth: int, fields: dict) -> st.SearchStrategy:
    properties = schema.get("properties")
    if properties is None:
        values = schema_strategy(schema.get("additionalProperties", {}), components, depth + 1, fields)
        return st.dictionaries(strings, values, max_size=3)
    required = set(schema.get("required", ()))
    values = {name: fields[name] if name in fields else schema_strategy(sub, components, depth + 1, fields)
              for name, sub in properties.items()}

    one_in = 2 if len(properties) <= 8 else 8          # optional fields drawn: few of a large request

    @st.composite
    def draw(draw_) -> dict:
        chosen = {name for name in properties if name in required or draw_(st.integers(0, one_in - 1)) == 0}
        return {name: draw_(values[name]) for name in sorted(chosen)}

    return draw()


def broken(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A valid object with one field dropped, replaced by any JSON, or an unknown field added."""
    @st.composite
    def draw(draw_) -> object:
        value = draw_(valid)
        if not isinstance(value, dict) or not value:
            return draw_(any_json)
        key = draw_(st.sampled_from(sorted(value)))
        action = draw_(st.integers(0, 2))
        if action == 0:
            value.pop(key)
        elif action == 1:
            value[key] = draw_(any_json)
        else:
            value["unknown_" + key] = draw_(any_json)
        return value

    return draw()


def body_strategy(document: dict, name: str, fields: dict | None = None) -> st.SearchStrategy:
    components = document["components"]["schemas"]
    valid = schema_strategy(components[name], components, fields=fields)
    return st.one_of(valid, valid, broken(valid), any_json)
