"""A Responses API request as the chat request it runs as, and a response's output as the assistant
turn that continues its conversation (serving_responses.py serves both).

`instructions` become a system message first; `input` messages (a text is one user message,
`developer` reads as `system`), `function_call` items the assistant's tool calls,
`function_call_output` items tool messages, a `reasoning` item the next assistant turn's reasoning.
"""

from __future__ import annotations

from typing import Any

import msgspec

from flint_sched.api.errors import bad_request
from flint_sched.api.protocol_chat import ChatCompletionRequest
from flint_sched.api.protocol_responses import InputItem, MessageItem, OutputItem, ReasoningItem, ResponsesRequest

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_PASSED_ON = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop", "user",
              "parallel_tool_calls", "cache_salt")


def _text(content, where: str) -> str:
    """The text of a `content` (a string, or text parts joined); 400 for other parts."""
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type not in _TEXT_PARTS or part.text is None:
            raise bad_request(f"{where}: '{part.type}' parts are not supported (this model reads text only)", "input")
    return "".join(part.text for part in content)


def input_messages(items: list[InputItem]) -> list[dict]:
    """`input` items as chat messages (see the module docstring)."""
    messages: list[dict] = []
    reasoning = None                     # a reasoning item's text, for the next assistant turn

    def assistant_turn() -> dict:
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and reasoning is None:
            return last
        messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
        return messages[-1]

    for i, item in enumerate(items):
        kind = item.type or ("message" if item.role is not None else None)
        where = f"input[{i}]"
        if kind == "message":
            role = {"developer": "system"}.get(item.role, item.role)
            if role not in ("user", "system", "assistant"):
                raise bad_request(f"{where}: unknown role {item.role!r}", "input")
            text = _text(item.content, where)
            if role == "assistant":
                turn = assistant_turn()
                turn["content"] = (turn["content"] or "") + text
            else:
                messages.append({"role": role, "content": text})
            reasoning = None
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise bad_request(f"{where}: a function_call needs call_id and name", "input")
            turn = assistant_turn()
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            turn.setdefault("tool_calls", []).append(call)
            reasoning = None
        elif kind == "function_call_output":
            if not item.call_id:
                raise bad_request(f"{where}: a function_call_output needs call_id", "input")
            output = item.output if isinstance(item.output, str) else _text(item.output, where)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif kind == "reasoning":
            parts = (item.content if isinstance(item.content, list) else None) or item.summary or []
            reasoning = _text(parts, where)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (messages, function_call, "
                              "function_call_output and reasoning are)", "input")
    return messages


def chat_tools(request: ResponsesRequest) -> list[dict] | None:
    if request.tools is None:
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        if tool.type != "function" or not tool.name:
            raise bad_request(f"tools[{i}]: only function tools (with a name) are supported, got {tool.type!r}",
                              "tools")
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                    "strict": tool.strict}
        tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return tools


def chat_tool_choice(choice) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise bad_request(f"tool_choice of type {choice.type!r} is not supported: use none, auto, required or "
                          '{"type": "function", "name": ...}', "tool_choice")
    return {"type": "function", "function": {"name": choice.name}}


def response_format(request: ResponsesRequest) -> dict | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request('text.format "json_schema" needs a schema', "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                       "strict": fmt.strict}}
    raise bad_request(f"unknown text.format type {fmt.type!r}: use text, json_object or json_schema", "text")


def check_supported(request: ResponsesRequest) -> None:
    if request.background:
        raise bad_request("background responses are not supported: leave background out or false", "background")
    if request.truncation not in (None, "disabled"):
        raise bad_request("truncation must be \"disabled\": a conversation past the context is refused, not cut",
                          "truncation")
    if request.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses (use /v1/chat/completions)", "top_logprobs")
    if request.max_output_tokens is not None and request.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1, got {request.max_output_tokens}", "max_output_tokens")


def chat_request(request: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request to run, and the conversation to store (history and input, no instructions)."""
    check_supported(request)
    new = ([{"role": "user", "content": request.input}] if isinstance(request.input, str)
           else input_messages(request.input))
    conversation = history + new
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + conversation
    if not messages:
        raise bad_request("input is empty", "input")
    fields: dict[str, Any] = {"messages": messages, "max_completion_tokens": request.max_output_tokens,
                              "tools": chat_tools(request), "tool_choice": chat_tool_choice(request.tool_choice),
                              "response_format": response_format(request)}
    fields.update({name: getattr(request, name) for name in _PASSED_ON})
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning is not None and request.reasoning.effort == "none":
        kwargs["enable_thinking"] = False
    fields["chat_template_kwargs"] = kwargs or None
    fields = {name: value for name, value in fields.items() if value is not None}
    return msgspec.convert(fields, ChatCompletionRequest), conversation


def output_messages(output: list[OutputItem]) -> list[dict]:
    """A response's output as the assistant turn that continues its conversation."""
    turn: dict = {"role": "assistant", "content": None}
    for item in output:
        if isinstance(item, ReasoningItem):
            turn["reasoning"] = "".join(part.text for part in item.content)
        elif isinstance(item, MessageItem):
            turn["content"] = (turn["content"] or "") + "".join(part.text for part in item.content)
        else:
            turn.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
    return [turn]
