"""`GET /openapi.json`: an OpenAPI 3.1 document generated from the msgspec structs.

Component schemas come from msgspec.json.schema_components over every request and response struct,
so the document cannot drift from what the server decodes and encodes. Built once, then cached.
Streamed responses are described event by event with OpenAPI 3.2's `itemSchema` for
`text/event-stream`: each event's `data` is a chunk (JSON) or the final `[DONE]`; /v1/responses
names each event (`event: <type>`) and ends with its last event instead of `[DONE]`.
"""

from __future__ import annotations

from functools import lru_cache

import msgspec

from flint_sched import __version__
from flint_sched.api.protocol import COMMON_SCHEMAS
from flint_sched.api.protocol_chat import CHAT_SCHEMAS
from flint_sched.api.protocol_completions import COMPLETION_SCHEMAS
from flint_sched.api.protocol_responses import RESPONSES_SCHEMAS

REF = "#/components/schemas/{name}"
_ROUTES = (
    # method, path, summary, request schema, response schema, streaming chunk schema
    ("post", "/v1/chat/completions", "Create a chat completion", "ChatCompletionRequest",
     "ChatCompletionResponse", "ChatCompletionChunk"),
    ("post", "/v1/completions", "Create a completion", "CompletionRequest", "CompletionResponse",
     "CompletionChunk"),
    ("post", "/v1/responses", "Create a response (OpenAI's Responses API)", "ResponsesRequest", "ResponseObject",
     "ResponseEvent"),
    ("get", "/v1/responses/{response_id}", "A stored response", None, "ResponseObject", None),
    ("get", "/v1/models", "List the served models", None, "ModelList", None),
    ("post", "/tokenize", "Text or messages to token ids", "TokenizeRequest", "TokenizeResponse", None),
    ("post", "/detokenize", "Token ids to text", "DetokenizeRequest", "DetokenizeResponse", None),
    ("get", "/version", "The server's version", None, "VersionResponse", None),
)
_ERRORS = {"400": "Bad request (also an unknown model)", "401": "Missing or wrong API key",
           "413": "Request body too large", "500": "The engine failed while running the request",
           "503": "The engine is not running, or the server is shutting down"}


def _event_schema(chunk: str) -> dict:
    """One server-sent event of a stream: `data:` a chunk as JSON, an error body, or `[DONE]`
    (a ResponseEvent: `event:` its type, `data:` the event)."""
    if chunk == "ResponseEvent":
        return {"type": "object", "required": ["event", "data"], "properties": {
            "event": {"type": "string"},
            "data": {"contentMediaType": "application/json", "contentSchema": _ref(chunk)}}}
    as_json = [{"contentMediaType": "application/json", "contentSchema": _ref(name)}
               for name in (chunk, "ErrorResponse")]
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"oneOf": [*as_json, {"const": "[DONE]"}]}}}


def _ref(name: str) -> dict:
    return {"$ref": REF.format(name=name)}


def _operation(summary: str, request: str | None, response: str, chunk: str | None) -> dict:
    content = {"application/json": {"schema": _ref(response)}}
    if chunk is not None:
        ending = ("ending with response.completed, .incomplete or .failed" if chunk == "ResponseEvent"
                  else "then `data: [DONE]`")
        content["text/event-stream"] = {"itemSchema": _event_schema(chunk), "description":
                                        f"`data: <{chunk}>` events, {ending}"}
    operation = {"summary": summary, "responses": {"200": {"description": "OK", "content": content}}}
    for status, description in _ERRORS.items():
        operation["responses"][status] = {"description": description,
                                          "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    return operation


@lru_cache(maxsize=1)
def openapi_document() -> bytes:
    _, components = msgspec.json.schema_components(
        COMMON_SCHEMAS + CHAT_SCHEMAS + COMPLETION_SCHEMAS + RESPONSES_SCHEMAS, ref_template=REF)
    paths: dict[str, dict] = {}
    for method, path, summary, request, response, chunk in _ROUTES:
        paths.setdefault(path, {})[method] = _operation(summary, request, response, chunk)
    plain = {"200": {"description": "OK"}}
    paths["/health"] = {"get": {"summary": "200 while the engine runs, 503 once it has died",
                                "responses": {**plain, "503": {"description": "The engine loop has died"}}}}
    paths["/metrics"] = {"get": {"summary": "Prometheus metrics", "responses": {"200": {
        "description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}}
    paths["/openapi.json"] = {"get": {"summary": "This document", "responses": plain}}
    document = {
        "openapi": "3.2.0",
        "info": {"title": "flint-sched", "version": __version__,
                 "description": "An OpenAI-compatible server for the Flint model."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
    return msgspec.json.encode(document)
