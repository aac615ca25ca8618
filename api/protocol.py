"""Request and response schemas shared by every route: errors, usage, models, tokenize, version.

Every schema is a msgspec Struct: requests ignore unknown fields (as vLLM does) and are decoded with
their types checked; responses omit only fields whose default is "absent". Chat and completions live
in protocol_chat.py and protocol_completions.py; ALL_SCHEMAS feeds /openapi.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from flint_sched.core.plan import TokenLogprobs
from flint_sched.sampling_params import SamplingParams
from flint_sched.structured import StructuredOutputsParams


class Schema(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The base of requests (converted to builtins, unset fields are left out) and of sparse replies
    (stream deltas): a field equal to its default is not written."""


class Reply(msgspec.Struct, kw_only=True):
    """The base of responses: every field is written, null included."""


class ErrorInfo(Reply, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Reply, kw_only=True):
    error: ErrorInfo


class PromptTokensDetails(Reply, kw_only=True):
    cached_tokens: int          # prompt tokens served from the prefix cache


class Usage(Reply, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> Usage:
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=num_prompt_tokens + num_completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


class StreamOptions(Schema, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False       # vLLM's: with include_usage, every chunk carries its usage


def final_usage(options: StreamOptions | None, forced: bool) -> bool:
    """Whether a stream ends with a usage chunk: asked for, or forced (vLLM's --enable-force-include-usage)."""
    return forced or (options is not None and options.include_usage)


def continuous_usage(options: StreamOptions | None) -> bool:
    """Whether every chunk of a stream carries its choice's usage so far (vLLM's continuous_usage_stats)."""
    return options is not None and options.include_usage and options.continuous_usage_stats


class ResponseFormat(Schema, kw_only=True):
    """OpenAI's `response_format`: "text", "json_object", or "json_schema" with {name, schema, strict}."""
    type: str
    json_schema: dict[str, Any] | None = None


class StructuredOutputsRequest(Schema, kw_only=True):
    """vLLM's `structured_outputs` request field: one of these."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


class ConstraintFields(Schema, kw_only=True):
    """The output constraints and prompt logprobs that chat and completions requests share (vLLM's
    names), and vLLM's fields that would change the answer but are not served here: refused (400,
    sampling_params) rather than ignored."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    priority: int = 0
    logits_processors: Any = None


class PromptLogprob(Reply, kw_only=True):
    """One entry of vLLM's `prompt_logprobs` (a dict from token id to these, per prompt position)."""

    logprob: float
    rank: int
    decoded_token: str


class ContentPart(Schema, kw_only=True):
    """One part of a list `content`: text parts only (the model reads text; others are refused)."""

    type: str
    text: str | None = None


class FunctionCallIn(Schema, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(Schema, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(Schema, kw_only=True):
    """A message of the conversation; `reasoning_content` or `reasoning` carry past reasoning."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(Schema, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Schema, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def tool_dicts(tools: list[ChatTool] | None) -> list[dict] | None:
    """Tools as the OpenAI JSON objects the chat template and the parsers read."""
    if tools is None:
        return None
    return [{"type": "function", "function": msgspec.to_builtins(tool.function)} for tool in tools]


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    return [msgspec.to_builtins(message) for message in messages]


class ModelCard(Reply, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "flint-sched"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(Reply, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeRequest(Schema, kw_only=True):
    """Either `prompt` (text) or `messages` (rendered with the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(Reply, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Schema, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(Reply, kw_only=True):
    prompt: str


class VersionResponse(Reply, kw_only=True):
    version: str


MAX_N = 128
MIN_LOGPROB = -9999.0        # JSON has no -inf; vLLM clamps the same way
# A request's sampling fields left out take these (vLLM's defaults), or the server's
# --override-generation-config values (ServerConfig.sampling_defaults)
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_params(request, *, max_tokens: int, logprobs: int | None, skip_special_tokens: bool,
                    structured_outputs: StructuredOutputsParams | None = None,
                    prompt_logprobs: int | None = None, defaults: Mapping[str, Any] = SAMPLING_DEFAULTS,
                    ) -> SamplingParams:
    """The engine's SamplingParams from a chat or completions request (ValueError names the field);
    `defaults` for the sampling fields it leaves out."""
    if request.n > MAX_N:
        raise ValueError(f"n must be <= {MAX_N}, got {request.n}")
    if request.use_beam_search:
        raise ValueError("use_beam_search is not supported: every choice is sampled on its own")
    if request.priority != 0:
        raise ValueError(f"priority {request.priority}: requests are served first come, first served here "
                         "(no priority scheduling); leave it out or 0")
    if request.logits_processors is not None:
        raise ValueError("logits_processors are not supported: no custom logits processors run here")
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or ())
    given = {name: getattr(request, name) for name in SAMPLING_DEFAULTS}
    sampling = {name: defaults.get(name, SAMPLING_DEFAULTS[name]) if value is None else value
                for name, value in given.items()}
    return SamplingParams(
        n=request.n,
        **sampling,
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=dict(request.logit_bias or {}),
        logprobs=logprobs,
        stop=tuple(stop),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        min_tokens=request.min_tokens,
        max_tokens=max_tokens,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        allowed_token_ids=request.allowed_token_ids,
        bad_words=tuple(request.bad_words or ()),
        structured_outputs=structured_outputs,
        prompt_logprobs=prompt_logprobs,
        cache_salt=request.cache_salt,
    )


class TokenIdNames:
    """Stands in for the tokenizer where logprobs name their tokens, with vLLM's
    return_tokens_as_token_ids: "token_id:N" (a token whose bytes are not text alone stays identifiable)."""

    @staticmethod
    def decode(token_ids) -> str:
        return "".join(f"token_id:{token_id}" for token_id in token_ids)


def logprob_names(tokenizer, request):
    """What names the tokens of a request's logprobs: the tokenizer, or TokenIdNames."""
    return TokenIdNames if request.return_tokens_as_token_ids else tokenizer


def token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as logprobs show it: its text (special tokens included) and that text's UTF-8 bytes."""
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8"))


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def prompt_logprobs_json(tokenizer, entries: list[TokenLogprobs | None]) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {id: logprob, rank,
    decoded_token} for the prompt token and its top alternatives (ranks 1, 2, ...)."""
    result: list[dict[int, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        ranked = [(entry.token_id, entry.logprob, entry.rank)]
        ranked += [(token_id, logprob, rank) for rank, (token_id, logprob) in enumerate(entry.top, 1)]
        item: dict[int, PromptLogprob] = {}
        for token_id, logprob, rank in ranked:
            item.setdefault(token_id, PromptLogprob(logprob=clamp_logprob(logprob), rank=rank,
                                                    decoded_token=token_text(tokenizer, token_id)[0]))
        result.append(item)
    return result


def decode_request(body: bytes, schema: type[msgspec.Struct]) -> Any:
    """The typed request; raises msgspec.DecodeError (or ValidationError) on bad input."""
    return msgspec.json.decode(body, type=schema)


COMMON_SCHEMAS = (ErrorResponse, ModelList, TokenizeRequest, TokenizeResponse, DetokenizeRequest,
                  DetokenizeResponse, VersionResponse)
