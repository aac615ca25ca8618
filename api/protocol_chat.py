"""`POST /v1/chat/completions`: the request, the response and the stream chunk, as OpenAI and vLLM
shape them. The message's `content` and `reasoning` are always written (null included) and
`tool_calls` only when non-empty; a stream delta carries only the fields it sets.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from flint_sched.api.protocol import (
    ChatMessage,
    ChatTool,
    ConstraintFields,
    PromptLogprob,
    Reply,
    Schema,
    StreamOptions,
    Usage,
)


class NamedFunction(Schema, kw_only=True):
    name: str


class NamedToolChoice(Schema, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(ConstraintFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    model: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    user: str | None = None
    include_reasoning: bool = True
    chat_template: str | None = None           # vLLM's: this request's template (--trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True         # vLLM's: open the assistant's turn after the messages
    continue_final_message: bool = False       # vLLM's: the model goes on writing the last message
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    return_tokens_as_token_ids: bool = False   # vLLM's: logprobs name tokens "token_id:N"
    return_token_ids: bool = False             # vLLM's: the prompt's and the output's token ids too
    cache_salt: str | None = None              # vLLM's: only requests of the same salt share cached prefixes
    request_id: str | None = None              # vLLM's: names the response (an X-Request-Id header wins)


class FunctionCallOut(Reply, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(Reply, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCallOut


class ChatResponseMessage(Schema, kw_only=True):
    role: str
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCallOut] = msgspec.field(default_factory=list)


class TopLogprob(Reply, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Reply, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Reply, kw_only=True):
    content: list[TokenLogprob] | None


class ChatChoice(Reply, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET         # return_token_ids: the output's


class ChatCompletionResponse(Reply, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids


class DeltaFunctionCall(Schema, kw_only=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Schema, kw_only=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(Schema, kw_only=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.role is None and self.content is None and self.reasoning is None and not self.tool_calls


class ChatStreamChoice(Reply, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET         # return_token_ids: this chunk's


class ChatCompletionChunk(Schema, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None        # return_token_ids: in the first chunk


CHAT_SCHEMAS = (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk)
