"""Structured outputs and prompt logprobs through the HTTP server (flint-tiny on the CPU, random
weights: only the grammar keeps the output valid), with the openai package as vLLM users call it."""

import json
import re

import jsonschema
import openai
import pytest
from api_server import shared_server

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris", "New York"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "unit": {"type": "string", "pattern": "^(C|F)$"},
                   "hourly": {"type": "boolean"}}}}}
BOOKING = {"type": "function", "function": {"name": "book_table", "parameters": {
    "type": "object", "required": ["guests", "when"],
    "properties": {"note": {"type": "string", "maxLength": 8},
                   "guests": {"type": "integer", "minimum": 1, "maximum": 12},
                   "when": {"type": "object", "additionalProperties": False, "required": ["day", "hour"],
                            "properties": {"day": {"enum": ["mon", "tue", "wed"]},
                                           "hour": {"type": "integer", "minimum": 0, "maximum": 23}}},
                   "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "enum": ["quiet", "view"]}}}}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, BOOKING, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request, "real")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, **kw):
    kw = {"temperature": 1.0, "max_tokens": 120, **kw}
    return client.chat.completions.create(model="flint-tiny", messages=[{"role": "user", "content": "Go."}], **kw)


@pytest.mark.parametrize("strict", [True, False])
def test_response_format_json_schema_always_validates(client, strict):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}
    response = ask(client, n=12, response_format=fmt, extra_body=NO_THINKING)
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_a_streamed_json_schema_answer_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = ask(client, stream=True, response_format=fmt, extra_body=NO_THINKING)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_completions_take_every_spelling_of_a_constraint(client):
    def complete(**extra):
        return client.completions.create(model="flint-tiny", prompt="Answer:", max_tokens=120, temperature=1.0,
                                         n=6, extra_body=extra).choices
    assert all(c.text in ("red", "green") for c in complete(structured_outputs={"choice": ["red", "green"]}))
    assert all(c.text in ("up", "down") for c in complete(guided_choice=["up", "down"]))
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", c.text) for c in complete(guided_regex="[0-9]{3}-[a-z]{2}"))
    for choice in complete(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}}):
        jsonschema.validate(json.loads(choice.text), PERSON)
    for choice in complete(guided_json=PERSON):
        jsonschema.validate(json.loads(choice.text), PERSON)
    grammar = 'root ::= "yes" | "no"'
    assert all(c.text in ("yes", "no") for c in complete(structured_outputs={"grammar": grammar}))


def calls_of(choice) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls or []]


@pytest.mark.slow
def test_required_tool_calls_always_parse_and_validate(client):
    response = ask(client, n=8, tools=TOOLS, tool_choice="required", max_tokens=200)
    for choice in response.choices:
        calls = calls_of(choice)
        assert calls and choice.finish_reason == "tool_calls", choice
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
    single = ask(client, n=6, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert all(len(calls_of(choice)) == 1 for choice in single.choices)


@pytest.mark.slow
@pytest.mark.parametrize("tool", [WEATHER, BOOKING, CLOCK], ids=lambda t: t["function"]["name"])
def test_a_named_tool_call_always_parses_and_validates(client, tool):
    name = tool["function"]["name"]
    response = ask(client, n=6, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
                   max_tokens=200)
    for choice in response.choices:
        (called, arguments), = calls_of(choice)
        assert called == name and choice.finish_reason == "stop"
        jsonschema.validate(arguments, SCHEMAS[name])


def test_prompt_logprobs_shape_like_vllm(client, server):
    import httpx
    body = {"model": "flint-tiny", "prompt": "one two three", "max_tokens": 2, "prompt_logprobs": 2}
    completion = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "one two three"}).json()["tokens"]
    prompt_logprobs = completion["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, entry in zip(ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token_id))
        assert ranks == [1, 2] and all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str)
                                       for v in entry.values())
    chat = ask(client, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


def test_echo_with_logprobs_scores_the_prompt(client):
    prompt = "the cat sat on the mat"
    choice = client.completions.create(model="flint-tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2,
                                       temperature=0.0).choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and len(lp.tokens) == len(lp.token_logprobs)
    scored = client.completions.create(model="flint-tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=0,
                                       temperature=0.0).choices[0].logprobs
    assert scored.token_logprobs[:-1] == lp.token_logprobs[:len(scored.token_logprobs) - 1]


def test_echo_with_max_tokens_zero_returns_the_prompt_scored(client):
    prompt = "the cat sat on the mat"
    scored = client.completions.create(model="flint-tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0.0)
    [choice] = scored.choices
    lp = choice.logprobs
    assert choice.text == prompt and "".join(lp.tokens) == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(lp.tokens)
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    generated = client.completions.create(model="flint-tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                          temperature=0.0).choices[0].logprobs
    assert generated.tokens[:-1] == lp.tokens and generated.token_logprobs[:-1] == lp.token_logprobs
    plain = client.completions.create(model="flint-tiny", prompt=[prompt, "a dog"], max_tokens=0, echo=True, n=2)
    assert [c.text for c in sorted(plain.choices, key=lambda c: c.index)] == [prompt, prompt, "a dog", "a dog"]
    assert all(c.logprobs is None and c.finish_reason == "length" for c in plain.choices)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="flint-tiny", prompt=prompt, max_tokens=0)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_streamed_echo_with_max_tokens_zero_is_the_prompt_alone(client, logprobs):
    prompt = "the cat sat"
    full = client.completions.create(model="flint-tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=logprobs,
                                     n=2).choices[0]
    chunks = list(client.completions.create(model="flint-tiny", prompt=prompt, max_tokens=0, echo=True,
                                            logprobs=logprobs, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine) == prompt
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.tokens]
        assert tokens == (full.logprobs.tokens if logprobs else [])
    assert chunks[-1].usage.completion_tokens == 0


def test_a_streamed_echo_with_logprobs_matches_the_full_answer(client):
    prompt = "the cat sat"
    full = client.completions.create(model="flint-tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=1,
                                     temperature=0.0, n=2).choices[0]
    chunks = list(client.completions.create(model="flint-tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=1,
                                            temperature=0.0, n=2, stream=True))
    mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == 0]
    assert mine[0].text == prompt and mine[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in mine) == full.text
    assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == full.logprobs.tokens
    assert [o for c in mine if c.logprobs for o in c.logprobs.text_offset] == full.logprobs.text_offset
