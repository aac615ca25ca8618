from hypothesis import given, settings
from hypothesis import strategies as st

from flint_sched.engine.stop_strings import StopStringChecker, held_suffix_len


def test_holds_back_a_possible_start_and_releases_it():
    c = StopStringChecker(["STOP"])
    assert c.feed("abc S") == "abc "
    assert c.feed("T") == ""
    assert c.feed("x") == "STx"
    assert c.flush() == "" and c.matched is None


def test_match_across_pieces_cuts_before_the_stop_string():
    c = StopStringChecker(["</end>", "zz"])
    assert c.feed("hello </e") == "hello "
    assert c.feed("nd> more") == ""
    assert c.matched == "</end>" and c.feed("later") == "" and c.flush() == ""


def test_the_stop_string_completed_first_wins():
    c = StopStringChecker(["bc", "ab"])
    assert c.feed("xabc") == "x" and c.matched == "ab"
    c = StopStringChecker(["S", "TSS"])
    assert c.feed("TSS") == "T" and c.matched == "S"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abST", max_size=40), stops=st.lists(st.text(alphabet="abST", min_size=1, max_size=3),
                                                                     max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_any_split_gives_the_text_before_the_first_stop(text, stops, cuts):
    c = StopStringChecker(stops)
    bounds = sorted({0, len(text), *[min(x, len(text)) for x in cuts]})
    out = "".join(c.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])) + c.flush()
    assert out == first_completed_cut(text, stops)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abST", max_size=40), stops=st.lists(st.text(alphabet="abST", min_size=1, max_size=3),
                                                                     max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_included_stop_strings_end_the_text(text, stops, cuts):
    """include_stop_str_in_output: the text up to the end of the stop string completed first."""
    c = StopStringChecker(stops, include=True)
    bounds = sorted({0, len(text), *[min(x, len(text)) for x in cuts]})
    out = "".join(c.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])) + c.flush()
    assert out == first_completed_cut(text, stops, include=True)


def first_completed_cut(text, stops, include=False):
    """Generation stops as soon as a stop string is complete: cut at the earliest one then (or,
    including it, at that end)."""
    for end in range(len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s):end] == s]
        if starts:
            return text[:end] if include else text[: min(starts)]
    return text


def test_per_token_work_does_not_grow_with_the_text():
    """Only the held-back text is kept between pieces (searched again), whatever was emitted."""
    c = StopStringChecker(["</answer>"])
    for _ in range(10_000):
        assert c.feed("word </ans") == "word "
        assert len(c.pending) == len("</ans")
        assert c.feed("wer? ") == "</answer? "
    assert c.feed("</answer>") == "" and c.matched == "</answer>"


def test_completion_output_snapshots_keep_their_text():
    from flint_sched.engine.outputs import CompletionOutput
    out = CompletionOutput(0)
    out.append_text("Hello")
    before = out.snapshot()
    out.append_text(", world")
    out.append_text("")
    assert (before.text, out.text, out.snapshot().text) == ("Hello", "Hello, world", "Hello, world")
    assert len(out.pieces) == 2


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet="<a/b>", max_size=14),
       tags=st.lists(st.text(alphabet="<a/b>", min_size=1, max_size=6), min_size=1, max_size=4))
def test_held_suffix_len_is_the_longest_suffix_that_starts_a_tag(text, tags):
    expected = max((n for n in range(len(text) + 1) for t in tags if n < len(t) and t.startswith(text[len(text) - n:])),
                   default=0)
    assert held_suffix_len(text, tuple(tags)) == expected
