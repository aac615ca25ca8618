"""Typed results of the async client: OpenAI-compatible responses and stream chunks as msgspec structs.

Decoding ignores unknown fields, so any OpenAI-compatible server works. `reasoning_content` (older vLLM,
DeepSeek) is folded into `reasoning`. Errors are `FlintAPIError` (an HTTP error status or an error event
in a stream) or `FlintConnectionError` / `FlintTimeoutError` (no usable response).
"""

from __future__ import annotations

import msgspec


class FunctionCall(msgspec.Struct, omit_defaults=True):
    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct, omit_defaults=True):
    id: str
    function: FunctionCall
    type: str = "function"


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def _adopt_reasoning_content(part: ChatMessage | ChatDelta) -> None:
    """A reply that carries the reasoning as `reasoning_content` lands in `reasoning` too."""
    if part.reasoning is None and part.reasoning_content is not None:
        part.reasoning = part.reasoning_content
    part.reasoning_content = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """An assistant message; `msgspec.to_builtins(message)` is ready to append to the next request's history."""

    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        _adopt_reasoning_content(self)


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None           # with return_token_ids=True


class ChatCompletion(msgspec.Struct):
    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[ChatChoice] = []
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None    # with return_token_ids=True


class FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        _adopt_reasoning_content(self)


class ChatChunkChoice(msgspec.Struct):
    index: int = 0
    delta: ChatDelta = msgspec.field(default_factory=ChatDelta)
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None           # with return_token_ids=True: this chunk's


class ChatCompletionChunk(msgspec.Struct):
    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChatChunkChoice] = []
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None    # with return_token_ids=True: in the first chunk


class CompletionChoice(msgspec.Struct):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_token_ids: list[int] | None = None    # with return_token_ids=True (a stream: the first chunk)
    token_ids: list[int] | None = None


class Completion(msgspec.Struct):
    """A `/v1/completions` response; streamed chunks have the same shape (`text` is then a delta)."""

    id: str = ""
    object: str = "text_completion"
    created: int = 0
    model: str = ""
    choices: list[CompletionChoice] = []
    usage: Usage | None = None


class Model(msgspec.Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = ""
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[Model] = []


class FlintError(Exception):
    """Base of every error the client raises."""


class FlintConnectionError(FlintError):
    """No usable HTTP response: connection refused or dropped, after the retries."""


class FlintTimeoutError(FlintConnectionError):
    """The connect, write or read timeout passed."""


class FlintResponseError(FlintError):
    """A 2xx response (or stream event) that is not the JSON the OpenAI API promises."""


class FlintAPIError(FlintError):
    """An OpenAI-shaped error: an HTTP status >= 400 or an `{"error": ...}` event inside a stream."""

    def __init__(self, status: int, type: str | None, message: str, param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(f"{status} {type or 'error'}: {message}")
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.code = code


def decode_response(decoder: msgspec.json.Decoder, data: bytes | str):
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise FlintResponseError(f"{e}: {data[:200]!r}") from e


def parse_error(status: int, body: bytes) -> FlintAPIError:
    """The error in `{"error": {...}}` (OpenAI), a flat `{"message": ...}` (older vLLM), or plain text."""
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return FlintAPIError(status, None, body.decode("utf-8", "replace").strip() or f"HTTP {status}")
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        payload = payload["error"]
    elif isinstance(payload, dict) and isinstance(payload.get("error"), str):
        payload = {"message": payload["error"]}
    if not isinstance(payload, dict):
        return FlintAPIError(status, None, str(payload))
    param = payload.get("param")
    return FlintAPIError(status, payload.get("type"), str(payload.get("message") or payload.get("detail") or ""),
                         None if param is None else str(param), payload.get("code"))
