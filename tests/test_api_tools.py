"""Tool calls, reasoning and auth through the whole server: a `flint-sched serve` subprocess whose
ScriptedExecutor replays tests/api_server.py's SCRIPTS, driven by the openai package and httpx."""

import json

import httpx
import openai
import pytest
from api_server import (
    API_KEY,
    SCRIPTED_BODY_LIMIT,
    SCRIPTED_MODEL,
    TIME_TOOL,
    WEATHER_TOOL,
    error_of,
    shared_server,
    sse_events,
)

TOOLS = [WEATHER_TOOL, TIME_TOOL]


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request, "scripted")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def chat(client, marker, stream=False, **kw):
    kw.setdefault("max_tokens", 256)
    return client.chat.completions.create(model=SCRIPTED_MODEL, stream=stream,
                                          messages=[{"role": "user", "content": f"{marker} please"}], **kw)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def collect_stream(chunks) -> dict:
    """Concatenate a chat stream the way a client does; checks the header/fragment discipline."""
    out = {"role": None, "content": "", "reasoning": "", "calls": {}, "finish": None, "ids": set()}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            out["role"] = out["role"] or delta.role
            out["content"] += delta.content or ""
            out["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"name": None, "arguments": ""})
                if call.id:
                    assert entry["name"] is None and call.id.startswith("chatcmpl-tool-")
                    out["ids"].add(call.id)
                    entry["name"] = call.function.name
                entry["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(out["calls"].items())]
    return out


def test_tool_call_with_reasoning_full_and_streamed(client):
    full = chat(client, "WEATHER_ONE", tools=TOOLS)
    message = full.choices[0].message
    assert message.model_extra["reasoning"] == "Need the tool."
    assert message.content == "Let me check."
    assert calls_of(message) == [("get_weather", {"city": "Beijing", "days": 3})]
    assert message.tool_calls[0].id.startswith("chatcmpl-tool-") and full.choices[0].finish_reason == "tool_calls"
    streamed = collect_stream(chat(client, "WEATHER_ONE", stream=True, tools=TOOLS))
    assert streamed["role"] == "assistant" and streamed["finish"] == "tool_calls"
    assert (streamed["reasoning"], streamed["content"]) == ("Need the tool.", "Let me check.")
    assert streamed["calls"] == [("get_weather", {"city": "Beijing", "days": 3})]


def test_parallel_calls_drop_the_unknown_tool(client):
    expected = [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Paris", "days": 2})]
    full = chat(client, "WEATHER_MANY", tools=TOOLS)
    assert calls_of(full.choices[0].message) == expected and full.choices[0].message.content is None
    streamed = collect_stream(chat(client, "WEATHER_MANY", stream=True, tools=TOOLS))
    assert streamed["calls"] == expected and len(streamed["ids"]) == 2
    single = chat(client, "WEATHER_MANY", tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(single.choices[0].message) == expected[:1]


def test_named_tool_choice_is_forced_and_finishes_with_stop(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = chat(client, "FORCED_NAMED", tools=TOOLS, tool_choice=named)
    assert calls_of(full.choices[0].message) == [("get_weather", {"city": "Oslo"})]
    assert full.choices[0].finish_reason == "stop" and full.choices[0].message.model_extra["reasoning"] is None
    streamed = collect_stream(chat(client, "FORCED_NAMED", stream=True, tools=TOOLS, tool_choice=named))
    assert streamed["calls"] == [("get_weather", {"city": "Oslo"})] and streamed["finish"] == "stop"


def test_required_tool_choice_is_forced(client):
    full = chat(client, "FORCED_REQUIRED", tools=TOOLS, tool_choice="required")
    assert calls_of(full.choices[0].message) == [("get_time", {"zone": "UTC"})]
    assert full.choices[0].finish_reason == "tool_calls"
    streamed = collect_stream(chat(client, "FORCED_REQUIRED", stream=True, tools=TOOLS, tool_choice="required"))
    assert streamed["calls"] == [("get_time", {"zone": "UTC"})] and streamed["finish"] == "tool_calls"


def test_tool_choice_none_returns_text_and_leaves_tools_out_of_the_prompt(client, http):
    full = chat(client, "WEATHER_ONE", tools=TOOLS, tool_choice="none")
    assert full.choices[0].message.tool_calls is None and "<tool_call>" in full.choices[0].message.content
    messages = [{"role": "user", "content": "WEATHER_ONE please"}]
    without_tools = http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert full.usage.prompt_tokens == without_tools
    auto = chat(client, "WEATHER_ONE", tools=TOOLS)
    with_tools = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["count"]
    assert auto.usage.prompt_tokens == with_tools > without_tools


def test_reasoning_on_off_and_hidden(client):
    thinking = chat(client, "THINK_ONLY").choices[0].message
    assert (thinking.model_extra["reasoning"], thinking.content) == ("Just thinking more", None)
    off = chat(client, "PLAIN_ANSWER", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (off.choices[0].message.model_extra["reasoning"], off.choices[0].message.content) == (None, "Plain answer.")
    hidden = chat(client, "WEATHER_ONE", tools=TOOLS, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.model_extra["reasoning"] is None and hidden.content == "Let me check."
    streamed = collect_stream(chat(client, "WEATHER_ONE", stream=True, tools=TOOLS,
                                   extra_body={"include_reasoning": False}))
    assert streamed["reasoning"] == "" and streamed["content"] == "Let me check."


def test_stop_strings_n_and_logprobs(client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    stopped = chat(client, "STOP_STRINGS", stop=["STOP"], n=2, logprobs=True, top_logprobs=2, extra_body=off)
    assert [c.message.content for c in stopped.choices] == ["alpha beta ", "alpha beta "]
    assert {c.finish_reason for c in stopped.choices} == {"stop"}
    assert stopped.choices[0].model_extra["stop_reason"] == "STOP"
    tokens = stopped.choices[0].logprobs.content
    assert all(t.logprob == -0.25 and len(t.top_logprobs) == 2 for t in tokens)
    assert "".join(t.token for t in tokens).startswith("alpha beta ")
    completion = client.completions.create(model=SCRIPTED_MODEL, prompt="STOP_STRINGS", stop="STOP", max_tokens=20)
    assert completion.choices[0].text == "alpha beta " and completion.choices[0].finish_reason == "stop"


def test_usage_chunk_and_raw_stream_shape(server):
    body = {"messages": [{"role": "user", "content": "WEATHER_ONE"}], "tools": TOOLS, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 64}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 10
    header = next(d for e in events[1:-1] for d in e["choices"][0]["delta"].get("tool_calls", []) if "id" in d)
    assert header == {"index": 0, "id": header["id"], "type": "function", "function": {"name": "get_weather"}}


def test_api_key_guards_v1_only(server, http):
    base = server.base_url
    assert http.get("/v1/models").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
            response = httpx.request(method, base + path, headers=headers, json={})
            assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.post(base + "/tokenize", json={"prompt": "hi"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()


def test_body_limit_is_configurable(http):
    body = {"messages": [{"role": "user", "content": "x" * SCRIPTED_BODY_LIMIT}]}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 413 and error_of(response)["type"] == "invalid_request_error"
