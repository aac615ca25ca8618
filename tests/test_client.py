"""AsyncFlintClient against a fake OpenAI-compatible server on loopback (and httpx.MockTransport for
connection errors): typed results, streaming and its accumulation, retries, errors, timeouts, disconnects."""

import asyncio
import json
import socket

import httpx
import msgspec
import pytest
from fake_openai_server import Script

from flint_sched.api.client import AsyncFlintClient, split_base_url
from flint_sched.api.client_stream import SSEDecoder, accumulate_chat
from flint_sched.api.client_types import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    FlintAPIError,
    FlintConnectionError,
    FlintResponseError,
    FlintTimeoutError,
    FunctionDelta,
    ToolCallDelta,
    parse_error,
)

WEATHER_ARGS = json.dumps({"city": "Beijing", "days": 3})
TIME_ARGS = json.dumps({"zone": "Asia/Shanghai", "note": "naïve \"quoted\""}, ensure_ascii=False)
AGENT_SCRIPT = Script(reasoning="Need two tools: weather and time.", content="Let me check.",
                      tool_calls=[("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])
MESSAGES = [{"role": "user", "content": "Weather and time in Beijing?"}]


def client_for(fake, **kwargs) -> AsyncFlintClient:
    kwargs = {"model": "flint", "backoff_base_s": 0.001, "backoff_max_s": 0.01, **kwargs}
    return AsyncFlintClient(fake.url, **kwargs)


async def test_chat_non_streaming_reasoning_and_parallel_tool_calls(fake):
    fake.script = AGENT_SCRIPT
    async with client_for(fake) as client:
        result = await client.chat(MESSAGES, tools=[{"type": "function", "function": {"name": "get_weather"}}],
                                   tool_choice="auto", max_tokens=64, chat_template_kwargs={"enable_thinking": True})
    body = fake.requests[-1]["body"]
    assert body["tool_choice"] == "auto" and body["max_tokens"] == 64 and body["model"] == "flint"
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and "stream" not in body
    (choice,) = result.choices
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert (message.role, message.content, message.reasoning) == ("assistant", "Let me check.", AGENT_SCRIPT.reasoning)
    assert [(c.id, c.type, c.function.name) for c in message.tool_calls] == [
        ("chatcmpl-tool-0", "function", "get_weather"), ("chatcmpl-tool-1", "function", "get_time")]
    assert json.loads(message.tool_calls[1].function.arguments)["note"] == 'naïve "quoted"'
    assert result.usage.completion_tokens > 0
    history = msgspec.to_builtins(message)
    assert history["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": WEATHER_ARGS}
    assert "reasoning_content" not in history


@pytest.mark.parametrize("n", [1, 2])
async def test_stream_accumulates_to_the_non_streaming_object(fake, n):
    fake.script = AGENT_SCRIPT
    async with client_for(fake) as client:
        expected = await client.chat(MESSAGES, n=n)
        stream = await client.chat(MESSAGES, n=n, stream=True)
        chunks = [chunk async for chunk in stream]
        collected = await (await client.chat(MESSAGES, n=n, stream=True)).collect()
    assert fake.requests[-1]["body"]["stream_options"] == {"include_usage": True}
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == expected.usage
    header = next(c for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert header.choices[0].delta.tool_calls[0].function.name == "get_weather"
    assert accumulate_chat(chunks) == expected
    assert collected == expected
    assert len(expected.choices) == n and expected.choices[-1].message.content.endswith(f"#{n - 1}" if n > 1 else ".")


async def test_completions_streamed_and_not_agree(fake):
    fake.script = Script(content=" one two three four", piece_chars=4)
    async with client_for(fake) as client:
        expected = await client.completions([1, 2, 3], max_tokens=4)
        collected = await (await client.completions([1, 2, 3], max_tokens=4, stream=True)).collect()
    assert fake.requests[-1]["body"]["prompt"] == [1, 2, 3]
    assert expected.choices[0].text == " one two three four"
    assert collected == expected


async def test_retries_503_and_429_then_succeeds(fake):
    fake.failures = [(503, {"error": {"message": "busy", "type": "service_unavailable"}}), (429, "slow down")]
    async with client_for(fake, max_retries=3) as client:
        result = await client.chat(MESSAGES)
    assert len(fake.requests) == 3 and result.choices[0].finish_reason == "stop"


async def test_retries_a_stream_before_it_starts(fake):
    fake.failures = [(503, {"error": {"message": "busy"}})]
    async with client_for(fake) as client:
        result = await (await client.chat(MESSAGES, stream=True, max_tokens=3)).collect()
    assert len(fake.requests) == 2 and result.choices[0].message.content == " tok tok tok"


async def test_gives_up_after_max_retries(fake):
    fake.failures = [(503, {"error": {"message": "busy", "type": "service_unavailable"}})] * 5
    async with client_for(fake, max_retries=2) as client:
        with pytest.raises(FlintAPIError) as info:
            await client.chat(MESSAGES)
    assert info.value.status == 503 and len(fake.requests) == 3


async def test_400_is_not_retried_and_parsed(fake):
    error = {"message": "tool_choice 'required' needs tools", "type": "BadRequestError", "param": "tool_choice",
             "code": 400}
    fake.failures = [(400, {"error": error})]
    async with client_for(fake, max_retries=3) as client:
        with pytest.raises(FlintAPIError) as info:
            await client.chat(MESSAGES, tool_choice="required")
    e = info.value
    assert len(fake.requests) == 1
    assert (e.status, e.type, e.message, e.param, e.code) == (400, "BadRequestError", error["message"],
                                                              "tool_choice", 400)


def test_parse_error_shapes():
    flat = parse_error(404, b'{"object": "error", "message": "no such model", "type": "NotFoundError", "code": 404}')
    assert (flat.status, flat.type, flat.message, flat.code) == (404, "NotFoundError", "no such model", 404)
    text = parse_error(502, b"Bad Gateway\n")
    assert (text.status, text.type, text.message) == (502, None, "Bad Gateway")
    assert parse_error(422, b'{"detail": "missing messages"}').message == "missing messages"


async def test_error_event_inside_a_stream_raises():
    def handler(request):
        body = (b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
                b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n')
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async with AsyncFlintClient(model="m", transport=httpx.MockTransport(handler)) as client:
        stream = await client.chat(MESSAGES, stream=True)
        with pytest.raises(FlintAPIError, match="engine died") as info:
            async for _ in stream:
                pass
    assert info.value.status == 500 and info.value.type == "InternalServerError"


async def test_a_body_that_is_not_the_api_json_raises():
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text="<html>proxy login</html>"))
    async with AsyncFlintClient(model="m", transport=transport) as client:
        with pytest.raises(FlintResponseError, match="proxy login"):
            await client.chat(MESSAGES)


async def test_retries_connection_errors_then_succeeds():
    attempts = []

    def handler(request):
        attempts.append(request)
        if len(attempts) < 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}}]})

    async with AsyncFlintClient(model="m", backoff_base_s=0.001, transport=httpx.MockTransport(handler)) as client:
        result = await client.chat(MESSAGES)
    assert len(attempts) == 3 and result.choices[0].message.content == "hi"


async def test_connection_refused_raises_after_retries():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with AsyncFlintClient(f"http://127.0.0.1:{port}", model="m", max_retries=1, backoff_base_s=0.001) as client:
        with pytest.raises(FlintConnectionError, match="after 2 attempts"):
            await client.chat(MESSAGES)
        assert await client.health() is False


async def test_read_timeout_raises_and_is_not_retried(fake):
    fake.response_delay_s = 2.0
    async with client_for(fake, timeout=0.2) as client:
        with pytest.raises(FlintTimeoutError):
            await client.chat(MESSAGES)
    assert len(fake.requests) == 1


async def test_breaking_out_of_a_stream_disconnects(fake):
    fake.endless_stream = True
    async with client_for(fake) as client:
        stream = await client.chat(MESSAGES, stream=True)
        async for chunk in stream:
            assert chunk.choices[0].delta.content == "x"
            break
        assert await asyncio.to_thread(fake.disconnected.wait, 5)


async def test_leaving_async_with_disconnects(fake):
    fake.endless_stream = True
    async with client_for(fake) as client:
        async with await client.chat(MESSAGES, stream=True) as stream:
            async for _ in stream:
                break
        assert stream.response.is_closed
        assert await asyncio.to_thread(fake.disconnected.wait, 5)


async def test_cancelling_the_task_disconnects(fake):
    fake.endless_stream = True
    first_chunk = asyncio.Event()

    async def consume(client):
        async for _ in await client.chat(MESSAGES, stream=True):
            first_chunk.set()

    async with client_for(fake) as client:
        task = asyncio.create_task(consume(client))
        await asyncio.wait_for(first_chunk.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(fake.disconnected.wait, 5)


async def test_api_key_header_models_and_health(fake):
    async with AsyncFlintClient(fake.url + "/v1/", api_key="sk-test") as client:
        assert await client.health() is True
        await client.chat(MESSAGES, max_tokens=1)
        await client.chat(MESSAGES, max_tokens=1)
        models = await client.models()
    assert [m.id for m in models] == ["flint-fake"]
    assert fake.requests[-2]["body"]["model"] == "flint-fake"  # resolved from /v1/models once, then remembered
    assert [r["path"] for r in fake.requests] == ["/v1/models"] + ["/v1/chat/completions"] * 2 + ["/v1/models"]
    assert all(r["headers"]["authorization"] == "Bearer sk-test" for r in fake.requests)


def test_backoff_grows_exponentially_with_jitter_and_honours_retry_after():
    client = AsyncFlintClient(backoff_base_s=0.5, backoff_max_s=3.0)
    for attempt, delay in enumerate([0.5, 1.0, 2.0, 3.0, 3.0]):
        assert all(delay <= client.backoff_s(attempt, None) <= 1.25 * delay for _ in range(50))
    assert client.backoff_s(0, 2.5) >= 2.5 and client.backoff_s(0, 100.0) <= 3.75


def test_split_base_url():
    assert split_base_url("http://h:8000") == ("http://h:8000", "http://h:8000/v1")
    assert split_base_url("http://h:8000/v1/") == ("http://h:8000", "http://h:8000/v1")
    with pytest.raises(ValueError):
        split_base_url("h:8000")


def test_sse_decoder():
    sse = SSEDecoder()
    lines = [": keep-alive", "event: message", "data: {\"a\":", "data:1}", "", "data: [DONE]\r\n", ""]
    assert [d for d in map(sse.feed, lines) if d is not None] == ['{"a":\n1}', "[DONE]"]
    assert sse.feed("data: tail") is None and sse.flush() == "tail" and sse.flush() is None


def test_tool_call_deltas_without_index_or_interleaved():
    def chunk(*deltas):
        return ChatCompletionChunk(id="c", choices=[ChatChunkChoice(delta=ChatDelta(tool_calls=list(deltas)))])

    chunks = [
        chunk(ToolCallDelta(id="a", type="function", function=FunctionDelta(name="f"))),
        chunk(ToolCallDelta(function=FunctionDelta(arguments='{"x": '))),
        chunk(ToolCallDelta(id="b", function=FunctionDelta(name="g", arguments="{}"))),
        chunk(ToolCallDelta(index=0, function=FunctionDelta(arguments="1}"))),
    ]
    calls = accumulate_chat(chunks).choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [("a", "f", '{"x": 1}'),
                                                                            ("b", "g", "{}")]
