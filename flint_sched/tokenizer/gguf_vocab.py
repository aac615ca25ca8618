"""FlintTokenizer <-> GGUF metadata under llama.cpp's keys (`tokenizer.ggml.*`, model "gpt2").

Entry i of `tokenizer.ggml.tokens` is id i. Special added tokens are CONTROL, other added tokens
USER_DEFINED, ids the tokenizer lacks "[PAD{i}]" UNUSED. Reading back yields a tokenizer with the
same ids for every text, the same stop ids and the same chat template.
"""

import json

import gguf
from tokenizers import pre_tokenizers

from flint_sched.tokenizer.bpe import assemble_backend
from flint_sched.tokenizer.byte_level import glm4_pre_tokenizer
from flint_sched.tokenizer.tokenizer import FlintTokenizer

GGUF_MODEL = "gpt2"


def _gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# llama.cpp pre-tokenizer names we can both name and rebuild.
PRE_TOKENIZERS = {"glm4": glm4_pre_tokenizer, "gpt-2": _gpt2_pre_tokenizer, "default": _gpt2_pre_tokenizer}


def write_gguf_tokenizer(writer: gguf.GGUFWriter, tokenizer: FlintTokenizer, vocab_size: int | None = None) -> None:
    """Adds the tokenizer's metadata to `writer`; `vocab_size` pads the token list to the model's rows."""
    backend = tokenizer.backend
    model = json.loads(backend.model.__getstate__())
    if model.get("type") != "BPE" or tokenizer.token_bytes_table() is None:
        raise ValueError("GGUF tokenizer metadata needs a byte-level BPE tokenizer")
    if backend.normalizer is not None:
        raise ValueError("GGUF 'gpt2' tokenizers cannot carry a normalizer")
    num_tokens = max(vocab_size or 0, tokenizer.vocab_size)
    tokens = [f"[PAD{token_id}]" for token_id in range(num_tokens)]
    token_types = [gguf.TokenType.UNUSED] * num_tokens
    for content, token_id in backend.get_vocab(with_added_tokens=True).items():
        tokens[token_id], token_types[token_id] = content, gguf.TokenType.NORMAL
    for token_id, token in backend.get_added_tokens_decoder().items():
        token_types[token_id] = gguf.TokenType.CONTROL if token.special else gguf.TokenType.USER_DEFINED
    merges = []
    for left, right in model["merges"]:
        if " " in left or " " in right:
            raise ValueError(f"merge ({left!r}, {right!r}) cannot be written space-separated")
        merges.append(f"{left} {right}")

    writer.add_tokenizer_model(GGUF_MODEL)
    writer.add_tokenizer_pre(_pre_tokenizer_name(backend.pre_tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types([int(token_type) for token_type in token_types])
    writer.add_token_merges(merges)
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)
    for add_id, content in ((writer.add_eot_token_id, "<|user|>"), (writer.add_eom_token_id, "<|observation|>")):
        if content in tokenizer.special_tokens:
            add_id(tokenizer.special_tokens[content])
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)


def read_gguf_tokenizer(reader: gguf.GGUFReader) -> FlintTokenizer:
    """Rebuilds the tokenizer that `write_gguf_tokenizer` (or llama.cpp's converter) stored."""
    model = _field(reader, gguf.Keys.Tokenizer.MODEL)
    if model != GGUF_MODEL:
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only {GGUF_MODEL!r})")
    pre_name = _field(reader, gguf.Keys.Tokenizer.PRE, "default")
    if pre_name not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre_name!r} is not supported (known: {sorted(PRE_TOKENIZERS)})")
    tokens = _field(reader, gguf.Keys.Tokenizer.LIST)
    token_types = _field(reader, gguf.Keys.Tokenizer.TOKEN_TYPE, [gguf.TokenType.NORMAL] * len(tokens))
    vocab: dict[str, int] = {}
    added: list[tuple[int, str, bool]] = []
    for token_id, (content, token_type) in enumerate(zip(tokens, token_types)):
        if token_type == gguf.TokenType.UNUSED:
            continue
        if token_type in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED):
            added.append((token_id, content, token_type == gguf.TokenType.CONTROL))
        else:
            vocab[content] = token_id
    merges = [tuple(merge.split(" ")) for merge in _field(reader, gguf.Keys.Tokenizer.MERGES, [])]
    if any(len(merge) != 2 for merge in merges):
        raise ValueError("GGUF tokenizer.ggml.merges holds an entry that is not two space-separated tokens")
    try:
        backend = assemble_backend(vocab, merges, added, PRE_TOKENIZERS[pre_name]())
    except Exception as error:  # tokenizers raises plain Exception for inconsistent vocab/merges
        raise ValueError(f"GGUF tokenizer metadata is inconsistent: {error}") from error

    def token_at(key: str) -> str | None:
        token_id = _field(reader, key, None)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    return FlintTokenizer(
        backend,
        chat_template=_field(reader, gguf.Keys.Tokenizer.CHAT_TEMPLATE, None),
        eos_token=token_at(gguf.Keys.Tokenizer.EOS_ID),
        pad_token=token_at(gguf.Keys.Tokenizer.PAD_ID),
        bos_token=token_at(gguf.Keys.Tokenizer.BOS_ID),
    )


_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, default=_MISSING):
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no {key}")
        return default
    return field.contents()


def _pre_tokenizer_name(pre_tokenizer: pre_tokenizers.PreTokenizer | None) -> str:
    """The llama.cpp name of a pre-tokenizer we can rebuild; `trim_offsets` only affects offsets."""
    wanted = _canonical(pre_tokenizer)
    for name, make in PRE_TOKENIZERS.items():
        if _canonical(make()) == wanted:
            return name
    raise ValueError(f"pre-tokenizer has no llama.cpp name: {wanted}")


def _canonical(pre_tokenizer: pre_tokenizers.PreTokenizer | None):
    if pre_tokenizer is None:
        return None
    return json.loads(pre_tokenizer.__getstate__(), object_hook=_without_trim_offsets)


def _without_trim_offsets(node: dict) -> dict:
    return {key: value for key, value in node.items() if key != "trim_offsets"}
