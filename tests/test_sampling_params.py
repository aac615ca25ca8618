"""SamplingParams: defaults, normalization, is_greedy, and one test per rejected value."""

import dataclasses
import math

import pytest

from flint_sched.sampling_params import SamplingParams


def test_defaults():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p) == (1, 1.0, 1.0)
    assert (params.top_k, params.min_p, params.seed, params.logprobs) == (0, 0.0, None, None)
    assert params.presence_penalty == params.frequency_penalty == 0.0
    assert params.repetition_penalty == 1.0
    assert params.logit_bias == {} and params.stop == () and params.stop_token_ids == ()
    assert (params.min_tokens, params.max_tokens) == (0, 16)
    assert params.ignore_eos is False and params.skip_special_tokens is True
    assert not params.is_greedy


def test_values_are_normalized():
    bias = {5: -100, 7: 2.5}
    params = SamplingParams(
        temperature=0, top_p=1, top_k=-1, stop="###", stop_token_ids=[3, 4], logit_bias=bias
    )
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.top_k == 0
    assert params.stop == ("###",) and params.stop_token_ids == (3, 4)
    assert params.logit_bias == {5: -100.0, 7: 2.5} and params.logit_bias is not bias
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    lists = SamplingParams(allowed_token_ids=[3, 1], bad_words=["no"], bad_words_token_ids=[[4, 5], [6]])
    assert lists.allowed_token_ids == (3, 1) and lists.bad_words == ("no",)
    assert lists.bad_words_token_ids == ((4, 5), (6,)) and SamplingParams().allowed_token_ids is None


@pytest.mark.parametrize(
    "temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False), (2.0, False)]
)
def test_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_edges_that_are_accepted():
    SamplingParams(
        temperature=5.0, top_p=1e-9, top_k=1, min_p=1.0, seed=-3, presence_penalty=-2,
        frequency_penalty=2, repetition_penalty=1e-3, logit_bias={0: 100, 151551: -100},
        logprobs=20, min_tokens=16, max_tokens=16,
    )
    SamplingParams(logprobs=0, min_p=0.0, seed=0, ignore_eos=True, skip_special_tokens=False)


def test_is_frozen():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5


REJECTED = [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 1.5), ("top_k", None),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", math.nan),
    ("seed", 1.5), ("seed", "7"), ("seed", True),
    ("presence_penalty", -2.01), ("presence_penalty", 2.01), ("presence_penalty", math.inf),
    ("frequency_penalty", -2.01), ("frequency_penalty", 2.01), ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("logit_bias", {1: 100.5}), ("logit_bias", {1: -101}), ("logit_bias", {1: math.nan}),
    ("logit_bias", {"1": 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {True: 1.0}),
    ("logit_bias", [(1, 2.0)]), ("logit_bias", None), ("logit_bias", {1: "2"}),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", True),
    ("stop", [""]), ("stop", ""), ("stop", [1]), ("stop", ["a", None]), ("stop", None), ("stop", 5),
    ("stop", b"x"),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", "12"), ("stop_token_ids", None), ("stop_token_ids", 3),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", None), ("max_tokens", 2.0),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ("skip_special_tokens", 0), ("skip_special_tokens", "false"),
    ("include_stop_str_in_output", 1), ("include_stop_str_in_output", None),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [1.0]), ("allowed_token_ids", "12"),
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", [3]), ("bad_words", None),
    ("bad_words_token_ids", [[]]), ("bad_words_token_ids", [[-1]]), ("bad_words_token_ids", [3]),
    ("bad_words_token_ids", "ab"),
]


@pytest.mark.parametrize("field, value", REJECTED, ids=[f"{f}={v!r}" for f, v in REJECTED])
def test_rejections_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_is_checked_against_the_given_max_tokens():
    SamplingParams(min_tokens=100, max_tokens=100)
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=101, max_tokens=100)
