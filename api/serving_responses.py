"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API on the chat path.

A request becomes a chat request (responses_chat.py); `previous_response_id` puts a stored
response's conversation (its input and output, not its instructions) before its input. It runs as
a chat completion (prepare_chat: the template, tool choice, structured output, sampling, the
parsers), and the parsed output becomes output items: `reasoning`, a `message` with one
`output_text`, a `function_call` per call.

A stream sends the Responses events, each as `event: <type>` and its JSON: response.created and
.in_progress, then per item output_item.added, its part or arguments (.added, deltas, .done),
output_item.done, and response.completed (or .incomplete, .failed). Responses with `store` (the
default) are kept in memory, the newest STORE_SIZE of them, for GET and `previous_response_id`.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from flint_sched.api.errors import APIError
from flint_sched.api.parsers import OutputDelta
from flint_sched.api.parsers.reasoning import THINK_END
from flint_sched.api.protocol_responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from flint_sched.api.responses_chat import chat_request, output_messages
from flint_sched.api.serving_chat import PreparedChat, StreamedChoice, prepare_chat
from flint_sched.api.streaming import SSEResponse, engine_failed, exchange_ids, last_output, one_request
from flint_sched.engine.outputs import EngineError, RequestOutput

if TYPE_CHECKING:
    from flint_sched.api.server import ServingContext

STORE_SIZE = 1024               # stored responses kept (the oldest go first)
ABORTED = ResponseError(code="server_error", message="generation was aborted (the server is shutting down)")


@dataclass
class Stored:
    """A stored response: its conversation (without instructions, with its output) and the object."""

    messages: list[dict]
    response: ResponseObject


@dataclass
class ResponseStore:
    """The newest STORE_SIZE stored responses, by id (one per API process)."""

    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self.items.get(response_id)
        if stored is None:
            raise APIError(404, f"response {response_id!r} not found (responses are kept in memory, the newest "
                                f"{STORE_SIZE}, and only with store: true)", param)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        self.items[response_id] = stored
        while len(self.items) > STORE_SIZE:
            self.items.popitem(last=False)


@dataclass
class Exchange:
    """One response being made: the request, its chat form, and what the object echoes."""

    request: ResponsesRequest
    prepared: PreparedChat
    conversation: list[dict]
    created_at: int

    def response(self, status: str, output: list[OutputItem], usage: ResponseUsage | None = None,
                 error: ResponseError | None = None) -> ResponseObject:
        req, params = self.request, self.prepared.params
        fmt = msgspec.to_builtins(req.text.format) if req.text is not None and req.text.format else {"type": "text"}
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        return ResponseObject(
            id=self.prepared.request_id, created_at=self.created_at, status=status, error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, model=self.prepared.model,
            output=output, parallel_tool_calls=req.parallel_tool_calls, previous_response_id=req.previous_response_id,
            reasoning=msgspec.to_builtins(req.reasoning) if req.reasoning else {"effort": None, "summary": None},
            store=req.store, temperature=params.temperature, text={"format": fmt},
            tool_choice=choice if isinstance(choice, str) else msgspec.to_builtins(choice),
            tools=[msgspec.to_builtins(t) for t in req.tools or ()], top_p=params.top_p, truncation="disabled",
            usage=usage, user=req.user, metadata=dict(req.metadata or {}))

    def usage(self, final: RequestOutput, tokenizer) -> ResponseUsage:
        out, reasoning, parser = final.outputs[0], 0, self.prepared.new_parser().reasoning
        if parser is not None and parser.thinking:            # the output starts inside reasoning
            end = tokenizer.token_id(THINK_END)
            reasoning = out.token_ids.index(end) if end in out.token_ids else len(out.token_ids)
        prompt, generated = len(self.prepared.prompt_token_ids), len(out.token_ids)
        return ResponseUsage(input_tokens=prompt, input_tokens_details=InputTokensDetails(
            cached_tokens=final.num_cached_tokens), output_tokens=generated,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning), total_tokens=prompt + generated)

    def finish(self, ctx: ServingContext, status: str, output: list[OutputItem],
               final: RequestOutput) -> ResponseObject:
        """The finished response (`status` from status_of), stored where the request asks."""
        response = self.response(status, output, self.usage(final, ctx.tokenizer),
                                 ABORTED if status == "failed" else None)
        if self.request.store:
            ctx.responses.put(response.id, Stored(self.conversation + output_messages(response.output), response))
        return response


def status_of(finish_reason: str | None) -> str:
    """A response's status from its output's finish reason."""
    return {"length": "incomplete", "abort": "failed"}.get(finish_reason, "completed")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(reasoning: str | None, content: str | None, calls: list[tuple[str, str, str]],
                 incomplete: bool) -> list[OutputItem]:
    """The output items of a parsed output (calls: (call id, name, arguments)); the last one is
    `incomplete` when generation was cut."""
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningItem(id=_item_id("rs"), status="completed", content=[ReasoningText(text=reasoning)]))
    if content:
        items.append(MessageItem(id=_item_id("msg"), status="completed", content=[OutputText(text=content)]))
    for call_id, name, arguments in calls:
        items.append(FunctionCallItem(id=_item_id("fc"), status="completed", call_id=call_id, name=name,
                                      arguments=arguments))
    if incomplete and items:
        items[-1].status = "incomplete"
    return items


# the items with one text part: (id prefix, part, event name, what its delta and done events add)
TEXT_ITEMS = {ReasoningItem: ("rs", ReasoningText, "reasoning_text", {}),
              MessageItem: ("msg", OutputText, "output_text", {"logprobs": []})}


class EventStream:
    """The events of a streamed response, from the parser's deltas: at most one item is open."""

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self.sequence = 0
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.call_index: int | None = None            # the parser's index of the open call

    def event(self, type_: str, **fields) -> bytes:
        payload = msgspec.json.encode(ResponseEvent(type=type_, sequence_number=self.sequence, **fields))
        self.sequence += 1
        return b"event: " + type_.encode() + b"\ndata: " + payload + b"\n\n"

    def start(self) -> list[bytes]:
        response = self.exchange.response("in_progress", [])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _open(self, item: OutputItem, part: OutputText | ReasoningText | None = None) -> list[bytes]:
        """Starts an item (added empty, then its one part)."""
        events = self.close()
        self.open = item
        index = len(self.items)
        self.items.append(item)
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if part is not None:
            item.content.append(part)
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=index,
                                     content_index=0, part=part))
        return events

    def close(self, status: str = "completed") -> list[bytes]:
        """Ends the open item (its .done events); none left open."""
        item, self.open, self.call_index = self.open, None, None
        if item is None:
            return []
        index = len(self.items) - 1
        item.status = status
        events = []
        if type(item) in TEXT_ITEMS:
            _, _, kind, extra = TEXT_ITEMS[type(item)]
            part = item.content[0]
            events += [self.event(f"response.{kind}.done", item_id=item.id, output_index=index, content_index=0,
                                  text=part.text, **extra),
                       self.event("response.content_part.done", item_id=item.id, output_index=index,
                                  content_index=0, part=part)]
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                     arguments=item.arguments))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _text(self, item_type: type, text: str) -> list[bytes]:
        """Text for the open reasoning or message item (one opened first when another is open)."""
        prefix, part_type, kind, extra = TEXT_ITEMS[item_type]
        events = []
        if not isinstance(self.open, item_type):
            events += self._open(item_type(id=_item_id(prefix), status="in_progress", content=[]), part_type(text=""))
        self.open.content[0].text += text
        events.append(self.event(f"response.{kind}.delta", item_id=self.open.id, output_index=len(self.items) - 1,
                                 content_index=0, delta=text, **extra))
        return events

    def feed(self, delta: OutputDelta) -> list[bytes]:
        events: list[bytes] = []
        for item_type, text in ((ReasoningItem, delta.reasoning), (MessageItem, delta.content)):
            if text:
                events += self._text(item_type, text)
        for call in delta.tool_calls:
            function = call.get("function") or {}
            if call.get("id") is not None and call["index"] != self.call_index:
                events += self._open(FunctionCallItem(id=_item_id("fc"), status="in_progress", call_id=call["id"],
                                                      name=function.get("name") or "", arguments=""))
                self.call_index = call["index"]
            if function.get("arguments") and isinstance(self.open, FunctionCallItem):
                self.open.arguments += function["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open.id,
                                         output_index=len(self.items) - 1, delta=function["arguments"]))
        return events


async def response_events(ctx: ServingContext, exchange: Exchange, stream) -> AsyncIterator[bytes]:
    events = EventStream(exchange)
    choice = StreamedChoice(exchange.prepared, ctx.tokenizer)
    for event in events.start():
        yield event
    final = None
    try:
        async for out in stream:
            final = out
            for output in out.outputs:
                for event in events.feed(choice.parse(output)):
                    yield event
    except EngineError as error:
        for event in events.close("incomplete"):
            yield event
        failure = ResponseError(code="server_error", message=engine_failed(error).message)
        yield events.event("response.failed", response=exchange.response("failed", events.items, error=failure))
        return
    finally:
        await stream.aclose()
    status = status_of(final.outputs[0].finish_reason)
    for event in events.close("completed" if status == "completed" else "incomplete"):
        yield event
    yield events.event(f"response.{status}", response=exchange.finish(ctx, status, events.items, final))


async def create_response(ctx: ServingContext, request: Request, body: bytes) -> Response:
    def prepare() -> tuple[Exchange, str]:
        req = ctx.decode(body, ResponsesRequest)
        history = (ctx.responses.get(req.previous_response_id, "previous_response_id").messages
                   if req.previous_response_id else [])
        chat, conversation = chat_request(req, history)
        response_id, engine_id = exchange_ids("resp_", request.headers, req.request_id)
        return Exchange(req, prepare_chat(ctx, chat, response_id), conversation, int(time.time())), engine_id

    exchange, engine_id = await ctx.off_loop(prepare)
    prepared = exchange.prepared
    guard, stream = one_request(ctx.engine, ctx.metrics, request.receive, prepared.prompt_token_ids, prepared.params,
                                engine_id)
    if exchange.request.stream:
        return SSEResponse(response_events(ctx, exchange, stream), guard)
    final = await last_output(stream, guard)
    if final is None:
        return Response(status_code=499)
    out = final.outputs[0]
    parsed = prepared.new_parser().parse(prepared.parser_prefix + out.text)
    calls = [(call.id, call.name, call.arguments_json) for call in parsed.tool_calls]
    status = status_of(out.finish_reason)
    output = output_items(parsed.reasoning, parsed.content, calls, incomplete=status != "completed")
    response = exchange.finish(ctx, status, output, final)
    return Response(msgspec.json.encode(response), media_type="application/json")


async def retrieve_response(request: Request) -> Response:
    """`GET /v1/responses/{response_id}`: a stored response, or 404."""
    ctx: ServingContext = request.app.state.ctx
    stored = ctx.responses.get(request.path_params["response_id"])
    return Response(msgspec.json.encode(stored.response), media_type="application/json")
