"""`POST /v1/completions`: one engine request per prompt, n choices each, merged into one response.

Choice i of prompt p has index p * n + i. `echo` puts the prompt text before the output (in the
stream: as each choice's first chunk); with `logprobs` its logprobs start with the prompt's tokens
(prompt logprobs: in a stream the echo chunk comes with the choice's first output). `echo` with
`max_tokens: 0` returns the prompt alone, scored with `logprobs` (OpenAI's legacy way to score a
text, as vLLM does: one token is generated and dropped; finish_reason "length", 0 completion
tokens). `suffix` is refused (400); `prompt_logprobs` when streaming too, as in vLLM.
`text_offset` counts characters of the tokens' texts from the start of the choice's output.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from flint_sched.api.errors import bad_request, from_value_error
from flint_sched.api.limits import MAX_CHOICES_PER_REQUEST, kept_prompt_tokens, too_long
from flint_sched.api.protocol import (
    MIN_LOGPROB,
    clamp_logprob,
    continuous_usage,
    final_usage,
    logprob_names,
    prompt_logprobs_json,
    sampling_params,
    token_text,
    usage,
)
from flint_sched.api.structured_outputs import compiled, requested_constraint
from flint_sched.api.protocol_completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from flint_sched.api.streaming import (
    SSE_DONE,
    ExchangeGuard,
    SSEResponse,
    engine_failed,
    exchange_ids,
    merge_streams,
    sse_error,
    sse_event,
    until_disconnect,
)
from flint_sched.core.plan import TokenLogprobs
from flint_sched.engine.outputs import CompletionOutput, EngineError, RequestOutput
from flint_sched.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from flint_sched.api.server import ServingContext

_REQUEST_FIELDS = CompletionRequest.__struct_fields__


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    text: str                       # for echo
    params: SamplingParams


def split_prompts(prompt) -> list[str | list[int]]:
    """The prompts of a request: a text, texts, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if prompt and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return list(prompt)
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                      "token ids, and not empty", "prompt")


def check_supported(request: CompletionRequest, max_logprobs: int = MAX_LOGPROBS) -> None:
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if request.suffix is not None:
        raise bad_request("suffix is not supported by this model (it has no fill-in-the-middle format)", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of is not supported: leave it out, or equal to n", "best_of")
    most = min(MAX_LOGPROBS, max_logprobs)
    if request.logprobs is not None and not 0 <= request.logprobs <= most:
        raise bad_request(f"logprobs must be in [0, {most}] (--max-logprobs)", "logprobs")
    if request.prompt_logprobs is not None and not 0 <= request.prompt_logprobs <= most:
        raise bad_request(f"prompt_logprobs must be in [0, {most}] (--max-logprobs)", "prompt_logprobs")
    if request.stream and request.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available when streaming", "prompt_logprobs")


def echo_only(request: CompletionRequest) -> bool:
    """`echo` with `max_tokens: 0`: the prompt back (and its logprobs), nothing generated."""
    return request.echo and request.max_tokens == 0


def prepare_prompts(ctx: ServingContext, request: CompletionRequest) -> list[PreparedPrompt]:
    """Validates and tokenizes every prompt (APIError 4xx on bad input). Runs off the loop."""
    check_supported(request, ctx.config.max_logprobs)
    prompts = split_prompts(request.prompt)
    if len(prompts) * request.n > MAX_CHOICES_PER_REQUEST:
        raise bad_request(f"{len(prompts)} prompts x n={request.n} choices: at most {MAX_CHOICES_PER_REQUEST} "
                          "choices per request", "prompt")
    found = requested_constraint(request)
    if found is not None:
        compiled(ctx.grammar_compiler, *found)
    prompt_logprobs = request.prompt_logprobs
    if request.echo and request.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
    keep = kept_prompt_tokens(request.truncate_prompt_tokens, ctx.max_model_len)
    prepared = []
    for prompt in prompts:
        if not isinstance(prompt, str) and keep is not None:
            prompt = prompt[-keep:]
        if not isinstance(prompt, str) and len(prompt) >= ctx.max_model_len:
            raise too_long(len(prompt), ctx.max_model_len, "prompt")
        ids = ctx.encode(prompt, "prompt", keep) if isinstance(prompt, str) else prompt
        text = prompt if isinstance(prompt, str) else (ctx.tokenizer.decode(ids) if request.echo else "")
        try:
            max_tokens = 1 if echo_only(request) else ctx.max_tokens(request.max_tokens, len(ids))
            params = sampling_params(request, max_tokens=max_tokens,
                                     logprobs=request.logprobs, skip_special_tokens=request.skip_special_tokens,
                                     structured_outputs=found[0] if found else None, prompt_logprobs=prompt_logprobs,
                                     defaults=ctx.config.sampling_defaults)
        except ValueError as error:
            raise from_value_error(error, _REQUEST_FIELDS) from error
        prepared.append(PreparedPrompt(ids, text, params))
    return prepared


def completion_logprobs(tokenizer, entries: list[TokenLogprobs], start_offset: int) -> tuple[CompletionLogprobs, int]:
    """The legacy logprobs shape; top_logprobs also holds the sampled token. Returns the next offset."""
    tokens, values, tops, offsets = [], [], [], []
    offset = start_offset
    for entry in entries:
        text, _ = token_text(tokenizer, entry.token_id)
        top = {token_text(tokenizer, i)[0]: clamp_logprob(lp) for i, lp in entry.top}
        top.setdefault(text, clamp_logprob(entry.logprob))
        tokens.append(text)
        values.append(max(entry.logprob, MIN_LOGPROB))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(text_offset=offsets, token_logprobs=values, tokens=tokens, top_logprobs=tops), offset


def prompt_token_logprobs(tokenizer, prompt_ids: list[int],
                          entries: list[TokenLogprobs | None]) -> tuple[CompletionLogprobs, int]:
    """echo + logprobs: the prompt's tokens, the first without a logprob (as vLLM); the next offset."""
    first = token_text(tokenizer, prompt_ids[0])[0]
    rest, offset = completion_logprobs(tokenizer, [e for e in entries[1:] if e is not None], len(first))
    return CompletionLogprobs(text_offset=[0, *rest.text_offset], token_logprobs=[None, *rest.token_logprobs],
                              tokens=[first, *rest.tokens], top_logprobs=[None, *rest.top_logprobs]), offset


def echoed_logprobs(tokenizer, prompt_ids: list[int], entries: list[TokenLogprobs | None],
                    out: CompletionOutput) -> CompletionLogprobs:
    """The prompt's tokens, then the output's."""
    head, offset = prompt_token_logprobs(tokenizer, prompt_ids, entries)
    tail, _ = completion_logprobs(tokenizer, out.logprobs or [], offset)
    return CompletionLogprobs(**{name: getattr(head, name) + getattr(tail, name)
                                 for name in CompletionLogprobs.__struct_fields__})


def full_choice(ctx: ServingContext, index: int, prompt: PreparedPrompt, request: CompletionRequest,
                final: RequestOutput, out: CompletionOutput) -> CompletionChoice:
    logprobs, names = None, logprob_names(ctx.tokenizer, request)
    generated = [] if echo_only(request) else list(out.token_ids)
    ids = {"prompt_token_ids": prompt.token_ids, "token_ids": generated} if request.return_token_ids else {}
    if echo_only(request):
        if request.logprobs is not None and final.prompt_logprobs is not None:
            logprobs, _ = prompt_token_logprobs(names, prompt.token_ids, final.prompt_logprobs)
        return CompletionChoice(index=index, text=prompt.text, logprobs=logprobs, finish_reason="length",
                                stop_reason=None, prompt_logprobs=prompt_logprobs_of(ctx, request, final), **ids)
    if request.echo and out.logprobs is not None and final.prompt_logprobs is not None:
        logprobs = echoed_logprobs(names, prompt.token_ids, final.prompt_logprobs, out)
    elif out.logprobs is not None:
        logprobs, _ = completion_logprobs(names, out.logprobs, 0)
    return CompletionChoice(index=index, text=(prompt.text if request.echo else "") + out.text, logprobs=logprobs,
                            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                            prompt_logprobs=prompt_logprobs_of(ctx, request, final), **ids)


def prompt_logprobs_of(ctx: ServingContext, request: CompletionRequest, final: RequestOutput):
    """vLLM's `prompt_logprobs` field, where the request asked for it."""
    if request.prompt_logprobs is None or final.prompt_logprobs is None:
        return None
    return prompt_logprobs_json(ctx.tokenizer, final.prompt_logprobs)


@dataclass
class Stream:
    """What streaming needs besides the engine streams: the ids and the running offsets."""

    ctx: ServingContext
    request: CompletionRequest
    request_id: str
    created: int
    model: str
    prompts: list[PreparedPrompt]
    prompt_ids_sent: set[int] = field(default_factory=set)

    def chunk(self, choices: list[CompletionChoice], usage_=None) -> bytes:
        return sse_event(CompletionChunk(id=self.request_id, object="text_completion", created=self.created,
                                         model=self.model, choices=choices, usage=usage_))

    def ids(self, index: int, token_ids: list[int]) -> dict:
        """return_token_ids: a chunk's token ids, and the prompt's in its choice's first chunk."""
        if not self.request.return_token_ids:
            return {}
        if index in self.prompt_ids_sent:
            return {"token_ids": list(token_ids)}
        self.prompt_ids_sent.add(index)
        return {"token_ids": list(token_ids), "prompt_token_ids": self.prompts[index // self.request.n].token_ids}


async def completion_events(s: Stream, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[bytes]:
    n = s.request.n
    offsets = [0] * (n * len(s.prompts))
    num_tokens = [0] * len(offsets)
    num_cached_tokens = [0] * len(streams)
    finished = [False] * len(offsets)
    # echo + logprobs: a choice's echo waits for its first output, which has the prompt logprobs
    scored_echo = s.request.echo and s.request.logprobs is not None
    generates = not echo_only(s.request)
    names = logprob_names(s.ctx.tokenizer, s.request)
    running = continuous_usage(s.request.stream_options)
    echoed = [not s.request.echo] * len(offsets)
    if s.request.echo and not scored_echo:
        for index in range(len(offsets)):
            echoed[index] = True
            text = s.prompts[index // n].text
            yield s.chunk([CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None,
                                            **s.ids(index, []))])
    # One prompt (the usual request) is read directly: each async generator between the engine and
    # the socket costs every token a frame resume (~1 µs), ~5 % of the host's time a token at 256 streams
    merged = merge_streams(streams) if len(streams) > 1 else None
    try:
        async for item in merged or streams[0]:
            prompt_index, out = (0, item) if merged is None else item
            num_cached_tokens[prompt_index] = max(num_cached_tokens[prompt_index], out.num_cached_tokens)
            for output in out.outputs:
                index = prompt_index * n + output.index
                if finished[index]:
                    continue
                if not echoed[index] and out.prompt_logprobs is not None:
                    echoed[index] = True
                    prompt = s.prompts[prompt_index]
                    logprobs, offsets[index] = prompt_token_logprobs(names, prompt.token_ids, out.prompt_logprobs)
                    yield s.chunk([CompletionChoice(index=index, text=prompt.text, logprobs=logprobs,
                                                    finish_reason=None, **s.ids(index, []))])
                finished[index] = output.finished
                if not generates:                     # the prompt alone: the generated token is dropped
                    if output.finished:
                        yield s.chunk([CompletionChoice(index=index, text="", logprobs=None, finish_reason="length",
                                                        **s.ids(index, []))])
                    continue
                num_tokens[index] = len(output.token_ids)
                logprobs = None
                if output.delta_logprobs:
                    logprobs, offsets[index] = completion_logprobs(names, output.delta_logprobs, offsets[index])
                new_ids = s.request.return_token_ids and output.delta_token_ids
                if output.delta_text or output.finished or logprobs is not None or new_ids:
                    so_far = usage(len(s.prompts[prompt_index].token_ids), num_tokens[index],
                                   num_cached_tokens[prompt_index]) if running else None
                    yield s.chunk([CompletionChoice(index=index, text=output.delta_text, logprobs=logprobs,
                                                    finish_reason=output.finish_reason,
                                                    stop_reason=output.stop_reason,
                                                    **s.ids(index, output.delta_token_ids))], so_far)
    except EngineError as error:
        yield sse_error(engine_failed(error))
        yield SSE_DONE
        return
    finally:
        if merged is None:
            await streams[0].aclose()
    if final_usage(s.request.stream_options, s.ctx.config.force_include_usage):
        yield s.chunk([], usage(sum(len(p.token_ids) for p in s.prompts), sum(num_tokens), sum(num_cached_tokens)))
    yield SSE_DONE


async def final_outputs(streams: list[AsyncIterator[RequestOutput]], guard: ExchangeGuard) -> list | None:
    """The final output of every prompt, in order (None when the client left first)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for prompt_index, out in until_disconnect(merge_streams(streams), guard.watcher):
            if out.finished:
                finals[prompt_index] = out
    except EngineError as error:
        raise engine_failed(error) from error
    return None if any(f is None for f in finals) else finals


async def create_completion(ctx: ServingContext, request: Request, body: bytes) -> Response:
    def prepare() -> tuple[CompletionRequest, str, list[PreparedPrompt]]:
        completion = ctx.decode(body, CompletionRequest)
        return completion, ctx.model_name(completion.model), prepare_prompts(ctx, completion)

    completion, model, prompts = await ctx.off_loop(prepare)
    (request_id, engine_id), created = exchange_ids("cmpl-", request.headers, completion.request_id), int(time.time())
    guard = ExchangeGuard(ctx.engine, ctx.metrics, request.receive)
    try:
        streams = [guard.add(p.token_ids, p.params, f"{engine_id}-{i}") for i, p in enumerate(prompts)]
    except BaseException:
        guard.close()
        raise
    if completion.stream:
        events = completion_events(Stream(ctx, completion, request_id, created, model, prompts), streams)
        return SSEResponse(events, guard)
    try:
        finals = await final_outputs(streams, guard)
    finally:
        guard.close()
    if finals is None:
        return Response(status_code=499)
    n = completion.n
    choices = [full_choice(ctx, p * n + out.index, prompts[p], completion, final, out)
               for p, final in enumerate(finals) for out in final.outputs]
    num_prompt = sum(len(p.token_ids) for p in prompts)
    num_completion = 0 if echo_only(completion) else sum(len(out.token_ids) for final in finals
                                                         for out in final.outputs)
    response = CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=usage(num_prompt, num_completion,
                                              sum(final.num_cached_tokens for final in finals)))
    return Response(msgspec.json.encode(response), media_type="application/json")
