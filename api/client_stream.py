"""Streamed responses: the SSE line decoder, the `Stream` wrapper around an open HTTP response, and the
accumulators that fold chunks into the object the non-streaming call returns.

A `Stream` closes its response at `[DONE]`, on any error, on task cancellation, on `aclose()` / leaving
`async with`, and when a loop breaks out of it (asyncio finalizes the abandoned iterator right away).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import httpx
import msgspec

from flint_sched.api.client_types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FlintAPIError,
    FlintConnectionError,
    FlintTimeoutError,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
    Usage,
    decode_response,
)

ChunkT = TypeVar("ChunkT", ChatCompletionChunk, Completion)
ResultT = TypeVar("ResultT", ChatCompletion, Completion)
DONE = "[DONE]"


class SSEDecoder:
    """Feeds lines one at a time; returns an event's data (its `data:` lines joined by newlines) at the
    blank line that ends it. Comments (`:`) and the other fields (`event`, `id`, `retry`) are skipped."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def check_error_event(data: str) -> None:
    """Raises the `{"error": {...}}` a server sends inside a stream when generation fails."""
    if '"error"' not in data:
        return
    try:
        payload = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return  # _decode reports it
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        code = error.get("code")
        raise FlintAPIError(code if isinstance(code, int) and code >= 400 else 500, error.get("type"),
                            str(error.get("message", "")), error.get("param"), code)


class Stream(Generic[ChunkT, ResultT]):
    """An open streamed response. Iterate it once for typed chunks, or `await collect()` for the final object."""

    def __init__(self, response: httpx.Response, chunk_type: type[ChunkT],
                 accumulate: Callable[[Iterable[ChunkT]], ResultT]) -> None:
        self.response = response
        self._decoder = msgspec.json.Decoder(chunk_type)
        self._accumulate = accumulate
        self._started = False

    def __aiter__(self) -> AsyncIterator[ChunkT]:
        if self._started:
            raise RuntimeError("a stream can be iterated only once")
        self._started = True
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[ChunkT]:
        sse = SSEDecoder()
        try:
            async for line in self.response.aiter_lines():
                data = sse.feed(line)
                if data is not None:
                    if data.strip() == DONE:
                        return
                    yield self._decode(data)
            tail = sse.flush()
            if tail is not None and tail.strip() != DONE:
                yield self._decode(tail)
        except httpx.TimeoutException as e:
            raise FlintTimeoutError(f"stream timed out: {e!r}") from e
        except httpx.TransportError as e:
            raise FlintConnectionError(f"stream broken: {e!r}") from e
        finally:
            await self.response.aclose()

    def _decode(self, data: str) -> ChunkT:
        check_error_event(data)
        return decode_response(self._decoder, data)

    async def collect(self) -> ResultT:
        """Reads the whole stream and folds it into the non-streaming result."""
        async with self:
            return self._accumulate([chunk async for chunk in self])

    async def aclose(self) -> None:
        await self.response.aclose()

    async def __aenter__(self) -> Stream[ChunkT, ResultT]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@dataclass
class _ToolCallState:
    id: str = ""
    type: str = "function"
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class _ChatChoiceState:
    role: str = "assistant"
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, _ToolCallState] = field(default_factory=dict)
    last_tool_index: int = -1
    finish_reason: str | None = None
    logprobs: list | None = None
    token_ids: list[int] | None = None


def _joined_or_none(parts: list[str]) -> str | None:
    return "".join(parts) or None


def add_tool_call_delta(state: _ChatChoiceState, delta: ToolCallDelta) -> None:
    """A header (`index`, `id`, `type`, `function.name`) opens a call; `function.arguments` fragments are
    appended to the call at their index. A delta without an index continues the last call unless its id is new."""
    index = delta.index
    if index is None:
        known_ids = {call.id for call in state.tool_calls.values()}
        index = len(state.tool_calls) if (delta.id and delta.id not in known_ids) or not state.tool_calls \
            else state.last_tool_index
    call = state.tool_calls.setdefault(index, _ToolCallState())
    state.last_tool_index = index
    if delta.id:
        call.id = delta.id
    if delta.type:
        call.type = delta.type
    if delta.function is not None:
        if delta.function.name and not call.name:
            call.name = delta.function.name
        if delta.function.arguments:
            call.arguments.append(delta.function.arguments)


def accumulate_chat(chunks: Iterable[ChatCompletionChunk]) -> ChatCompletion:
    """Folds chat chunks into a `ChatCompletion`: content and reasoning concatenated per choice index (empty
    becomes null, as in a non-streamed message), tool calls completed, the last finish_reason and usage kept;
    with return_token_ids, the token ids too."""
    states: dict[int, _ChatChoiceState] = {}
    head = ChatCompletionChunk()
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    for chunk in chunks:
        head = chunk if not head.id else head
        usage = chunk.usage or usage
        prompt_token_ids = chunk.prompt_token_ids if chunk.prompt_token_ids is not None else prompt_token_ids
        for choice in chunk.choices:
            state = states.setdefault(choice.index, _ChatChoiceState())
            delta = choice.delta
            state.role = delta.role or state.role
            if delta.content:
                state.content.append(delta.content)
            if delta.reasoning:
                state.reasoning.append(delta.reasoning)
            for tool_delta in delta.tool_calls or ():
                add_tool_call_delta(state, tool_delta)
            state.finish_reason = choice.finish_reason or state.finish_reason
            if choice.logprobs is not None and choice.logprobs.content is not None:
                state.logprobs = (state.logprobs or []) + choice.logprobs.content
            if choice.token_ids is not None:
                state.token_ids = (state.token_ids or []) + choice.token_ids
    choices = [
        ChatChoice(
            index=index,
            message=ChatMessage(
                role=state.role, content=_joined_or_none(state.content),
                reasoning=_joined_or_none(state.reasoning),
                tool_calls=[ToolCall(id=call.id, type=call.type,
                                     function=FunctionCall(call.name, "".join(call.arguments)))
                            for _, call in sorted(state.tool_calls.items())]),
            finish_reason=state.finish_reason,
            logprobs=None if state.logprobs is None else ChatLogprobs(content=state.logprobs),
            token_ids=state.token_ids)
        for index, state in sorted(states.items())
    ]
    return ChatCompletion(id=head.id, created=head.created, model=head.model, choices=choices, usage=usage,
                          prompt_token_ids=prompt_token_ids)


def accumulate_completion(chunks: Iterable[Completion]) -> Completion:
    """Folds `/v1/completions` chunks into one `Completion`: text, logprobs and token ids concatenated per
    choice index."""
    texts: dict[int, list[str]] = {}
    prompt_ids: dict[int, list[int]] = {}
    token_ids: dict[int, list[int]] = {}
    finish: dict[int, str | None] = {}
    logprobs: dict[int, CompletionLogprobs] = {}
    head = Completion()
    usage: Usage | None = None
    for chunk in chunks:
        head = chunk if not head.id else head
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts.setdefault(choice.index, []).append(choice.text)
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
            if choice.prompt_token_ids is not None:
                prompt_ids[choice.index] = choice.prompt_token_ids
            if choice.token_ids is not None:
                token_ids.setdefault(choice.index, []).extend(choice.token_ids)
            if choice.logprobs is not None:
                acc = logprobs.setdefault(choice.index, CompletionLogprobs())
                acc.tokens += choice.logprobs.tokens
                acc.token_logprobs += choice.logprobs.token_logprobs
                acc.text_offset += choice.logprobs.text_offset
                if choice.logprobs.top_logprobs is not None:
                    acc.top_logprobs = (acc.top_logprobs or []) + choice.logprobs.top_logprobs
    choices = [CompletionChoice(index=i, text="".join(parts), finish_reason=finish[i], logprobs=logprobs.get(i),
                                prompt_token_ids=prompt_ids.get(i), token_ids=token_ids.get(i))
               for i, parts in sorted(texts.items())]
    return Completion(id=head.id, created=head.created, model=head.model, choices=choices, usage=usage)
