"""`/v1/responses` through the openai package (its stream helper checks the events' order and
identities): the scripted model for reasoning, text and tool calls, flint-tiny for the rest."""

import json

import httpx
import jsonschema
import openai
import pytest
from api_server import API_KEY, SCRIPTED_MODEL, WEATHER_TOOL, error_of, shared_server

WEATHER = {"type": "function", **WEATHER_TOOL["function"]}       # the Responses API's flat tool shape


@pytest.fixture(scope="module")
def scripted(request):
    server = shared_server(request, "scripted")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def real(request):
    return shared_server(request, "real")


@pytest.fixture(scope="module")
def tiny(real):
    return openai.OpenAI(base_url=real.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def kinds(response) -> list[str]:
    return [item.type for item in response.output]


def test_reasoning_text_and_a_tool_call_streamed_and_not(scripted):
    ask = {"model": SCRIPTED_MODEL, "input": "WEATHER_ONE please", "tools": [WEATHER], "instructions": "Be brief."}
    full = scripted.responses.create(**ask)
    with scripted.responses.stream(**ask) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_response()
    for response in (full, streamed):
        assert response.status == "completed" and response.object == "response"
        assert response.id.startswith("resp_") and response.instructions == "Be brief."
        assert kinds(response) == ["reasoning", "message", "function_call"]
        reasoning, message, call = response.output
        assert reasoning.content[0].text == "Need the tool."
        assert message.content[0].text == "Let me check." and message.role == "assistant"
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Beijing", "days": 3}
        assert call.call_id and all(item.status == "completed" for item in response.output)
        usage = response.usage
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
        assert response.tools[0].name == "get_weather"
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    for expected in ("response.reasoning_text.delta", "response.output_text.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done"):
        assert expected in events
    assert events.count("response.output_item.added") == events.count("response.output_item.done") == 3


def test_a_tool_result_continues_the_stored_response(scripted):
    first = scripted.responses.create(model=SCRIPTED_MODEL, input="WEATHER_ONE please", tools=[WEATHER])
    call = first.output[-1]
    assert scripted.responses.retrieve(first.id).output[-1].call_id == call.call_id
    # the scripted model answers "Plain answer." when PLAIN_ANSWER is in the prompt: the tool's output is
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "PLAIN_ANSWER"}
    follow = scripted.responses.create(model=SCRIPTED_MODEL, previous_response_id=first.id, tools=[WEATHER],
                                       reasoning={"effort": "none"}, input=[result])
    assert follow.previous_response_id == first.id and follow.output_text == "Plain answer."
    assert follow.usage.input_tokens > first.usage.input_tokens
    # the same conversation given whole, without the store
    whole = scripted.responses.create(model=SCRIPTED_MODEL, tools=[WEATHER], store=False,
                                      reasoning={"effort": "none"}, input=[
        {"role": "user", "content": "WEATHER_ONE please"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                         "text": "Need the tool."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "PLAIN_ANSWER"}])
    assert whole.output_text == "Plain answer." and whole.usage.input_tokens == follow.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        scripted.responses.retrieve(whole.id)


def test_text_limits_and_structured_output_on_flint_tiny(tiny):
    cut = tiny.responses.create(model="flint-tiny", input="Hello", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5 and cut.output[-1].status == "incomplete"
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    fmt = {"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}}
    answer = tiny.responses.create(model="flint-tiny", input="A digit, as JSON.", text=fmt,
                                   reasoning={"effort": "none"}, max_output_tokens=40, temperature=1.0)
    assert answer.status == "completed" and kinds(answer) == ["message"]
    jsonschema.validate(json.loads(answer.output_text), schema)
    assert answer.usage.output_tokens_details.reasoning_tokens == 0
    messages = [{"role": "developer", "content": "Be terse."},
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    with tiny.responses.stream(model="flint-tiny", input=messages, max_output_tokens=6) as stream:
        events = list(stream)             # cut by max_output_tokens: the stream ends in response.incomplete
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.usage.output_tokens == 6
    text = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert last.response.output[0].content[0].text == text


@pytest.mark.parametrize("body, status, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": []}, 400, "input"),
], ids=["image", "item-reference", "builtin-tool", "background", "truncation", "max-tokens", "format",
        "unknown-previous", "empty"])
def test_bad_requests_get_the_openai_error_shape(real, body, status, param):
    response = httpx.post(real.base_url + "/v1/responses", json={"model": "flint-tiny", **body}, timeout=60)
    assert response.status_code == status, response.text
    assert error_of(response)["param"] == param


def test_retrieving_an_unknown_response_is_a_404(real):
    response = httpx.get(real.base_url + "/v1/responses/resp_nope", timeout=60)
    assert response.status_code == 404 and "not found" in error_of(response)["message"]
