"""AsyncFlintClient against real `flint-sched serve` subprocesses: flint-tiny and the scripted model."""

import asyncio

import pytest

from api_server import API_KEY, SCRIPTED_MODEL, WEATHER_TOOL, shared_server
from flint_sched.api.client import AsyncFlintClient, FlintAPIError


async def test_chat_completions_and_streams_on_flint_tiny(request):
    server = shared_server(request, "real")
    async with AsyncFlintClient(server.base_url) as client:
        assert await client.health()
        messages = [{"role": "user", "content": "Hello"}]
        reply = await client.chat(messages, max_tokens=5, temperature=0, ignore_eos=True)
        streamed = await (await client.chat(messages, max_tokens=5, temperature=0, ignore_eos=True,
                                            stream=True)).collect()
        assert reply.choices[0].finish_reason == streamed.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == streamed.usage.completion_tokens == 5
        assert (reply.choices[0].message.content or "") == (streamed.choices[0].message.content or "")
        text = await client.completions("Once upon", max_tokens=3, temperature=0, ignore_eos=True)
        assert text.usage.completion_tokens == 3
        ids = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        for result in (await client.chat(messages, **ids),
                       await (await client.chat(messages, stream=True, **ids)).collect()):
            assert len(result.prompt_token_ids) == result.usage.prompt_tokens and len(result.choices[0].token_ids) == 3
        for result in (await client.completions("Once upon", **ids),
                       await (await client.completions("Once upon", stream=True, **ids)).collect()):
            assert len(result.choices[0].prompt_token_ids) == result.usage.prompt_tokens
            assert len(result.choices[0].token_ids) == 3
        assert reply.choices[0].token_ids is None and text.choices[0].token_ids is None
        results = await asyncio.gather(*(client.chat(messages, max_tokens=3, ignore_eos=True) for _ in range(8)))
        assert all(r.usage.completion_tokens == 3 for r in results)
        with pytest.raises(FlintAPIError) as err:
            await client.chat([], max_tokens=3)
        assert err.value.status == 400


async def test_tool_calls_and_reasoning_through_the_client(request):
    server = shared_server(request, "scripted")
    async with AsyncFlintClient(server.base_url, api_key=API_KEY, model=SCRIPTED_MODEL) as client:
        messages = [{"role": "user", "content": "WEATHER_ONE please"}]
        reply = await client.chat(messages, tools=[WEATHER_TOOL], max_tokens=64)
        streamed = await (await client.chat(messages, tools=[WEATHER_TOOL], max_tokens=64, stream=True)).collect()
        for result in (reply, streamed):
            choice = result.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.reasoning == "Need the tool."
            assert choice.message.content == "Let me check."
            [call] = choice.message.tool_calls
            assert call.function.name == "get_weather"
            assert call.function.arguments == '{"city": "Beijing", "days": 3}'
    async with AsyncFlintClient(server.base_url, api_key="wrong", model=SCRIPTED_MODEL) as client:
        with pytest.raises(FlintAPIError) as err:
            await client.chat(messages, max_tokens=4)
        assert err.value.status == 401
