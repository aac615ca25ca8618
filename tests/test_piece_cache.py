"""PieceCache: a prompt cut at its added tokens, pieces seen before reused, gives the ids of the
whole prompt encoded at once; tokenizers whose pieces depend on their place encode it whole."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from flint_sched.benchmarks.serve.datasets import agent_requests
from flint_sched.tokenizer import SPECIAL_TOKENS, build_tokenizer, default_chat_template, render_chat
from flint_sched.tokenizer.piece_cache import PieceCache

TEXT = st.lists(
    st.one_of(st.text(max_size=8), st.sampled_from([" ", "\n", "  \n", "the", " world", "你好", "😀", "é"]),
              st.sampled_from(SPECIAL_TOKENS)),
    max_size=16,
).map("".join)


@pytest.fixture(scope="module")
def tiny():
    return build_tokenizer(4096, seed=0)


def whole(backend, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids


class CountingBackend:
    """The tokenizer, recording the texts each encode_batch call is given."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def encode_batch(self, texts, add_special_tokens):
        self.calls.append(list(texts))
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.backend, name)


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_ids_are_those_of_the_whole_text(tiny, texts):
    cache = PieceCache(tiny.backend)
    for text in texts + texts:                   # the second round reads the cache
        assert cache.encode(text) == whole(tiny.backend, text)


def test_agent_turns_match_and_encode_only_their_new_messages(tiny):
    requests = agent_requests(np.random.default_rng(0), num=8, num_turns=4, system_prompt_len=300,
                              tool_result_len=50, output_len=8, range_ratio=0.0)
    for request in requests:                     # every session's turn 0, then every turn 1, ...
        text = render_chat(default_chat_template(), request.messages, request.tools)
        assert tiny.encode(text) == whole(tiny.backend, text)
    counting = CountingBackend(tiny.backend)
    cache = PieceCache(counting)
    start = "<|system|>rules<|user|>question<|assistant|><think>"
    assert cache.encode(start) == whole(tiny.backend, start)
    later = start + "plan</think>call<|observation|><tool_response>result</tool_response><|assistant|><think>"
    assert cache.encode(later) == whole(tiny.backend, later)
    assert counting.calls == [["", "rules", "question", ""], ["plan", "call", "result", ""]]


def test_least_recently_used_pieces_go_past_the_bound(tiny):
    cache = PieceCache(tiny.backend, max_chars=10)
    cache.encode("abcd<|user|>efgh<|user|>")
    cache.encode("abcd<|user|>ijkl<|user|>")        # abcd was used last, efgh goes
    assert list(cache._pieces) == ["abcd", "ijkl"] and cache._num_chars == 8


def test_a_tokenizer_whose_pieces_depend_on_their_place_encodes_whole():
    vocab = {"<unk>": 0, "▁": 1, "t": 2, "h": 3, "e": 4, "▁t": 5, "▁th": 6, "▁the": 7, "he": 8}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("h", "e")],
                                   unk_token="<unk>"))
    # "first": the prompt's first word gets "▁", not the first word after an added token
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.add_special_tokens(["<s>"])
    cut = whole(backend, "the") + [backend.token_to_id("<s>")] + whole(backend, "the")
    assert whole(backend, "the<s>the") != cut
    cache = PieceCache(backend)
    assert cache._split is None
    assert cache.encode("the<s>the") == whole(backend, "the<s>the")
