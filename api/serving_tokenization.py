"""`POST /tokenize` and `POST /detokenize`, run on the prepare threads (they grow with the input).

A text that cannot fit `--max-model-len` is refused before it is tokenized, and so is a token list
longer than that: the server never handles a sequence the model cannot hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from flint_sched.api import errors
from flint_sched.api.limits import check_tool_call_arguments, too_long
from flint_sched.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    tool_dicts,
)
from flint_sched.api.serving_chat import render_messages

if TYPE_CHECKING:
    from flint_sched.api.server import ServingContext


def _json(payload) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


def tokenize_body(ctx: ServingContext, body: bytes) -> Response:
    """Text, or messages through the chat template, to token ids."""
    req: TokenizeRequest = ctx.decode(body, TokenizeRequest)
    ctx.model_name(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise errors.bad_request("give exactly one of `prompt` and `messages`", "prompt")
    text, param = req.prompt, "prompt"
    if req.messages is not None:
        check_tool_call_arguments(req.messages)
        text, param = render_messages(ctx, req.messages, tool_dicts(req.tools), req.chat_template_kwargs,
                                      req.add_generation_prompt, req.continue_final_message,
                                      req.chat_template), "messages"
    ids = ctx.encode(text, param)
    if len(ids) > ctx.max_model_len:
        raise too_long(len(ids), ctx.max_model_len, param)
    strs = [ctx.tokenizer.decode([i]) for i in ids] if req.return_token_strs else None
    return _json(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs))


def detokenize_body(ctx: ServingContext, body: bytes) -> Response:
    req: DetokenizeRequest = ctx.decode(body, DetokenizeRequest)
    ctx.model_name(req.model)
    if len(req.tokens) > ctx.max_model_len:
        raise errors.bad_request(f"{len(req.tokens)} tokens: more than this model's maximum context length "
                                 f"({ctx.max_model_len})", "tokens")
    vocab_size = ctx.state.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise errors.bad_request(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "tokens")
    return _json(DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens)))


async def tokenize(ctx: ServingContext, request: Request, body: bytes) -> Response:
    return await ctx.off_loop(tokenize_body, ctx, body)


async def detokenize(ctx: ServingContext, request: Request, body: bytes) -> Response:
    return await ctx.off_loop(detokenize_body, ctx, body)
