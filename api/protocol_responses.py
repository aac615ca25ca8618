"""`POST /v1/responses` (OpenAI's Responses API): the request, the response object and the stream event.

Input items and tools are OpenAI's shapes, text only: messages (`input_text` / `output_text` parts or
a string), `function_call`, `function_call_output` and `reasoning` items; `function` tools. Output
items are tagged by `type`: `reasoning`, `message` (one `output_text` part), `function_call`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from flint_sched.api.protocol import Reply, Schema


class InputPart(Schema, kw_only=True):
    """A part of a message's `content` (`input_text`, `output_text`; others are refused) or of a
    reasoning item's `summary` / `content` (`summary_text`, `reasoning_text`)."""

    type: str
    text: str | None = None


class InputItem(Schema, kw_only=True):
    """One `input` item; `type` may be left out of a message (`role` and `content`)."""

    type: str | None = None
    role: str | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None                 # function_call, function_call_output
    name: str | None = None                    # function_call
    arguments: str | None = None               # function_call: JSON text
    output: str | list[InputPart] | None = None   # function_call_output
    summary: list[InputPart] | None = None        # reasoning


class FunctionTool(Schema, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(Schema, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(Schema, kw_only=True):
    """`text.format`: "text", "json_object", or "json_schema" with name, schema and strict."""

    type: str
    name: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Schema, kw_only=True):
    format: TextFormat | None = None


class ReasoningConfig(Schema, kw_only=True):
    effort: str | None = None                  # "none": no thinking; any other: thinking (the default)
    summary: str | None = None


class ResponsesRequest(Schema, kw_only=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    background: bool = False
    top_logprobs: int | None = None
    # vLLM's extras, as on chat
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    request_id: str | None = None


class OutputText(Reply, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(Reply, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(Reply, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText]


class ReasoningItem(Reply, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    status: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallItem(Reply, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    status: str
    call_id: str
    name: str
    arguments: str


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(Reply, kw_only=True):
    cached_tokens: int


class OutputTokensDetails(Reply, kw_only=True):
    reasoning_tokens: int


class ResponseUsage(Reply, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Reply, kw_only=True):
    reason: str


class ResponseError(Reply, kw_only=True):
    code: str
    message: str


class ResponseObject(Reply, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: str                                # in_progress, completed, incomplete, failed
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class ResponseEvent(Schema, kw_only=True):
    """One event of a stream (`event: <type>`, then this as `data`); the fields its type has."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    logprobs: list[Any] | None = None


RESPONSES_SCHEMAS = (ResponsesRequest, ResponseObject, ResponseEvent)
