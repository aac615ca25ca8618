"""`POST /v1/completions`: the request, the response and the stream chunk (object "text_completion").

`prompt` is text, a list of texts, a list of token ids, or a list of such lists; one choice per
(prompt, n) pair, indexed prompt_index * n + i as vLLM does. Chunks reuse the choice struct.
"""

from __future__ import annotations

from typing import Literal

from msgspec import UNSET, UnsetType

from flint_sched.api.protocol import ConstraintFields, PromptLogprob, Reply, Schema, StreamOptions, Usage

Prompt = str | list[str | int | list[int]]


class CompletionRequest(ConstraintFields, kw_only=True):
    prompt: Prompt
    model: str | None = None
    best_of: int | None = None
    echo: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
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


class CompletionLogprobs(Reply, kw_only=True):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(Reply, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    # return_token_ids: the prompt's (a stream: in the choice's first chunk) and the output's (a stream: the chunk's)
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class CompletionResponse(Reply, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Schema, kw_only=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


COMPLETION_SCHEMAS = (CompletionRequest, CompletionResponse, CompletionChunk)
