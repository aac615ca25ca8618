"""The server's parts alone: tool_choice policy and forcing, streaming helpers, the scripted executor,
configuration, and the app in-process through httpx.ASGITransport (no subprocess)."""

import asyncio
import json

import httpx
import msgspec
import pytest

from flint_sched.api.errors import invalid_json
from flint_sched.api.parsers import OutputDelta
from flint_sched.api.protocol_chat import ChatCompletionRequest
from flint_sched.api.scripted_executor import ScriptedExecutor
from flint_sched.api.server import EngineState, ServerConfig, build_app, resolve_chat_template
from flint_sched.api.serving_chat import delta_message, merge_deltas
from flint_sched.api.streaming import DisconnectWatcher, merge_streams, sse_event, until_disconnect
from flint_sched.api.tool_choice import ToolFlags, ends_in_reasoning, force_call, tool_policy
from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.cli import main
from flint_sched.core.plan import ScheduledRequest, StepPlan
from flint_sched.engine import EngineConfig
from flint_sched.engine.builder import build_parts
from flint_sched.sampling_params import SamplingParams

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
FLAGS = ToolFlags(enable_auto_tool_choice=True, tool_call_parser="glm47")
USER = [{"role": "user", "content": "hi"}]


def chat_request(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": USER, **fields}, ChatCompletionRequest)


def test_tool_policy_defaults_and_validation():
    assert tool_policy(chat_request(), FLAGS).mode == "none"
    assert tool_policy(chat_request(tools=[WEATHER]), FLAGS).mode == "auto"
    with pytest.raises(Exception, match="--enable-auto-tool-choice"):
        tool_policy(chat_request(tools=[WEATHER]), ToolFlags())
    excluding = ToolFlags(exclude_tools_when_tool_choice_none=True)
    none = tool_policy(chat_request(tools=[WEATHER], tool_choice="none"), excluding)
    assert none.template_tools is None and none.parser_tools is None
    kept = tool_policy(chat_request(tools=[WEATHER], tool_choice="none"), ToolFlags())
    assert kept.template_tools == [WEATHER] and kept.parser_tools is None
    for bad in ({"tools": []}, {"tool_choice": "auto"}, {"tools": [WEATHER], "tool_choice": "always"},
                {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}):
        with pytest.raises(Exception) as info:
            tool_policy(chat_request(**bad), FLAGS)
        assert info.value.status == 400 and info.value.param in ("tools", "tool_choice")


def test_forced_call_starts():
    thinking, not_thinking = "[gMASK]<sop><|user|>hi<|assistant|><think>", "<|user|>hi<|assistant|></think>"
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = tool_policy(chat_request(tools=[WEATHER, CLOCK], tool_choice=choice), ToolFlags())
    assert force_call(named, thinking) == ("</think><tool_call>get_weather<arg_key>", "<tool_call>get_weather<arg_key>")
    assert force_call(named, not_thinking) == ("<tool_call>get_weather<arg_key>",) * 2
    assert named.parser_tools == [WEATHER] and not named.parallel_tool_calls
    required = tool_policy(chat_request(tools=[WEATHER, CLOCK], tool_choice="required"), ToolFlags())
    assert force_call(required, thinking) == ("</think><tool_call>", "<tool_call>")
    only_clock = tool_policy(chat_request(tools=[CLOCK], tool_choice="required"), ToolFlags())
    assert force_call(only_clock, thinking)[1] == "<tool_call>now"
    auto = tool_policy(chat_request(tools=[WEATHER]), FLAGS)
    assert force_call(auto, thinking) == ("", "")
    assert auto.finish_reason("stop", True) == "tool_calls" and auto.finish_reason("length", True) == "length"
    assert named.finish_reason("stop", True) == "stop" and required.finish_reason("stop", True) == "tool_calls"


def test_reasoning_state_from_the_prompt():
    assert ends_in_reasoning("<|user|>a<|assistant|><think>")
    assert not ends_in_reasoning("<|user|>a<|assistant|></think>")
    assert not ends_in_reasoning("<|assistant|><think>x</think>y<|user|>a<|assistant|></think>")
    assert not ends_in_reasoning("plain text")


def test_delta_message_leaves_out_empty_parts():
    delta = delta_message(merge_deltas(OutputDelta("r", ""), OutputDelta("", "c", [{"index": 0, "function":
                                                                                       {"arguments": "{"}}])), True)
    assert msgspec.json.decode(msgspec.json.encode(delta)) == {
        "content": "c", "reasoning": "r", "tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    assert msgspec.json.encode(delta_message(OutputDelta("r", ""), False)) == b"{}"


def test_invalid_json_names_the_field():
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(b'{"messages": [], "n": "2"}', type=ChatCompletionRequest)
    assert invalid_json(info.value).param in ("messages", "n")
    assert invalid_json(msgspec.DecodeError("truncated")).param is None


def test_sse_event_framing():
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'


async def test_merge_streams_interleaves_and_reraises():
    async def numbers(name, count, delay):
        for i in range(count):
            await asyncio.sleep(delay)
            yield f"{name}{i}"

    got = [item async for item in merge_streams([numbers("a", 3, 0.001), numbers("b", 2, 0.0015)])]
    assert sorted(got) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]

    async def failing():
        yield "x"
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        [item async for item in merge_streams([failing()])]


async def test_until_disconnect_cancels_the_pending_read():
    closed = asyncio.Event()
    disconnect = asyncio.Event()

    async def endless():
        try:
            while True:
                await asyncio.sleep(0.001)
                yield 1
        finally:
            closed.set()

    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    watcher = DisconnectWatcher(receive)
    count = 0
    async for _ in until_disconnect(endless(), watcher):
        count += 1
        if count == 5:
            disconnect.set()
    assert count >= 5 and closed.is_set() and watcher.disconnected


async def test_until_disconnect_ends_a_read_blocked_when_the_client_goes():
    """The read pending on a request that makes no progress is cancelled by the disconnect (the
    engine stream's cleanup runs), and the events end without an error."""
    closed, first_read, disconnect = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def stalled():
        try:
            yield "first"
            first_read.set()
            await asyncio.Event().wait()
            yield "never"
        finally:
            closed.set()

    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def consume():
        return [item async for item in until_disconnect(stalled(), DisconnectWatcher(receive))]

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(first_read.wait(), 5)
    disconnect.set()
    assert await asyncio.wait_for(task, 5) == ["first"]
    assert closed.is_set()


async def test_merge_streams_of_one_stream_closes_it_when_left_early():
    closed = asyncio.Event()

    async def endless():
        try:
            while True:
                yield "x"
        finally:
            closed.set()

    merged = merge_streams([endless()])
    assert [await anext(merged), await anext(merged)] == [(0, "x"), (0, "x")]
    await merged.aclose()
    assert closed.is_set()


class _Tokenizer:
    eos_token_ids = (99,)

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_scripted_executor_follows_the_longest_key():
    executor = ScriptedExecutor({"": ["z"], "ab": ["x", 7], "abc": ["y"]}, _Tokenizer())
    params = SamplingParams(logprobs=2)

    def step(request_id, prompt, produced):
        entry = ScheduledRequest(request_id, [1], 0, [], 0, True, params, [ord(c) for c in prompt], produced, False)
        return executor.execute(StepPlan([entry], 1, "fused", [], []))

    assert step("r1", "xxabxx", []).sampled_token_ids == {"r1": [ord("x")]}
    assert step("r1", "xxabxx", [1]).sampled_token_ids == {"r1": [7]}
    assert step("r1", "xxabxx", [1, 7]).sampled_token_ids == {"r1": [99]}
    result = step("r2", "abc", [])
    assert result.sampled_token_ids == {"r2": [ord("y")]} and len(result.logprobs["r2"][0].top) == 2
    assert step("r3", "q", []).sampled_token_ids == {"r3": [ord("z")]}


def test_server_config_and_chat_template_flag(tmp_path):
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ServerConfig(reasoning_parser="deepseek")
    assert ServerConfig().max_request_body_bytes == 32 << 20
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}!")
    assert resolve_chat_template(str(template)) == "{{ messages[0].content }}!"
    assert resolve_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ValueError, match="no such file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("argv, message", [
    (["serve", "--enable-auto-tool-choice"], "--tool-call-parser"),
    (["serve", "--shutdown-timeout", "-1"], "shutdown timeout must be >= 0"),
    (["serve", "--engine-iteration-timeout-s", "-1"], "--engine-iteration-timeout-s must be >= 0"),
    (["serve", "--chat-template", "/nonexistent/template.jinja"], "no such file"),
])
def test_serve_refuses_bad_flags(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_serve_rejects_non_object_template_kwargs(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--default-chat-template-kwargs", "[1]"])
    assert "JSON object" in capsys.readouterr().err


@pytest.fixture(scope="module")
def parts(tiny_config):
    ckpt = dummy_checkpoint(tiny_config, "bf16", seed=3, device="cpu")
    return build_parts(EngineConfig(device="cpu", max_num_seqs=8, num_kv_blocks=256, max_model_len=256),
                       progress=False, checkpoint=ckpt)


async def run_app(parts, config: ServerConfig, requests):
    state = EngineState(parts, "dummy")
    app = build_app(state, config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await requests(client, state)


async def test_app_in_process_template_overrides_and_engine_death(parts):
    config = ServerConfig(chat_template="{% for m in messages %}<|user|>{{ m.content }}{% endfor %}<|assistant|>",
                          default_chat_template_kwargs={"enable_thinking": False})

    async def requests(client, state):
        tokens = (await client.post("/tokenize", json={"messages": USER})).json()["tokens"]
        rendered = (await client.post("/detokenize", json={"tokens": tokens})).json()["prompt"]
        assert rendered == "<|user|>hi<|assistant|>"
        body = {"messages": USER, "max_tokens": 3, "tools": [WEATHER]}
        refused = await client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400 and "--enable-auto-tool-choice" in refused.json()["error"]["message"]
        ok = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["reasoning"] is None
        assert (await client.get("/health")).status_code == 200

        def broken_update(plan, result):
            raise RuntimeError("scheduler bug")

        state.engine.scheduler.update = broken_update
        failed = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3})
        assert failed.status_code >= 500 and failed.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 503
        after = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3})
        assert after.status_code == 503 and after.json()["error"]["type"] == "service_unavailable"

    await run_app(parts, config, requests)


async def test_a_requests_own_chat_template_needs_the_servers_trust(parts):
    own = {"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[go]"}

    async def refused(client, state):
        for route, body in (("/tokenize", {"messages": USER, **own}),
                            ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, **own})):
            response = await client.post(route, json=body)
            assert response.status_code == 400, route
            error = response.json()["error"]
            assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]

    async def rendered(client, state):
        tokens = (await client.post("/tokenize", json={"messages": USER, **own})).json()["tokens"]
        assert (await client.post("/detokenize", json={"tokens": tokens})).json()["prompt"] == "[user]hi[go]"
        reply = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **own})
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(tokens)
        broken = await client.post("/tokenize", json={"messages": USER, "chat_template": "{% for m in messages %}"})
        assert broken.status_code == 400 and "chat template failed" in broken.json()["error"]["message"]
        default = (await client.post("/tokenize", json={"messages": USER})).json()["tokens"]
        assert default != tokens

    await run_app(parts, ServerConfig(), refused)
    await run_app(parts, ServerConfig(trust_request_chat_template=True), rendered)


async def test_app_in_process_thinking_default_and_openapi(parts):
    async def requests(client, state):
        tokens = (await client.post("/tokenize", json={"messages": USER})).json()["tokens"]
        rendered = (await client.post("/detokenize", json={"tokens": tokens})).json()["prompt"]
        assert rendered.endswith("<|assistant|><think>")
        doc = json.loads((await client.get("/openapi.json")).content)
        assert "ChatCompletionChunk" in doc["components"]["schemas"]
        metrics = (await client.get("/metrics")).text
        assert 'flint:num_requests_running{model_name="flint-tiny"} 0.0' in metrics

    await run_app(parts, ServerConfig(), requests)


def test_stream_metrics_match_prometheus_clients_own():
    """The lock-free histograms and counters (api/metrics.py StreamCollector) expose the same samples
    as prometheus_client's Histogram and Counter fed the same values, bounds included (le: <=)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from flint_sched.api.metrics import PREFIX, TOKEN_GAP_BUCKETS_S, ServerMetrics

    values = [0.0, 0.001, 0.0010001, 0.004, 0.005, 0.3, 20.0, 20.5, 1e9, 0.075]
    ours = ServerMetrics("m", lambda: None)
    theirs = CollectorRegistry()
    ref = Histogram(PREFIX + "inter_token_latency_seconds", "x", labelnames=["model_name"],
                    buckets=TOKEN_GAP_BUCKETS_S, registry=theirs).labels("m")
    tokens = Counter(PREFIX + "generation_tokens", "x", labelnames=["model_name"], registry=theirs).labels("m")
    for v in values:
        ours.inter_token_latency.observe(v)
        ref.observe(v)
    ours.streams.generation_tokens += 12
    tokens.inc(12)

    def samples(text: bytes, family: str) -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text.decode()) if f.name == family
                for s in f.samples if not s.name.endswith("_created")}

    for family in (PREFIX + "inter_token_latency_seconds", PREFIX + "generation_tokens"):
        expected = samples(generate_latest(theirs), family)
        assert expected and samples(ours.exposition(), family) == expected, family


def test_kept_prompt_tokens_reads_truncate_prompt_tokens_as_vllm_does():
    from flint_sched.api.errors import APIError
    from flint_sched.api.limits import kept_prompt_tokens
    assert kept_prompt_tokens(None, 2048) is None and kept_prompt_tokens(-1, 2048) == 2048
    assert kept_prompt_tokens(1, 2048) == 1 and kept_prompt_tokens(2048, 2048) == 2048
    for k in (0, -2, 2049):
        with pytest.raises(APIError, match="truncate_prompt_tokens"):
            kept_prompt_tokens(k, 2048)
