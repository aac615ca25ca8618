"""Hostile and oversized input against live servers: always a 4xx in OpenAI's error shape, never a
500 or a stall. Schema-driven fuzzing of every route reads the server's own /openapi.json."""

import json
import socket
import time

import httpx
import pytest
from api_server import API_KEY, SCRIPTED_MODEL, error_of, shared_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_fuzz import body_strategy

from flint_sched.api.limits import MAX_JSON_DEPTH

POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize")
USER = [{"role": "user", "content": "hi"}]
MAX_MODEL_LEN = 2048          # the "real" server's


@pytest.fixture(scope="module")
def real(request):
    return shared_server(request, "real")


@pytest.fixture(scope="module")
def http(real):
    with httpx.Client(base_url=real.base_url, timeout=60) as client:
        yield client


def nested(depth: int, closed: bool = True) -> bytes:
    return b"[" * depth + (b"]" * depth if closed else b"")


def body_with(extra: bytes) -> bytes:
    """A body every POST route would accept, plus an unknown field holding `extra`."""
    return b'{"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "tokens": [1], "max_tokens": 1, ' \
           b'"extra": ' + extra + b"}"


@pytest.mark.parametrize("route", POST_ROUTES)
@pytest.mark.parametrize("extra", [nested(MAX_JSON_DEPTH), nested(1000), nested(100_000, closed=False)],
                         ids=["65-levels", "1000-levels", "100000-unclosed"])
def test_deep_nesting_is_a_400_on_every_route(http, route, extra):
    response = http.post(route, content=body_with(extra))
    assert response.status_code == 400, response.text
    assert "levels deep" in error_of(response)["message"]


def test_nesting_at_the_limit_is_served(http):
    response = http.post("/tokenize", content=b'{"prompt": "hi", "extra": ' + nested(MAX_JSON_DEPTH - 1) + b"}")
    assert response.status_code == 200, response.text
    kwargs = json.loads(nested(MAX_JSON_DEPTH - 3))
    assert http.post("/tokenize", json={"messages": USER, "chat_template_kwargs": {"deep": kwargs}}).status_code == 200


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_deeply_nested_tool_call_arguments_are_a_400(http, route):
    call = {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "[" * 50000}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, *USER]
    response = http.post(route, json={"messages": messages, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == "messages[1].tool_calls[0].function.arguments"


HUGE_TEXT = "flint " * (5 << 20)         # 30 MiB


@pytest.mark.parametrize("route, body", [
    ("/tokenize", {"prompt": HUGE_TEXT}),
    ("/tokenize", {"messages": [{"role": "user", "content": HUGE_TEXT}]}),
    ("/v1/completions", {"prompt": HUGE_TEXT, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE_TEXT}], "max_tokens": 1}),
], ids=["tokenize-prompt", "tokenize-messages", "completions", "chat"])
def test_a_prompt_that_cannot_fit_is_refused_untokenized(http, route, body):
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text[:300]
    assert "at least" in error_of(response)["message"]        # from the bound, not from the tokenizer
    assert http.get("/health").status_code == 200


def test_token_lists_and_batches_past_the_limits_are_400(http):
    too_many = [5] * MAX_MODEL_LEN
    for route, body, param in (("/v1/completions", {"prompt": too_many, "max_tokens": 1}, "prompt"),
                               ("/v1/completions", {"prompt": ["a"] * 600, "n": 2, "max_tokens": 1}, "prompt"),
                               ("/detokenize", {"tokens": too_many + too_many}, "tokens")):
        response = http.post(route, json=body)
        assert response.status_code == 400, (route, response.text[:300])
        assert error_of(response)["param"] == param


def test_a_client_that_leaves_mid_body_logs_nothing(real, http):
    tracebacks = real.log().count("Traceback")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", real.port)) as sock:
            sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"prompt\": \"")
    time.sleep(0.5)
    assert http.get("/health").status_code == 200
    assert real.log().count("Traceback") == tracebacks, real.log()


# -- schema-driven fuzzing: every route of /openapi.json, zero 5xx ----------------------------------

@pytest.fixture(scope="module")
def scripted(request):
    server = shared_server(request, "scripted")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, timeout=60, headers=headers) as client:
        yield client


@pytest.fixture(scope="module")
def document(scripted):
    return scripted.get("/openapi.json").json()


def request_routes(document) -> list[tuple[str, str, str | None]]:
    routes = []
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            routes.append((method, path, schema["$ref"].rsplit("/", 1)[1] if schema else None))
    return routes


def check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        error_of(response)
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        if response.text.startswith("event: response."):       # /v1/responses: its last event ends it
            last = response.text.rsplit("event: ", 1)[1]
            assert last.startswith(("response.completed", "response.incomplete")), response.text[-500:]
        else:
            assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text, \
                response.text[-500:]


def test_every_documented_route_is_fuzzed(document):
    assert {(m, p) for m, p, _ in request_routes(document)} >= {("post", r) for r in POST_ROUTES}


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_bodies_never_get_a_5xx(scripted, document, data):
    routes = [r for r in request_routes(document) if r[2] is not None]
    method, path, schema = data.draw(st.sampled_from(routes), label="route")
    fields = {"model": st.sampled_from([None, SCRIPTED_MODEL, "gpt-9"]),
              "role": st.sampled_from(["user", "assistant", "system", "tool", "wizard"])}
    body = data.draw(body_strategy(document, schema, fields), label="body")
    # json.dumps escapes what UTF-8 cannot carry (lone surrogates such as "\ud800" in WORDS) as
    # JSON does, so the server sees them; httpx's json= would fail to encode them client-side.
    check_answer(scripted.request(method.upper(), path, content=json.dumps(body),
                                  headers={"Content-Type": "application/json"}))


def test_fuzzing_left_the_engine_idle_and_every_get_route_answers(scripted, document):
    for method, path, schema in request_routes(document):
        if schema is None and "{" not in path:                # a path with parameters: by its own tests
            assert scripted.request(method.upper(), path).status_code == 200, path
    deadline = time.monotonic() + 10
    while True:
        metrics = scripted.get("/metrics").text
        idle = all(f'{name}{{model_name="{SCRIPTED_MODEL}"}} 0.0' in metrics
                   for name in ("flint:num_requests_running", "flint:num_requests_waiting",
                                "flint:kv_cache_usage_perc", "flint:ring_slot_usage_perc"))
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, metrics
