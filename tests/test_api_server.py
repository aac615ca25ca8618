"""The HTTP server end to end: a `flint-sched serve` subprocess running flint-tiny on the CPU,
driven by the official openai package (and httpx for what the package hides)."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from api_server import error_of, shared_server, sse_events

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request, "real")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    assert values, f"{name} missing from /metrics"
    return sum(values)


def test_models_health_version(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == ["flint-tiny"]
    assert models[0].model_extra["max_model_len"] == 2048
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_chat_completion_counts_usage_like_tokenize(client, http):
    response = client.chat.completions.create(model="flint-tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == "flint-tiny" and isinstance(response.created, int)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls is None
    prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert response.usage.prompt_tokens == prompt["count"]
    assert 1 <= response.usage.completion_tokens <= 6
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    again = client.chat.completions.create(model="flint-tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    assert again.choices[0].message.model_extra["reasoning"] == choice.message.model_extra["reasoning"]


def test_chat_stream_with_usage_n_and_logprobs(client):
    stream = client.chat.completions.create(model="flint-tiny", messages=MESSAGES, max_tokens=5, n=2, seed=7,
                                            temperature=1.0, logprobs=True, top_logprobs=3, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.choices[0].index for c in chunks[:2]} == {0, 1}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens > 0
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason}
    assert set(finishes) == {0, 1}
    num_logprobs = sum(len(c.choices[0].logprobs.content) for c in chunks[:-1] if c.choices[0].logprobs)
    assert num_logprobs == usage.completion_tokens
    for c in chunks[:-1]:
        for token in (c.choices[0].logprobs.content if c.choices[0].logprobs else []):
            assert len(token.top_logprobs) == 3 and token.logprob <= 0


def test_stop_and_max_tokens(client):
    plain = client.completions.create(model="flint-tiny", prompt="Once upon", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = plain.choices[0].text
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 12
    stop = text[len(text) // 2:][:2]
    cut = client.completions.create(model="flint-tiny", prompt="Once upon", max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].model_extra["stop_reason"] == stop
    kept = client.completions.create(model="flint-tiny", prompt="Once upon", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]


def test_completions_prompts_echo_and_logprobs(client, http):
    ids = http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    batch = client.completions.create(model="flint-tiny", prompt=[ids, ids], max_tokens=3, n=2, logprobs=2,
                                      temperature=0)
    assert batch.id.startswith("cmpl-") and batch.object == "text_completion"
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == 2 * len(ids)
    for c in batch.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert lp.text_offset[0] == 0 and all(len(top) >= 2 for top in lp.top_logprobs)
    echoed = client.completions.create(model="flint-tiny", prompt="Hello there", max_tokens=2, echo=True)
    assert echoed.choices[0].text.startswith("Hello there")


def test_sixty_four_concurrent_streams_complete_well_formed(server):
    async def one(client: httpx.AsyncClient, i: int) -> list:
        body = {"model": "flint-tiny", "messages": [{"role": "user", "content": f"Count to {i}"}],
                "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        return sse_events(response.text)

    async def run():
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    for events in asyncio.run(run()):
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len({e["id"] for e in events}) == 1
        finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] in ("stop", "length")
        assert events[-1]["choices"] == [] and 1 <= events[-1]["usage"]["completion_tokens"] <= 4


LONG = 2000          # tokens: several seconds of flint-tiny on 2 cores, far more than an abort takes


def wait_until_idle(http) -> None:
    """Running back to 0 and blocks and slots freed, long before the LONG request could have ended."""
    deadline = time.monotonic() + 4
    while metric(http.get("/metrics").text, "flint:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the request kept running after the client left"
        time.sleep(0.02)
    text = http.get("/metrics").text
    assert metric(text, "flint:kv_cache_usage_perc") == 0 and metric(text, "flint:ring_slot_usage_perc") == 0


def test_disconnect_mid_stream_aborts_the_request(server, http):
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": LONG,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as c, c.stream("POST", "/v1/chat/completions",
                                                                              json=body) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]
        assert metric(http.get("/metrics").text, "flint:num_requests_running") == 1
    wait_until_idle(http)


def test_disconnect_while_waiting_for_a_full_response_aborts_too(server, http):
    body = {"prompt": "Tell a long story.", "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.5)
    wait_until_idle(http)


def test_metrics_after_traffic(client, http):
    client.chat.completions.create(model="flint-tiny", messages=MESSAGES, max_tokens=3)
    text = http.get("/metrics").text
    for name in ("flint:num_requests_waiting", "flint:num_preemptions_total", "flint:num_kv_blocks_total"):
        metric(text, name)
    for name in ("flint:prompt_tokens_total", "flint:generation_tokens_total", "flint:request_success_total",
                 "flint:time_to_first_token_seconds_count", "flint:inter_token_latency_seconds_count",
                 "flint:e2e_request_latency_seconds_count", "flint:request_queue_time_seconds_count"):
        assert metric(text, name) > 0, name
    info = [line for line in text.splitlines() if line.startswith("flint:cache_config_info{")]
    blocks = int(metric(text, "flint:num_kv_blocks_total"))
    assert len(info) == 1 and 'cache_dtype="auto"' in info[0] and f'num_gpu_blocks="{blocks}"' in info[0], info


def test_tokenize_detokenize_round_trip(http):
    text = "Flint says: héllo, 世界! <think>"
    tokens = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": True}).json()
    rendered = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered == "[gMASK]<sop><|system|>You are terse.<|user|>Say hi.<|assistant|><think>"


def test_continue_final_message_and_text_only_content(http):
    """vLLM's `continue_final_message` (with `add_generation_prompt: false`): the prompt ends in the
    last message's text, which the model goes on writing; both true is a 400, as is an image part
    (the model reads text only: refused, not dropped unseen)."""
    body = {"messages": MESSAGES + [{"role": "assistant", "content": "Hi there,"}], "add_generation_prompt": False,
            "continue_final_message": True}
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    rendered = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert rendered == "[gMASK]<sop><|system|>You are terse.<|user|>Say hi.<|assistant|></think>Hi there,"
    response = http.post("/v1/chat/completions", json={**body, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == len(tokens)
    both = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True, "max_tokens": 3})
    assert both.status_code == 400 and error_of(both)["param"] == "continue_final_message"
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    for route in ("/v1/chat/completions", "/tokenize"):
        refused = http.post(route, json={"messages": [{"role": "user", "content": image}], "max_tokens": 3})
        assert refused.status_code == 400 and "'image_url' parts are not supported" in error_of(refused)["message"]


def test_openapi_document_is_valid(http):
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.2")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
                 "/metrics", "/version"):
        assert path in doc["paths"], path
    schemas = doc["components"]["schemas"]

    def refs(node):
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    for ref in refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    events = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    data = events["itemSchema"]["properties"]["data"]["oneOf"]
    assert data[0]["contentSchema"] == {"$ref": "#/components/schemas/ChatCompletionChunk"}
    assert data[-1] == {"const": "[DONE]"}
    chat = schemas["ChatCompletionRequest"]
    assert "messages" in chat["required"] and chat["properties"]["messages"]["minItems"] == 1
    assert "tool_choice" in chat["properties"] and "top_k" in chat["properties"]


BAD_CHAT = [
    ("malformed json", b'{"messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("wrong type", {"messages": MESSAGES, "max_tokens": "many"}, 400, "max_tokens"),
    ("wrong message type", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 2}, 400, "messages"),
    ("too long", {"messages": MESSAGES, "max_tokens": 2048}, 400, None),
    ("bad temperature", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ("n zero", {"messages": MESSAGES, "n": 0}, 400, "n"),
    ("logit bias outside vocab", {"messages": MESSAGES, "logit_bias": {"999999": 5}, "max_tokens": 2}, 400, None),
    ("top_logprobs alone", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("unknown tool_choice", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                             "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("named tool missing", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("empty tools", {"messages": MESSAGES, "tools": []}, 400, "tools"),
    ("required without tools", {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
    ("stream options without stream", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("unknown model", {"model": "gpt-9", "messages": MESSAGES}, 400, "model"),
    ("json schema without a schema", {"messages": MESSAGES, "response_format": {"type": "json_schema",
                                                                              "json_schema": {"name": "x"}}},
     400, "response_format"),
    ("invalid json schema", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, 400, "response_format"),
    ("unsupported keyword when strict", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}}, 400, "response_format"),
    ("unknown response format", {"messages": MESSAGES, "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("invalid regex", {"messages": MESSAGES, "structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs"),
    ("invalid grammar", {"messages": MESSAGES, "guided_grammar": "start: nothing_defined"}, 400, "guided_grammar"),
    ("empty choice", {"messages": MESSAGES, "guided_choice": []}, 400, "guided_choice"),
    ("two constraints", {"messages": MESSAGES, "guided_regex": "a", "response_format": {"type": "json_object"}},
     400, "guided_regex"),
    ("prompt logprobs when streaming", {"messages": MESSAGES, "stream": True, "prompt_logprobs": 1}, 400,
     "prompt_logprobs"),
]


@pytest.mark.parametrize("case, body, status, param", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_input_is_a_clean_4xx(http, case, body, status, param):
    response = (http.post("/v1/chat/completions", content=body) if isinstance(body, bytes)
                else http.post("/v1/chat/completions", json=body))
    assert response.status_code == status, response.text
    error = error_of(response)
    if param is not None:
        assert error["param"] == param


def test_plain_text_response_format_is_served(http):
    body = {"messages": MESSAGES, "max_tokens": 2, "response_format": {"type": "text"}}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_bad_completions_input_and_routes(http):
    for body, param in (({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": []}, "prompt"),
                        ({"prompt": ["a", 1]}, "prompt"), ({"prompt": ""}, None),
                        ({"prompt": [5, 99999]}, None), ({"prompt": "x", "guided_json": {"type": 3}}, "guided_json"),
                        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs")):
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, (body, response.text)
        assert error_of(response)["param"] == param
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400
    assert error_of(http.get("/v1/nothing-here")) and http.get("/v1/nothing-here").status_code == 404
    assert http.get("/v1/chat/completions").status_code == 405
    assert http.get("/health").status_code == 200


def test_oversized_body_is_413(http):
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (33 << 20) + b'"}]}'
    response = http.post("/v1/chat/completions", content=big)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
    assert http.get("/health").status_code == 200


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="flint-tiny", messages=[], max_tokens=2)
    assert "messages" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="model `other` does not exist"):
        client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=2)
    assert json.loads(info.value.response.text)["error"]["type"] == "invalid_request_error"


def test_prefix_cache_shows_in_usage_metrics_and_resets(client, http):
    """A repeated prompt is served from the cache up to its last block boundary (blocks of 16):
    usage says so (streamed too), /metrics counts queries and hits, /reset_prefix_cache forgets."""
    system = f"Prefix test {time.time_ns()}: " + " ".join(f"word{i}" for i in range(60))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
    before = http.get("/metrics").text
    first = client.chat.completions.create(model="flint-tiny", messages=messages, max_tokens=2, temperature=0)
    num_prompt = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    expected = (num_prompt - 1) // 16 * 16
    stream = client.chat.completions.create(model="flint-tiny", messages=messages, max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens == num_prompt and usage.prompt_tokens_details.cached_tokens == expected
    after = http.get("/metrics").text
    hits = metric(after, "flint:prefix_cache_hits_total") - metric(before, "flint:prefix_cache_hits_total")
    queries = metric(after, "flint:prefix_cache_queries_total") - metric(before, "flint:prefix_cache_queries_total")
    assert hits == expected and queries == 2 * num_prompt
    text = system + " Complete this."
    cold = client.completions.create(model="flint-tiny", prompt=text, max_tokens=2, temperature=0)
    warm = client.completions.create(model="flint-tiny", prompt=text, max_tokens=2, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == (warm.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert warm.choices[0].text == cold.choices[0].text
    assert http.post("/reset_prefix_cache").status_code == 200
    again = client.chat.completions.create(model="flint-tiny", messages=messages, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_bench_serve_agent_reports_ttft_by_turn_and_the_hit_rate(server, capsys, tmp_path):
    """`bench serve --dataset-name agent` against flint-tiny: a session's turn t+1 is sent after its turn t,
    so it hits the cache of turn t's prompt; the table has TTFT by turn and /metrics' hit rate."""
    import argparse

    from flint_sched.benchmarks.serve import main
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(["--disable-tqdm", "--base-url", server.base_url, "--dataset-name", "agent",
                              "--num-prompts", "6", "--agent-num-turns", "3", "--agent-system-prompt-len", "40",
                              "--agent-tool-result-len", "20", "--agent-output-len", "3", "--max-concurrency", "2",
                              "--seed", str(time.time_ns() % 10_000), "--save-result", "--result-dir", str(tmp_path),
                              "--result-filename", "agent.json", "--no-plot"])
    assert main.run(args) == 0
    table = capsys.readouterr().out
    assert "Median TTFT turn 2 (ms), 2 req" in table and "Hit rate (/metrics, %)" in table
    result = json.loads((tmp_path / "agent.json").read_text())
    assert set(result["median_ttft_by_turn_ms"]) == {"0", "1", "2"} and result["median_ttft_later_turns_ms"] > 0
    assert result["total_cached_tokens"] > 0
    assert result["prefix_cache_hits"] >= result["total_cached_tokens"] > 0
    assert 0 < result["prefix_cache_hit_rate"] < 1
