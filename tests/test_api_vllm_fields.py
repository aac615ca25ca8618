"""vLLM's extra request fields on chat and completions through a live flint-tiny server (the same
session server as test_api_server.py): allowed_token_ids and bad_words, truncate_prompt_tokens,
return_tokens_as_token_ids, continuous usage stats, return_token_ids, cache_salt, request ids, the fields
refused rather than ignored, and SageMaker's /invocations."""

import asyncio

import httpx
import pytest
from api_server import error_of, shared_server, sse_events

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request, "real")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def test_allowed_token_ids_and_bad_words_fields(http):
    """vLLM's extra fields: allowed_token_ids (here one token, so the text is that token's repeated),
    bad_words; an empty allowed list or a blank word is a 400 naming the field."""
    [a] = http.post("/tokenize", json={"prompt": "a"}).json()["tokens"]
    for route, body in (("/v1/completions", {"prompt": "Once upon"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        ask = {**body, "max_tokens": 4, "ignore_eos": True}
        only = http.post(route, json={**ask, "allowed_token_ids": [a]}).json()["choices"][0]
        message = only.get("message", {})
        assert only.get("text", message.get("reasoning") or message.get("content")) == "aaaa"
        assert http.post(route, json={**ask, "bad_words": ["upon", "the"]}).status_code == 200
        for field, value in (("allowed_token_ids", []), ("bad_words", [" "])):
            refused = http.post(route, json={**ask, field: value})
            assert refused.status_code == 400 and error_of(refused)["param"] == field


def test_truncate_prompt_tokens_keeps_the_prompts_end_and_ping_answers(http):
    """vLLM's truncate_prompt_tokens: the last k tokens of a token, text or chat prompt (a text past
    the context is then served, not refused unread); out of range is a 400. /ping: /health's alias."""
    ids = list(range(100, 160))
    ask = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    cut = http.post("/v1/completions", json={**ask, "prompt": ids, "truncate_prompt_tokens": 10}).json()
    alone = http.post("/v1/completions", json={**ask, "prompt": ids[-10:]}).json()
    assert cut["usage"]["prompt_tokens"] == 10 and cut["choices"][0]["text"] == alone["choices"][0]["text"]
    long_text = "word " * 6000                      # past the 2,048-token context
    assert http.post("/v1/completions", json={**ask, "prompt": long_text}).status_code == 400
    kept = http.post("/v1/completions", json={**ask, "prompt": long_text, "truncate_prompt_tokens": 2000}).json()
    assert kept["usage"]["prompt_tokens"] == 2000
    chat = http.post("/v1/chat/completions", json={**ask, "messages": MESSAGES, "truncate_prompt_tokens": 5}).json()
    assert chat["usage"]["prompt_tokens"] == 5
    for k in (0, -2, 4096):
        refused = http.post("/v1/completions", json={**ask, "prompt": ids, "truncate_prompt_tokens": k})
        assert refused.status_code == 400 and error_of(refused)["param"] == "truncate_prompt_tokens"
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(http):
    """vLLM's return_tokens_as_token_ids: every token of the logprobs (the echoed prompt's, the
    output's, the alternatives) as "token_id:N", chat and completions, streamed or not."""
    ids = list(range(100, 111))
    ask = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True}
    done = http.post("/v1/completions", json={**ask, "prompt": ids, "echo": True, "logprobs": 2}).json()
    logprobs = done["choices"][0]["logprobs"]
    assert logprobs["tokens"][:len(ids)] == [f"token_id:{i}" for i in ids] and len(logprobs["tokens"]) == len(ids) + 3
    named = lambda token: token.startswith("token_id:") and token[9:].isdigit()  # noqa: E731
    assert all(map(named, logprobs["tokens"])) and all(named(t) for top in logprobs["top_logprobs"][1:] for t in top)
    chat = http.post("/v1/chat/completions", json={**ask, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2})
    for entry in chat.json()["choices"][0]["logprobs"]["content"]:
        assert named(entry["token"]) and entry["bytes"] == list(entry["token"].encode())
        assert all(named(top["token"]) for top in entry["top_logprobs"])
    streamed = http.post("/v1/chat/completions", json={**ask, "messages": MESSAGES, "logprobs": True, "stream": True})
    tokens = [e["token"] for event in sse_events(streamed.text) for c in event.get("choices", [])
              for e in (c.get("logprobs") or {}).get("content") or []]
    assert len(tokens) == 3 and all(map(named, tokens))


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(http):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk carries its
    choice's usage so far; the last chunk's totals; without include_usage nothing changes."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    ask = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": options}
    for route, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Once"})):
        events = sse_events(http.post(route, json={**ask, **body}).text)
        assert events and all("usage" in event for event in events), route
        counts = [event["usage"]["completion_tokens"] for event in events if event["choices"]]
        assert counts == sorted(counts) and counts[-1] == 4 and events[-1]["usage"]["completion_tokens"] == 4
        prompt = {event["usage"]["prompt_tokens"] for event in events}
        assert len(prompt) == 1 and all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"]
                                        + e["usage"]["completion_tokens"] for e in events)
        alone = {"stream_options": {"continuous_usage_stats": True}}
        plain = sse_events(http.post(route, json={**ask, **body, **alone}).text)
        assert not any("usage" in event and event["usage"] for event in plain), route


def streamed_ids(events: list[dict], n: int) -> tuple[list, list[list[int]]]:
    """The prompt_token_ids each event carried (chat: the chunk's; completions: the choice's), and
    every choice's token_ids concatenated."""
    prompts, outputs = [], [[] for _ in range(n)]
    for event in events:
        prompts += [event["prompt_token_ids"]] if "prompt_token_ids" in event else []
        for choice in event["choices"]:
            prompts += [choice["prompt_token_ids"]] if "prompt_token_ids" in choice else []
            outputs[choice["index"]] += choice.get("token_ids", [])
    return prompts, outputs


def test_chat_return_token_ids_streamed_and_not(http):
    ask = {"model": "flint-tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "n": 2}
    prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    plain = http.post("/v1/chat/completions", json=ask).json()
    assert "prompt_token_ids" not in plain and all("token_ids" not in c for c in plain["choices"])
    full = http.post("/v1/chat/completions", json={**ask, "return_token_ids": True}).json()
    assert full["prompt_token_ids"] == prompt
    outputs = [c["token_ids"] for c in sorted(full["choices"], key=lambda c: c["index"])]
    assert sum(map(len, outputs)) == full["usage"]["completion_tokens"] and outputs[0] == outputs[1]
    events = sse_events(http.post("/v1/chat/completions", json={**ask, "return_token_ids": True, "stream": True}).text)
    assert "prompt_token_ids" in events[0] and streamed_ids(events, 2) == ([prompt], outputs)
    plain = sse_events(http.post("/v1/chat/completions", json={**ask, "stream": True}).text)
    assert streamed_ids(plain, 2) == ([], [[], []])


def test_completions_return_token_ids_streamed_and_not(http):
    prompts = [http.post("/tokenize", json={"prompt": text}).json()["tokens"] for text in ("Hello there", "A dog")]
    ask = {"model": "flint-tiny", "prompt": ["Hello there", "A dog"], "max_tokens": 4, "temperature": 0,
           "return_token_ids": True}
    full = http.post("/v1/completions", json=ask).json()
    choices = sorted(full["choices"], key=lambda c: c["index"])
    assert [c["prompt_token_ids"] for c in choices] == prompts
    assert sum(len(c["token_ids"]) for c in choices) == full["usage"]["completion_tokens"]
    for echo in (False, True):
        events = sse_events(http.post("/v1/completions", json={**ask, "stream": True, "echo": echo}).text)
        sent, outputs = streamed_ids(events, 2)
        assert sorted(sent) == sorted(prompts) and outputs == [c["token_ids"] for c in choices]
    alone = http.post("/v1/completions", json={**ask, "echo": True, "max_tokens": 0}).json()
    assert [c["token_ids"] for c in alone["choices"]] == [[], []]
    assert "token_ids" not in http.post("/v1/completions", json={**ask, "return_token_ids": False}).json()["choices"][0]


def test_cache_salt_keeps_cached_prefixes_apart(http):
    text = "Salted prefixes are shared only within one salt. " * 6

    def cached(salt=None, route="/v1/completions"):
        body = {"model": "flint-tiny", "max_tokens": 1, **({"cache_salt": salt} if salt is not None else {})}
        body |= {"prompt": text} if route == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
        response = http.post(route, json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached() == 0 and cached("tenant-a") == 0 and cached("tenant-b") == 0
    assert cached("tenant-a") > 0 and cached() > 0
    assert cached("tenant-a", "/v1/chat/completions") == 0 and cached("tenant-a", "/v1/chat/completions") > 0
    error = error_of(http.post("/v1/completions", json={"model": "flint-tiny", "prompt": text, "cache_salt": ""}))
    assert error["param"] == "cache_salt" and "non-empty" in error["message"]


@pytest.mark.parametrize("field", [{"use_beam_search": True}, {"priority": 1}, {"logits_processors": ["x"]}],
                         ids=lambda field: next(iter(field)))
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_vllm_fields_not_served_here_are_refused_not_ignored(http, route, field):
    body = {"model": "flint-tiny", "max_tokens": 1, "messages": MESSAGES, "prompt": "hi"}
    assert error_of(http.post(route, json={**body, **field}))["param"] == next(iter(field))
    neutral = {"use_beam_search": False, "priority": 0, "logits_processors": None}
    assert http.post(route, json={**body, **neutral}).status_code == 200


def test_a_clients_request_id_names_the_response(server, http):
    chat = {"model": "flint-tiny", "messages": MESSAGES, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json={**chat, "request_id": "mine-1"}).json()["id"] == "chatcmpl-mine-1"
    headed = http.post("/v1/chat/completions", json={**chat, "request_id": "body"}, headers={"X-Request-Id": "head"})
    assert headed.json()["id"] == "chatcmpl-head"
    events = sse_events(http.post("/v1/completions", json={"model": "flint-tiny", "prompt": "hi", "max_tokens": 2,
                                                          "stream": True, "request_id": "mine-2"}).text)
    assert {event["id"] for event in events} == {"cmpl-mine-2"}

    async def twice():             # one id in two requests at once: both are served
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json={**chat, "max_tokens": 8},
                                                      headers={"X-Request-Id": "same"}) for _ in range(2)))

    assert [r.json()["id"] for r in asyncio.run(twice())] == ["chatcmpl-same"] * 2
    assert http.post("/v1/chat/completions", json=chat).json()["id"] != "chatcmpl-same"


def test_invocations_route_by_the_body(http):
    kinds = {"messages": ({"messages": MESSAGES}, "chat.completion"), "prompt": ({"prompt": "hi"}, "text_completion"),
             "input": ({"input": "hi"}, "response")}
    for fields, kind in kinds.values():
        answer = http.post("/invocations", json={"model": "flint-tiny", "max_tokens": 2, "max_output_tokens": 2,
                                                 **fields})
        assert answer.status_code == 200 and answer.json()["object"] == kind, answer.text
    assert "an invocation is" in error_of(http.post("/invocations", json={"model": "flint-tiny"}))["message"]
    assert error_of(http.post("/invocations", content=b"{nope"))["type"] == "invalid_request_error"
