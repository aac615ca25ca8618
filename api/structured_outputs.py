"""A request's output constraint, from any of the spellings vLLM accepts, checked and compiled.

    response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema", "strict"}}
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json / guided_regex / guided_choice / guided_grammar     (vLLM's older names)

At most one may be given (else 400). `compiled` compiles on the caller's thread (the prepare
threads: never the event loop) and turns an invalid schema, regex or grammar into a 400.
"""

from __future__ import annotations

from typing import Any

from flint_sched.api.errors import bad_request
from flint_sched.api.protocol import ResponseFormat, StructuredOutputsRequest
from flint_sched.structured import StructuredOutputsParams

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def requested_constraint(request) -> tuple[StructuredOutputsParams, str] | None:
    """(the constraint, the request field it came from), or None; APIError 400 when malformed."""
    found: list[tuple[dict[str, Any], str]] = []
    if request.response_format is not None:
        spec = _from_response_format(request.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if request.structured_outputs is not None:
        found.append((_from_structured_outputs(request.structured_outputs), "structured_outputs"))
    for field, kind in _GUIDED:
        value = getattr(request, field)
        if value is not None:
            found.append(({kind: value}, field))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request("give one output constraint: " + ", ".join(f for _, f in found) + " were all set",
                          found[1][1])
    spec, field = found[0]
    try:
        return StructuredOutputsParams(**spec), field
    except (ValueError, TypeError) as error:
        raise bad_request(str(error), field) from None


def compiled(compiler, params: StructuredOutputsParams, field: str) -> None:
    """Compile (cached) so that the engine finds it ready; 400 naming the field when invalid."""
    try:
        compiler.compile(params)
    except ValueError as error:
        raise bad_request(f"invalid {field}: {error}", field) from None


def _from_response_format(format_: ResponseFormat) -> dict[str, Any] | None:
    if format_.type == "text":
        return None
    if format_.type == "json_object":
        return {"json_object": True}
    if format_.type == "json_schema":
        spec = format_.json_schema or {}
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise bad_request('response_format "json_schema" needs json_schema.schema', "response_format")
        return {"json": schema, "strict": bool(spec.get("strict") or False)}
    raise bad_request(f"unknown response_format type {format_.type!r}: use text, json_object or json_schema",
                      "response_format")


def _from_structured_outputs(spec: StructuredOutputsRequest) -> dict[str, Any]:
    if spec.structural_tag is not None:
        raise bad_request("structured_outputs.structural_tag is not supported", "structured_outputs")
    values = {"json": spec.json, "regex": spec.regex, "choice": spec.choice, "grammar": spec.grammar,
              "json_object": spec.json_object}
    return {k: v for k, v in values.items() if v is not None}
