import copy
import json

import pytest

from flint_sched.tokenizer import build_tokenizer, default_chat_template, render_chat

TEMPLATE = default_chat_template()
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "查询天气 (weather)",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
PREAMBLE = (
    "<|system|># Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER_TOOL, ensure_ascii=False, separators=(",", ":"))
    + "\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)
GLM47_EXAMPLE_TAIL = (
    "</tool_call><|system|>You are helpful.<|user|>Weather in Beijing for 3 days?<|assistant|>"
    "<think>Need the tool.</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key>"
    "<arg_value>Beijing</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    '<|observation|><tool_response>{"temp": 20}</tool_response><tool_response>second</tool_response>'
    "<|assistant|><think>"
)


def weather_call(arguments) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def example_messages(arguments=None) -> list[dict]:
    return [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Beijing for 3 days?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Need the tool.",
            "tool_calls": [weather_call(arguments if arguments is not None else {"city": "Beijing", "days": 3})],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
        {"role": "tool", "tool_call_id": "call_1", "content": "second"},
    ]


def test_glm47_example_is_reproduced_exactly():
    prompt = render_chat(TEMPLATE, example_messages(), tools=[WEATHER_TOOL])
    assert prompt.startswith("[gMASK]<sop><|system|># Tools")
    assert prompt.endswith(GLM47_EXAMPLE_TAIL)
    assert prompt == "[gMASK]<sop>" + PREAMBLE + GLM47_EXAMPLE_TAIL[len("</tool_call>"):]
    assert "查询天气" in prompt


def test_arguments_as_json_string_are_parsed():
    as_string = render_chat(TEMPLATE, example_messages('{"city": "Beijing", "days": 3}'), tools=[WEATHER_TOOL])
    assert as_string == render_chat(TEMPLATE, example_messages(), tools=[WEATHER_TOOL])


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", ""])
def test_invalid_json_arguments_become_empty(arguments):
    prompt = render_chat(TEMPLATE, example_messages(arguments), tools=[WEATHER_TOOL])
    assert "<think>Need the tool.</think>Let me check.<tool_call>get_weather</tool_call><|observation|>" in prompt


def test_input_messages_are_not_modified():
    messages = example_messages('{"city": "Beijing"}')
    before = copy.deepcopy(messages)
    render_chat(TEMPLATE, messages, tools=[WEATHER_TOOL])
    assert messages == before


def test_non_string_values_are_compact_json():
    arguments = {"tags": ["a", "b"], "filter": {"city": "北京", "max": 3.5}, "exact": True, "limit": None, "note": "x y"}
    prompt = render_chat(TEMPLATE, [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": None, "tool_calls": [weather_call(arguments)]}],
                         add_generation_prompt=False)
    assert prompt.endswith(
        '<|assistant|></think><tool_call>get_weather<arg_key>tags</arg_key><arg_value>["a","b"]</arg_value>'
        '<arg_key>filter</arg_key><arg_value>{"city":"北京","max":3.5}</arg_value>'
        "<arg_key>exact</arg_key><arg_value>true</arg_value><arg_key>limit</arg_key><arg_value>null</arg_value>"
        "<arg_key>note</arg_key><arg_value>x y</arg_value></tool_call>"
    )


def test_thinking_off_generation_prompt():
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(TEMPLATE, messages, enable_thinking=False) == "[gMASK]<sop><|user|>hi<|assistant|></think>"
    assert render_chat(TEMPLATE, messages, enable_thinking=True) == "[gMASK]<sop><|user|>hi<|assistant|><think>"
    assert render_chat(TEMPLATE, messages, add_generation_prompt=False) == "[gMASK]<sop><|user|>hi"


@pytest.mark.parametrize("tools", [None, []])
def test_no_tools_means_no_preamble(tools):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = render_chat(TEMPLATE, messages, tools=tools)
    assert prompt == "[gMASK]<sop><|system|>Be brief.<|user|>hi<|assistant|><think>"


def test_list_content_keeps_text_parts():
    content = [
        {"type": "text", "text": "Describe "},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "text", "text": "this."},
    ]
    prompt = render_chat(TEMPLATE, [{"role": "user", "content": content}])
    assert prompt == "[gMASK]<sop><|user|>Describe this.<|assistant|><think>"


def conversation(**assistant_fields) -> list[dict]:
    return [
        {"role": "user", "content": "one"},
        {"role": "assistant", **assistant_fields},
        {"role": "user", "content": "two"},
        {"role": "assistant", **assistant_fields},
    ]


@pytest.mark.parametrize(
    "fields",
    [
        {"content": " answer\n", "reasoning_content": " thought "},
        {"content": "answer", "reasoning": "thought"},
        {"content": "<think>thought</think>\nanswer"},
        {"content": "thought</think>answer"},
    ],
)
def test_reasoning_only_after_last_user_message(fields):
    prompt = render_chat(TEMPLATE, conversation(**fields), add_generation_prompt=False)
    assert prompt == (
        "[gMASK]<sop><|user|>one<|assistant|></think>answer<|user|>two<|assistant|><think>thought</think>answer"
    )
    kept = render_chat(TEMPLATE, conversation(**fields), add_generation_prompt=False, clear_thinking=False)
    assert kept == (
        "[gMASK]<sop><|user|>one<|assistant|><think>thought</think>answer"
        "<|user|>two<|assistant|><think>thought</think>answer"
    )


def test_assistant_without_reasoning_after_last_user_gets_bare_close():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert render_chat(TEMPLATE, messages, add_generation_prompt=False) == "[gMASK]<sop><|user|>q<|assistant|></think>a"


def test_observation_once_per_run_of_tool_messages():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [weather_call({"city": "A"})]},
        {"role": "tool", "content": "r1"},
        {"role": "assistant", "content": "", "tool_calls": [weather_call({"city": "B"})]},
        {"role": "tool", "content": [{"type": "text", "text": "r2"}]},
        {"role": "tool", "content": "r3"},
    ]
    prompt = render_chat(TEMPLATE, messages)
    assert prompt.count("<|observation|>") == 2
    assert prompt.endswith(
        "<|observation|><tool_response>r2</tool_response><tool_response>r3</tool_response><|assistant|><think>"
    )


def test_prompt_tokenizes_to_special_ids():
    tok = build_tokenizer(4096, seed=0)
    ids = tok.encode(render_chat(TEMPLATE, example_messages(), tools=[WEATHER_TOOL]))
    assert ids[:3] == [tok.token_id("[gMASK]"), tok.token_id("<sop>"), tok.token_id("<|system|>")]
    assert ids[-2:] == [tok.token_id("<|assistant|>"), tok.token_id("<think>")]


def test_template_errors_are_value_errors():
    with pytest.raises(ValueError, match="unsupported message role: narrator"):
        render_chat(TEMPLATE, [{"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match="compile"):
        render_chat("{% if %}", [])
    with pytest.raises(ValueError, match="custom failure"):
        render_chat("{{ raise_exception('custom failure') }}", [])
    with pytest.raises(ValueError, match="unsafe|access"):
        render_chat("{{ messages.append(1) }}", [])


def test_tojson_filter_keeps_non_ascii_like_hugging_face():
    template = "{{ value | tojson }}|{{ value | tojson(separators=(',', ':')) }}|{{ value | tojson(indent=1) }}"
    rendered = render_chat(template, [], value={"城市": [1, 2]})
    assert rendered == '{"城市": [1, 2]}|{"城市":[1,2]}|{\n "城市": [\n  1,\n  2\n ]\n}'


def test_continue_final_message_leaves_the_last_message_open():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the answer is"}]
    prompt = render_chat(TEMPLATE, messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt == "[gMASK]<sop><|user|>hi<|assistant|></think>Sure, the answer is"
    # a template that closes each turn: cut after the text, its kept trailing space too; a list
    # content continues its last text part
    closing = "{% for m in messages %}<s>{{ m.content if m.content is string else m.content[-1].text }}</s>{% endfor %}"
    assert render_chat(closing, [{"role": "assistant", "content": "one two "}], add_generation_prompt=False,
                       continue_final_message=True) == "<s>one two "
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b c"}]
    assert render_chat(closing, [{"role": "user", "content": parts}], add_generation_prompt=False,
                       continue_final_message=True) == "<s>b c"


def test_continue_final_message_errors_are_value_errors():
    messages = [{"role": "assistant", "content": "x"}]
    with pytest.raises(ValueError, match="cannot both be true"):
        render_chat(TEMPLATE, messages, continue_final_message=True)
    with pytest.raises(ValueError, match="does not write"):
        render_chat("{% for m in messages %}[turn]{% endfor %}", messages, add_generation_prompt=False,
                    continue_final_message=True)
    with pytest.raises(ValueError, match="no text to continue"):
        render_chat(TEMPLATE, [{"role": "user", "content": [{"type": "image_url"}]}], add_generation_prompt=False,
                    continue_final_message=True)
    with pytest.raises(ValueError, match="needs a message"):
        render_chat(TEMPLATE, [], add_generation_prompt=False, continue_final_message=True)
