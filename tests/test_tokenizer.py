import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flint_sched.tokenizer import (
    SPECIAL_TOKENS,
    FlintTokenizer,
    build_tokenizer,
    default_chat_template,
    write_gguf_tokenizer,
)
from flint_sched.tokenizer import bpe
from flint_sched.tokenizer.byte_level import SPLIT_PATTERN, byte_to_char, glm4_pre_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLES = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def build(seed: int) -> list[int]:\n    return [seed * 2 for _ in range(10)]\n",
    "你好，世界。深度学习模型的服务器。こんにちは",
    "emoji 😀👍🏽 flags 🇨🇳 zwj 👩‍💻 and é vs e\u0301",
    "[gMASK]<sop><|user|>hi<|assistant|><think>plan</think>ok<tool_call>f<arg_key>k</arg_key>"
    "<arg_value>v</arg_value></tool_call><|observation|><tool_response>r</tool_response><|endoftext|>",
    "\r\n\t  trailing   \x00\x7f\u0120Ġ spaces  ",
    "numbers 1234567 3.14159 0xdeadbeef",
]
# Text mixing arbitrary code points with the scripts the tokenizer was trained on and special tokens.
MIXED_TEXT = st.lists(
    st.one_of(
        st.text(max_size=8),
        st.sampled_from(["the", " world", "def ", "_id", "()", "\n    ", "你好", "世界", "😀", "👍🏽", "é", "  "]),
        st.sampled_from(SPECIAL_TOKENS),
    ),
    max_size=12,
).map("".join)


@pytest.fixture(scope="module")
def tiny() -> FlintTokenizer:
    return build_tokenizer(4096, seed=0)


def test_vocab_layout_puts_specials_on_top(tiny):
    assert tiny.vocab_size == 4096
    assert tiny.special_tokens == {content: 4079 + index for index, content in enumerate(SPECIAL_TOKENS)}
    assert tiny.eos_token_ids == (4079, 4083, 4085) and tiny.eos_token_id == 4079
    assert tiny.pad_token_id == 4079 and tiny.bos_token_id is None
    assert tiny.chat_template == default_chat_template()
    assert [tiny.decode([byte]) for byte in range(ord("a"), ord("d"))] == ["a", "b", "c"]


def test_every_id_decodes_to_bytes(tiny):
    table = tiny.token_bytes_table()
    assert len(table) == tiny.vocab_size and all(table)
    assert len(set(table)) == tiny.vocab_size
    assert table[tiny.token_id("<think>")] == b"<think>"
    decoded = [tiny.decode([token_id]) for token_id in range(tiny.vocab_size)]
    assert all(isinstance(text, str) and text for text in decoded)


def test_same_seed_gives_identical_files_across_processes(tiny, tmp_path):
    tiny.save(tmp_path / "here")
    script = "import sys; from flint_sched.tokenizer import build_tokenizer; build_tokenizer(4096, 0).save(sys.argv[1])"
    fresh = {**os.environ, "FLINT_SCHED_CACHE": str(tmp_path / "cache")}     # it trains, not reads the cache
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "there")], check=True, cwd=REPO_ROOT, env=fresh)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes()


def test_other_seed_gives_other_merges(tiny):
    other = build_tokenizer(4096, seed=1)
    assert other.special_tokens == tiny.special_tokens
    assert other.backend.to_str() != tiny.backend.to_str()


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_samples(tiny, text):
    assert tiny.decode(tiny.encode(text)) == text


@settings(max_examples=300, deadline=None)
@given(text=MIXED_TEXT)
def test_round_trip_any_text(tiny, text):
    assert tiny.decode(tiny.encode(text)) == text


def test_special_tokens_in_text_are_single_ids(tiny):
    ids = tiny.encode("<|user|>hi<think>")
    assert ids[0] == tiny.token_id("<|user|>") and ids[-1] == tiny.token_id("<think>")
    assert tiny.encode("") == []
    for content in SPECIAL_TOKENS:
        assert tiny.encode(content) == [tiny.token_id(content)]
    assert tiny.decode(ids, skip_special_tokens=True) == "hi"


def test_merges_compress_english_code_and_chinese(tiny):
    for text in SAMPLES[1:4]:
        assert len(tiny.encode(text)) < 0.6 * len(text.encode("utf-8"))


def test_vocab_too_small_for_bytes_and_specials():
    with pytest.raises(ValueError, match="at least 273"):
        build_tokenizer(272, seed=0)
    assert build_tokenizer(273, seed=0).decode(list(range(273))).endswith("</arg_value>")


def test_unknown_token_id_raises(tiny):
    with pytest.raises(KeyError, match="nope"):
        tiny.token_id("<nope>")


def test_short_training_is_filled_to_exact_size(monkeypatch, tmp_path):
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))     # not the cached full training
    train = bpe.train_merges
    monkeypatch.setattr(bpe, "train_merges", lambda seed, num_merges: train(seed, 500))
    tok = build_tokenizer(4096, seed=0)
    assert tok.vocab_size == 4096 and tok.token_id("</arg_value>") == 4095
    again = bpe.fill_merges(train(0, 500), 3823, seed=0)
    assert json.loads(tok.backend.model.__getstate__())["merges"] == [list(merge) for merge in again]
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.slow
def test_full_size_builds_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))     # trained, not read from the cache
    start = time.perf_counter()
    tok = build_tokenizer(151552, seed=0)
    assert time.perf_counter() - start < 30
    assert tok.vocab_size == 151552
    assert tok.token_id("<|endoftext|>") == 151535 and tok.token_id("</arg_value>") == 151551
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


def test_the_cache_gives_the_trained_tokenizer_and_survives_a_corrupt_file(monkeypatch, tmp_path):
    monkeypatch.setenv("FLINT_SCHED_CACHE", str(tmp_path))
    trained = build_tokenizer(1024, seed=3)
    (cached,) = (tmp_path / "tokenizers").iterdir()
    assert build_tokenizer(1024, seed=3).backend.to_str() == trained.backend.to_str()
    calls = []
    monkeypatch.setattr(bpe, "train_merges", lambda *args: calls.append(args) or [])
    assert build_tokenizer(1024, seed=3).backend.to_str() == trained.backend.to_str() and not calls
    cached.write_text("{not json")
    rebuilt = build_tokenizer(1024, seed=3)                    # trains again (here: no merges), rewrites
    assert calls and rebuilt.vocab_size == 1024
    assert json.loads(cached.read_text())["model"]["type"] == "BPE"


# --- files -----------------------------------------------------------------------------------------


def test_save_and_load_directory_and_file(tiny, tmp_path):
    tiny.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and config["chat_template"] == default_chat_template()
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        loaded = FlintTokenizer.from_file(path)
        assert loaded.eos_token_ids == tiny.eos_token_ids and loaded.chat_template == tiny.chat_template
        assert [loaded.encode(text) for text in SAMPLES] == [tiny.encode(text) for text in SAMPLES]


GLM_ADDED = [
    ("<|endoftext|>", True), ("[MASK]", True), ("[gMASK]", True), ("[sMASK]", True), ("<sop>", True),
    ("<eop>", True), ("<|system|>", True), ("<|user|>", True), ("<|assistant|>", True),
    ("<|observation|>", True), ("<|begin_of_image|>", True), ("<|end_of_image|>", True),
    ("<think>", True), ("</think>", True), ("<tool_call>", True), ("</tool_call>", True),
    ("<tool_response>", True), ("</tool_response>", True), ("<arg_key>", True), ("</arg_key>", True),
    ("<arg_value>", True), ("</arg_value>", True), ("/nothink", False),
]
HF_TEMPLATE = "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def write_hf_tokenizer(directory: Path) -> None:
    """A tokenizer.json / tokenizer_config.json pair laid out as GLM-4.x ships them (legacy merges)."""
    gpt2_order = sorted(range(256), key=lambda byte: ord(byte_to_char()[byte]))
    vocab = {byte_to_char()[byte]: index for index, byte in enumerate(gpt2_order)}
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġ w", "o r", "l d", "Ġw or", "Ġwor ld", "ä ½", "ä½ ł"]
    for merge in merges:
        vocab[merge.replace(" ", "")] = len(vocab)
    added = [
        {"id": len(vocab) + index, "content": content, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": special}
        for index, (content, special) in enumerate(GLM_ADDED)
    ]
    ids = {entry["content"]: entry["id"] for entry in added}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "[gMASK]", "type_id": 0}},
                {"SpecialToken": {"id": "<sop>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {
                name: {"id": name, "ids": [ids[name]], "tokens": [name]} for name in ("[gMASK]", "<sop>")
            },
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    config = {
        "added_tokens_decoder": {str(entry["id"]): {k: v for k, v in entry.items() if k != "id"} for entry in added},
        "chat_template": [{"name": "default", "template": HF_TEMPLATE}, {"name": "tool_use", "template": "x"}],
        "clean_up_tokenization_spaces": False,
        "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "model_max_length": 128000,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> FlintTokenizer:
    directory = tmp_path_factory.mktemp("glm_like")
    write_hf_tokenizer(directory)
    return FlintTokenizer.from_file(directory)


def test_hugging_face_tokenizer_loads_through_same_class(hf_tokenizer):
    tok = hf_tokenizer
    assert tok.vocab_size == 256 + 12 + len(GLM_ADDED)
    assert tok.token_id("<|endoftext|>") == 268 and tok.token_id("<|user|>") == 275
    assert tok.eos_token_ids == (268, 275, 277) and tok.pad_token_id == 268
    assert "/nothink" not in tok.special_tokens and tok.token_id("/nothink") == 290
    assert tok.chat_template == HF_TEMPLATE
    assert tok.encode(" the world") == [tok.token_id("Ġthe"), tok.token_id("Ġworld")]  # no [gMASK]<sop>
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


def test_chat_template_file_takes_precedence(tmp_path):
    write_hf_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert FlintTokenizer.from_file(tmp_path).chat_template == "{{ messages }}"


def test_missing_or_corrupt_files_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="absent"):
        FlintTokenizer.from_file(tmp_path / "absent")
    with pytest.raises(ValueError, match="tokenizer.json"):
        FlintTokenizer.from_file(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        FlintTokenizer.from_file(tmp_path)
    write_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        FlintTokenizer.from_file(tmp_path)


# --- GGUF metadata ---------------------------------------------------------------------------------


def gguf_reader(tmp_path: Path, tok: FlintTokenizer, **kwargs) -> gguf.GGUFReader:
    path = tmp_path / "tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), arch="flint")
    write_gguf_tokenizer(writer, tok, **kwargs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def assert_equivalent(original: FlintTokenizer, rebuilt: FlintTokenizer, texts: list[str]) -> None:
    assert rebuilt.vocab_size == original.vocab_size
    assert rebuilt.eos_token_ids == original.eos_token_ids and rebuilt.pad_token_id == original.pad_token_id
    assert rebuilt.special_tokens == original.special_tokens
    assert rebuilt.chat_template == original.chat_template
    for text in texts:
        ids = original.encode(text)
        assert rebuilt.encode(text) == ids
        assert rebuilt.decode(ids) == original.decode(ids) == text
    every_id = list(range(original.vocab_size))
    assert rebuilt.decode(every_id) == original.decode(every_id)


def test_gguf_metadata_round_trip(tiny, tmp_path):
    reader = gguf_reader(tmp_path, tiny)
    fields = {key: reader.get_field(key).contents() for key in reader.fields if key.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "glm4"
    assert len(fields["tokenizer.ggml.tokens"]) == 4096 and len(fields["tokenizer.ggml.merges"]) == 4096 - 256 - 17
    types = fields["tokenizer.ggml.token_type"]
    assert set(types[:4079]) == {gguf.TokenType.NORMAL} and set(types[4079:]) == {gguf.TokenType.CONTROL}
    assert fields["tokenizer.ggml.eos_token_id"] == 4079 and fields["tokenizer.ggml.padding_token_id"] == 4079
    assert "tokenizer.ggml.bos_token_id" not in fields
    rebuilt = FlintTokenizer.from_gguf(reader)
    assert_equivalent(tiny, rebuilt, SAMPLES)

    @settings(max_examples=150, deadline=None)
    @given(text=MIXED_TEXT)
    def same_ids(text):
        assert rebuilt.encode(text) == tiny.encode(text)

    same_ids()


def test_gguf_round_trip_of_hugging_face_tokenizer_padded_to_model_rows(hf_tokenizer, tmp_path):
    reader = gguf_reader(tmp_path, hf_tokenizer, vocab_size=320)
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    assert len(tokens) == 320 and tokens[-1] == "[PAD319]"
    assert reader.get_field("tokenizer.ggml.token_type").contents()[290] == gguf.TokenType.USER_DEFINED
    assert_equivalent(hf_tokenizer, FlintTokenizer.from_gguf(reader), SAMPLES)


def test_gguf_keeps_a_special_token_in_the_middle_of_the_ids(tiny, tmp_path):
    vocab = {char: byte for byte, char in enumerate(byte_to_char())}
    vocab["Ġt"] = 257  # id 256 is the special token below
    backend = bpe.assemble_backend(vocab, [("Ġ", "t")], [(256, "<|endoftext|>", True)], glm4_pre_tokenizer())
    tok = FlintTokenizer(backend, eos_token="<|endoftext|>")
    assert tok.token_id("<|endoftext|>") == 256 and tok.encode(" t<|endoftext|>") == [257, 256]
    assert_equivalent(tok, FlintTokenizer.from_gguf(gguf_reader(tmp_path, tok)), SAMPLES)


def test_gguf_with_other_tokenizer_model_is_refused(tmp_path):
    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(str(path), arch="flint")
    writer.add_tokenizer_model("llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="llama"):
        FlintTokenizer.from_gguf(gguf.GGUFReader(str(path)))
