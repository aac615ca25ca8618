import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from flint_sched.tokenizer import SPECIAL_TOKENS, FlintTokenizer, IncrementalDetokenizer, build_tokenizer
from flint_sched.tokenizer.byte_level import byte_to_char

VOCAB_SIZE = 4096
TEXT = st.lists(
    st.one_of(
        st.text(max_size=8),
        st.sampled_from(["😀", "👩‍💻", "🇨🇳", "你好", "世界", "é", "e\u0301", " the", "\n"]),
        st.sampled_from(SPECIAL_TOKENS),
    ),
    max_size=12,
).map("".join)


@pytest.fixture(scope="module")
def tok() -> FlintTokenizer:
    return build_tokenizer(VOCAB_SIZE, seed=0)


def deltas_of(tokenizer: FlintTokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


def byte_id(tokenizer: FlintTokenizer, byte: int) -> int:
    return tokenizer.token_id(byte_to_char()[byte])


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40), skip=st.booleans())
def test_random_ids_concatenate_to_decode(tok, ids, skip):
    assert "".join(deltas_of(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None)
@given(text=TEXT, skip=st.booleans())
def test_encoded_text_streams_back_whole_characters(tok, text, skip):
    ids = tok.encode(text)
    deltas = deltas_of(tok, ids, skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert all("\ufffd" not in delta for delta in deltas) or "\ufffd" in text


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=24))
def test_arbitrary_bytes_match_the_lossy_decode(tok, data):
    ids = [byte_id(tok, byte) for byte in data]
    assert "".join(deltas_of(tok, ids)) == tok.decode(ids)


def test_emoji_split_across_byte_tokens_is_held_back(tok):
    ids = [byte_id(tok, byte) for byte in "😀".encode()]
    assert deltas_of(tok, ids) == ["", "", "", "😀", ""]
    ids = [byte_id(tok, byte) for byte in "a世".encode()]
    assert deltas_of(tok, ids) == ["a", "", "", "世", ""]


def test_incomplete_bytes_flush_as_replacement(tok):
    lead = byte_id(tok, 0xF0)
    assert deltas_of(tok, [lead]) == ["", "\ufffd"]
    assert deltas_of(tok, [lead, tok.encode("a")[0]]) == ["", "\ufffda", ""]
    assert deltas_of(tok, [byte_id(tok, 0xFF)]) == ["\ufffd", ""]


def test_special_tokens_kept_or_skipped(tok):
    ids = tok.encode("<think>why</think>so<|endoftext|>")
    assert "".join(deltas_of(tok, ids)) == "<think>why</think>so<|endoftext|>"
    assert "".join(deltas_of(tok, ids, skip_special_tokens=True)) == "whyso"


def test_extend_equals_pushes(tok):
    ids = tok.encode("streaming 😀 text 你好")
    detokenizer = IncrementalDetokenizer(tok)
    assert detokenizer.extend(ids) + detokenizer.flush() == tok.decode(ids)


# --- tokenizers whose ids are not byte strings (SentencePiece-style, byte fallback) ----------------


@pytest.fixture(scope="module")
def metaspace_tok() -> FlintTokenizer:
    vocab = {"<unk>": 0, **{f"<0x{byte:02X}>": 1 + byte for byte in range(256)}}
    pieces = ["▁", "a", "b", "e", "h", "t", "你", "好", "▁t", "▁th", "▁the", "he"]
    for piece in pieces:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("h", "e")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([
        decoders.Metaspace(replacement="▁", prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse(),
    ])
    return FlintTokenizer(backend)


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_window_path_for_other_tokenizers(metaspace_tok, text):
    assert metaspace_tok.token_bytes_table() is None
    ids = metaspace_tok.encode(text)
    assert "".join(deltas_of(metaspace_tok, ids)) == metaspace_tok.decode(ids)


def test_window_stays_short(metaspace_tok):
    ids = metaspace_tok.encode("the 你好 " * 500)
    detokenizer = IncrementalDetokenizer(metaspace_tok)
    longest = 0
    for token_id in ids:
        detokenizer.push(token_id)
        longest = max(longest, len(detokenizer._window.ids))
    assert longest <= 8
    assert detokenizer.flush() == ""
