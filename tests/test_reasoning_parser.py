import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flint_sched.api.parsers import ReasoningParser

CASES = json.loads((Path(__file__).parent / "data/glm47_cases.json").read_text())

# (thinking, output, reasoning, content)
HAND_CASES = [
    (False, "<think>a</think>b", None, "<think>a</think>b"),
    (True, "", None, ""),
    (True, "   \n", None, ""),
    (True, "</think>", None, ""),
    (True, "  <think>abc  \n</think>\nx", "abc", "\nx"),
    (True, "\n<think>\nabc", "\nabc", ""),
    (True, "abc<tool_call>f</tool_call>", "abc", "<tool_call>f</tool_call>"),
    (True, "a\n\n<tool_call>x</think>y", "a", "<tool_call>xy"),
    (True, "a </thi", "a </thi", ""),
    (True, "<thi", "<thi", ""),
    (True, "  <tool_ca", "  <tool_ca", ""),
    (True, "x<think>y</think>z", "x<think>y", "z"),
    (True, "<think><think>a", "<think>a", ""),
    (True, "a</think>b</think>c", "a", "bc"),                     # as vLLM's glm47 parser
    (True, "a</think>b</thi", "a", "b</thi"),
    (True, "思考🙂 \t</think>答案", "思考🙂", "答案"),
    (True, '  "quoted" \\ </ x</think>', '  "quoted" \\ </ x', ""),
]

FRAGMENTS = st.sampled_from(
    ["<think>", "</think>", "<tool_call>", "<", "</", "</thi", "<thi", "<tool_c", "think>", " ", "\n", "\t",
     "a", "bc", "北京", "🙂", '"', "\\", "</tool_call>"]
)
TEXT = st.lists(FRAGMENTS, max_size=14).map("".join)


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = [0] + sorted(min(cut, len(text)) for cut in cuts) + [len(text)]
    return [text[start:end] for start, end in zip(points, points[1:])]


def stream(thinking: bool, chunks: list[str]) -> tuple[str | None, str]:
    parser = ReasoningParser(thinking)
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    return reasoning or None, "".join(d.content for d in deltas)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_cases_reasoning(case):
    reasoning, content = ReasoningParser(case["enable_thinking"]).parse(case["output"])
    assert reasoning == case["expect"]["reasoning"]
    if case["kind"] == "reasoning":
        assert (content or None) == case["expect"]["content"]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_cases_streamed_one_char_and_every_two_way_split(case):
    thinking, output = case["enable_thinking"], case["output"]
    want = ReasoningParser(thinking).parse(output)
    assert stream(thinking, list(output)) == want
    for cut in range(len(output) + 1):
        assert stream(thinking, [output[:cut], output[cut:]]) == want


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_cases_streamed_random_splits(case, data):
    thinking, output = case["enable_thinking"], case["output"]
    cuts = data.draw(st.lists(st.integers(0, len(output)), max_size=len(output)))
    assert stream(thinking, split_at(output, cuts)) == ReasoningParser(thinking).parse(output)


@pytest.mark.parametrize(("thinking", "output", "reasoning", "content"), HAND_CASES)
def test_hand_cases(thinking, output, reasoning, content):
    assert ReasoningParser(thinking).parse(output) == (reasoning, content)
    assert stream(thinking, list(output)) == (reasoning, content)
    assert stream(thinking, [output]) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(thinking=st.booleans(), text=TEXT, cuts=st.lists(st.integers(0, 200), max_size=20))
def test_streaming_matches_parse_for_any_split(thinking, text, cuts):
    assert stream(thinking, split_at(text, cuts)) == ReasoningParser(thinking).parse(text)


def test_trailing_whitespace_is_held_not_retracted():
    parser = ReasoningParser(thinking=True)
    assert parser.feed("abc \n").reasoning == "abc"
    assert parser.feed("  ").reasoning == ""
    assert parser.feed("def").reasoning == " \n  def"
    assert parser.feed(" </th").reasoning == ""
    after = parser.feed("ink> x")
    assert (after.reasoning, after.content) == ("", " x")
    assert parser.finish().content == ""


def test_tag_split_across_chunks_is_held_back():
    parser = ReasoningParser(thinking=True)
    assert parser.feed("<th").reasoning == ""
    assert parser.feed("ink>why<tool_").reasoning == "why"
    delta = parser.feed("call>f")
    assert (delta.reasoning, delta.content) == ("", "<tool_call>f")


def test_thinking_off_passes_everything_through_at_once():
    parser = ReasoningParser(thinking=False)
    assert parser.feed("</thi").content == "</thi"
    assert parser.finish().content == ""


def test_unclosed_reasoning_flushes_partial_tag_at_finish():
    parser = ReasoningParser(thinking=True)
    assert parser.feed("plan  </think").reasoning == "plan"
    assert parser.finish().reasoning == "  </think"
