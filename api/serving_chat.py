"""`POST /v1/chat/completions`: render the conversation, run it, parse reasoning and tool calls.

A forced call start (tool_choice required / named, see tool_choice.py) ends the prompt and is fed to
each choice's parser before the model's text, in the full and the streamed path alike. A stream:
per choice a role chunk, then a chunk per visible change, its finish chunk; usage; `data: [DONE]`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from flint_sched.api.errors import bad_request, from_value_error
from flint_sched.api.limits import check_tool_call_arguments, kept_prompt_tokens
from flint_sched.api.parsers import OutputDelta, OutputParser, make_output_parser
from flint_sched.api.protocol import (
    ChatMessage,
    clamp_logprob,
    continuous_usage,
    final_usage,
    logprob_names,
    message_dicts,
    prompt_logprobs_json,
    sampling_params,
    token_text,
    usage,
)
from flint_sched.api.protocol_chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
)
from flint_sched.api.streaming import (
    SSE_DONE,
    SSEResponse,
    engine_failed,
    exchange_ids,
    last_output,
    one_request,
    sse_error,
    sse_event,
)
from flint_sched.api.parsers.reasoning import THINK_END
from flint_sched.api.structured_outputs import compiled, requested_constraint
from flint_sched.api.tool_choice import ToolPolicy, ends_in_reasoning, force_call, tool_policy
from flint_sched.api.tool_grammar import tool_call_grammar
from flint_sched.core.plan import TokenLogprobs
from flint_sched.engine.outputs import CompletionOutput, EngineError
from flint_sched.sampling_params import SamplingParams
from flint_sched.structured import StructuredOutputsParams
from flint_sched.tokenizer import render_chat

if TYPE_CHECKING:
    from flint_sched.api.server import ServingContext

MAX_TOP_LOGPROBS = 20
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})
_REQUEST_FIELDS = ChatCompletionRequest.__struct_fields__


@dataclass(frozen=True)
class PreparedChat:
    """A validated chat request, ready for the engine."""

    request: ChatCompletionRequest
    request_id: str
    created: int
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    policy: ToolPolicy
    parser_prefix: str                         # the forced call start the parser reads first
    new_parser: Callable[[], OutputParser]

    def chunk(self, choices: list[ChatStreamChoice], usage_=None, prompt_token_ids=None) -> bytes:
        return sse_event(ChatCompletionChunk(id=self.request_id, object="chat.completion.chunk",
                                             created=self.created, model=self.model, choices=choices,
                                             usage=usage_, prompt_token_ids=prompt_token_ids))


def render_messages(ctx: ServingContext, messages: list[ChatMessage], tools: list[dict] | None,
                    template_kwargs: dict | None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None) -> str:
    """The conversation through the chat template (the request's own where the server trusts it;
    request kwargs over the server's defaults); with `continue_final_message` the last message is
    left open for the model to go on writing."""
    template = ctx.chat_template
    if chat_template is not None:
        if not ctx.config.trust_request_chat_template:
            raise bad_request("a request's own chat_template is refused: the server renders it only when started "
                              "with --trust-request-chat-template", "chat_template")
        template = chat_template
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message needs add_generation_prompt: false (the model continues the "
                          "final message instead of starting a new one)", "continue_final_message")
    check_content_parts(messages)
    kwargs = {**ctx.config.default_chat_template_kwargs, **(template_kwargs or {})}
    kwargs = {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    try:
        return render_chat(template, message_dicts(messages), tools,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, **kwargs)
    except ValueError as error:
        raise bad_request(str(error), "messages") from error
    except RecursionError as error:
        raise bad_request("the conversation nests too deeply for the chat template", "messages") from error


def check_content_parts(messages: list[ChatMessage]) -> None:
    """A list `content` holds text parts, each with its text: the model reads text only, so an image
    or audio part is refused rather than dropped unseen."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text":
                raise bad_request(f"messages[{i}].content[{j}]: '{part.type}' parts are not supported (this model "
                                  "reads text only)", "messages")
            if part.text is None:
                raise bad_request(f"messages[{i}].content[{j}]: a text part needs `text`", "messages")


def prepare_chat(ctx: ServingContext, request: ChatCompletionRequest, request_id: str) -> PreparedChat:
    """Validates and renders (APIError 4xx on bad input); no engine work yet. Runs off the loop."""
    model = ctx.model_name(request.model)
    policy = tool_policy(request, ctx.config.tool_flags)
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if request.prompt_logprobs is not None:
        most = min(MAX_TOP_LOGPROBS, ctx.config.max_logprobs)
        if not 0 <= request.prompt_logprobs <= most:
            raise bad_request(f"prompt_logprobs must be in [0, {most}] (--max-logprobs)", "prompt_logprobs")
        if request.stream:
            raise bad_request("prompt_logprobs is not available when streaming", "prompt_logprobs")
    if request.top_logprobs is not None:
        if not request.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        most = min(MAX_TOP_LOGPROBS, ctx.config.max_logprobs)
        if not 0 <= request.top_logprobs <= most:
            raise bad_request(f"top_logprobs must be in [0, {most}] (--max-logprobs)", "top_logprobs")
    check_tool_call_arguments(request.messages)
    prompt = render_messages(ctx, request.messages, policy.template_tools, request.chat_template_kwargs,
                             request.add_generation_prompt, request.continue_final_message, request.chat_template)
    prompt_suffix, parser_prefix = force_call(policy, prompt)
    prompt += prompt_suffix
    thinking = ends_in_reasoning(prompt)
    prompt_ids = ctx.encode(prompt, "messages", kept_prompt_tokens(request.truncate_prompt_tokens, ctx.max_model_len))
    constraint = output_constraint(ctx, request, policy, thinking)
    reasoning_parser = ctx.config.reasoning_parser
    # NOTE: the parsers read GLM's tags, which are special tokens in our vocabulary: keep them in the text
    parses = reasoning_parser is not None or policy.parser_tools is not None
    requested = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
    try:
        params = sampling_params(
            request, max_tokens=ctx.max_tokens(requested, len(prompt_ids)),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            skip_special_tokens=False if parses else request.skip_special_tokens,
            structured_outputs=constraint, prompt_logprobs=request.prompt_logprobs,
            defaults=ctx.config.sampling_defaults)
    except ValueError as error:
        raise from_value_error(error, _REQUEST_FIELDS) from error

    def new_parser() -> OutputParser:
        return make_output_parser(reasoning_parser, policy.tool_call_parser, thinking=thinking,
                                  tools=policy.parser_tools, parallel_tool_calls=policy.parallel_tool_calls)

    return PreparedChat(request, request_id, int(time.time()), model, prompt_ids, params, policy, parser_prefix,
                        new_parser)


def output_constraint(ctx: ServingContext, request: ChatCompletionRequest, policy: ToolPolicy,
                      thinking: bool) -> StructuredOutputsParams | None:
    """The grammar of a forced tool call, else the requested constraint (with a reasoning parser and
    the output starting in reasoning, it begins once the reasoning ends, as in vLLM), compiled here;
    None when the output is free."""
    forced = tool_call_grammar(policy)
    if forced is not None:
        compiled(ctx.grammar_compiler, forced, "tools")
        return forced
    found = requested_constraint(request)
    if found is None:
        return None
    constraint, field = found
    if thinking and ctx.config.reasoning_parser is not None and THINK_END in ctx.tokenizer.special_tokens:
        constraint = dataclasses.replace(constraint, begin_after_token=ctx.tokenizer.special_tokens[THINK_END])
    compiled(ctx.grammar_compiler, constraint, field)
    return constraint


def top_logprob(tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text, raw = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=clamp_logprob(logprob), bytes=raw)


def chat_logprobs(tokenizer, entries: list[TokenLogprobs]) -> ChatLogprobs:
    content = []
    for entry in entries:
        text, raw = token_text(tokenizer, entry.token_id)
        top = [top_logprob(tokenizer, token_id, logprob) for token_id, logprob in entry.top]
        content.append(TokenLogprob(token=text, logprob=clamp_logprob(entry.logprob), bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def full_choice(ctx: ServingContext, prepared: PreparedChat, out: CompletionOutput) -> ChatChoice:
    """A non-streamed choice: the whole text parsed at once."""
    parsed = prepared.new_parser().parse(prepared.parser_prefix + out.text)
    calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments_json))
             for c in parsed.tool_calls]
    reasoning = parsed.reasoning if prepared.request.include_reasoning else None
    message = ChatResponseMessage(role="assistant", content=parsed.content, reasoning=reasoning, tool_calls=calls)
    names = logprob_names(ctx.tokenizer, prepared.request)
    logprobs = chat_logprobs(names, out.logprobs) if out.logprobs is not None else None
    return ChatChoice(index=out.index, message=message, logprobs=logprobs,
                      finish_reason=prepared.policy.finish_reason(out.finish_reason, bool(calls)),
                      stop_reason=out.stop_reason,
                      token_ids=list(out.token_ids) if prepared.request.return_token_ids else UNSET)


def delta_message(delta: OutputDelta, include_reasoning: bool) -> DeltaMessage:
    """A parser delta as an OpenAI delta; empty parts are left out."""
    return DeltaMessage(content=delta.content or None,
                        reasoning=(delta.reasoning or None) if include_reasoning else None,
                        tool_calls=[msgspec.convert(call, DeltaToolCall) for call in delta.tool_calls])


def merge_deltas(first: OutputDelta, second: OutputDelta) -> OutputDelta:
    return OutputDelta(first.reasoning + second.reasoning, first.content + second.content,
                       first.tool_calls + second.tool_calls)


class StreamedChoice:
    """One choice of a stream: its parser, and whether its finish chunk has gone out."""

    def __init__(self, prepared: PreparedChat, tokenizer):
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.parser = prepared.new_parser()
        self.unread_prefix = prepared.parser_prefix
        self.finished = False

    def parse(self, out: CompletionOutput) -> OutputDelta:
        """This output's text through the parser (flushed at the end)."""
        text, self.unread_prefix = self.unread_prefix + out.delta_text, ""
        delta = self.parser.feed(text)
        return merge_deltas(delta, self.parser.finish()) if out.finished else delta

    def step(self, out: CompletionOutput) -> ChatStreamChoice | None:
        """The chunk choice for one output, or None when it changes nothing visible."""
        delta = delta_message(self.parse(out), self.prepared.request.include_reasoning)
        logprobs = chat_logprobs(self.tokenizer, out.delta_logprobs) if out.delta_logprobs else None
        ids = list(out.delta_token_ids) if self.prepared.request.return_token_ids else UNSET
        if not out.finished:
            if delta.is_empty and logprobs is None and not ids:
                return None
            return ChatStreamChoice(index=out.index, delta=delta, logprobs=logprobs, token_ids=ids)
        self.finished = True
        reason = self.prepared.policy.finish_reason(out.finish_reason, self.parser.has_tool_calls)
        return ChatStreamChoice(index=out.index, delta=delta, logprobs=logprobs, finish_reason=reason,
                                stop_reason=out.stop_reason, token_ids=ids)


async def chat_events(ctx: ServingContext, prepared: PreparedChat, stream) -> AsyncIterator[bytes]:
    """The SSE events of a streamed chat completion."""
    n = prepared.request.n
    choices = [StreamedChoice(prepared, logprob_names(ctx.tokenizer, prepared.request)) for _ in range(n)]
    num_prompt = len(prepared.prompt_token_ids)
    running = continuous_usage(prepared.request.stream_options)
    prompt_ids = prepared.prompt_token_ids if prepared.request.return_token_ids else None
    for index in range(n):                     # return_token_ids: the prompt's in the first chunk
        yield prepared.chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
                             usage(num_prompt, 0) if running else None, None if index else prompt_ids)
    num_tokens = [0] * n
    num_cached_tokens = 0
    try:
        async for out in stream:
            num_cached_tokens = max(num_cached_tokens, out.num_cached_tokens)
            for output in out.outputs:
                num_tokens[output.index] = len(output.token_ids)
                if choices[output.index].finished:
                    continue
                choice = choices[output.index].step(output)
                if choice is not None:
                    yield prepared.chunk([choice], usage(num_prompt, num_tokens[output.index], num_cached_tokens)
                                         if running else None)
    except EngineError as error:
        yield sse_error(engine_failed(error))
        yield SSE_DONE
        return
    finally:
        await stream.aclose()
    if final_usage(prepared.request.stream_options, ctx.config.force_include_usage):
        yield prepared.chunk([], usage(len(prepared.prompt_token_ids), sum(num_tokens), num_cached_tokens))
    yield SSE_DONE


async def create_chat_completion(ctx: ServingContext, request: Request, body: bytes) -> Response:
    def prepare() -> tuple[PreparedChat, str]:
        chat = ctx.decode(body, ChatCompletionRequest)
        response_id, engine_id = exchange_ids("chatcmpl-", request.headers, chat.request_id)
        return prepare_chat(ctx, chat, response_id), engine_id

    prepared, engine_id = await ctx.off_loop(prepare)
    chat = prepared.request
    guard, stream = one_request(ctx.engine, ctx.metrics, request.receive, prepared.prompt_token_ids, prepared.params,
                                engine_id)
    if chat.stream:
        return SSEResponse(chat_events(ctx, prepared, stream), guard)
    final = await last_output(stream, guard)
    if final is None:
        return Response(status_code=499)
    choices = [full_choice(ctx, prepared, out) for out in final.outputs]
    prompt_logprobs = None
    if final.prompt_logprobs is not None:
        prompt_logprobs = prompt_logprobs_json(ctx.tokenizer, final.prompt_logprobs)
    response = ChatCompletionResponse(id=prepared.request_id, created=prepared.created, model=prepared.model,
                                      choices=choices, usage=usage(len(prepared.prompt_token_ids),
                                                                   sum(len(o.token_ids) for o in final.outputs),
                                                                   final.num_cached_tokens),
                                      prompt_logprobs=prompt_logprobs,
                                      prompt_token_ids=prepared.prompt_token_ids if chat.return_token_ids else UNSET)
    return Response(msgspec.json.encode(response), media_type="application/json")
