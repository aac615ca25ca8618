"""FlintTokenizer: one class over `tokenizers.Tokenizer` for generated and real Hugging Face tokenizers.

Special tokens are looked up by content among the added tokens, never by fixed id. `encode` adds no
BOS and turns special-token text into its single id; `decode` accepts any id below `vocab_size`.
Stop ids are the GLM-4.7 stop tokens present, then the configured eos token if it is another one.
"""

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders

from flint_sched.tokenizer.byte_level import token_bytes
from flint_sched.tokenizer.piece_cache import PieceCache

GLM_STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class FlintTokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs: stop/pad ids, special ids, the chat template."""

    def __init__(
        self,
        backend: Tokenizer,
        chat_template: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        bos_token: str | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token = bos_token
        self._vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._vocab.values(), default=-1) + 1
        added = sorted(backend.get_added_tokens_decoder().items())
        self.special_tokens = {token.content: token_id for token_id, token in added if token.special}
        self.special_ids = frozenset(self.special_tokens.values())
        self.eos_token_ids = self._stop_ids()
        self.eos_token_id = self._vocab.get(eos_token, self.eos_token_ids[0] if self.eos_token_ids else None)
        self.pad_token_id = self._vocab.get(pad_token) if pad_token is not None else None
        self.bos_token_id = self._vocab.get(bos_token) if bos_token is not None else None
        self._byte_table: list[bytes] | None = None
        self._pieces = PieceCache(backend)

    def __reduce__(self):
        """Pickled as what it was built from (the API process gets the engine's tokenizer this way)."""
        return type(self), (self.backend, self.chat_template, self.eos_token, self.pad_token, self.bos_token)

    @classmethod
    def from_file(cls, path: str | Path) -> "FlintTokenizer":
        """Loads a `tokenizer.json`, or a directory holding one (+ `tokenizer_config.json`, `chat_template.jinja`)."""
        path = Path(path)
        if path.is_dir():
            tokenizer_file, config_dir = path / TOKENIZER_FILE, path
        else:
            tokenizer_file, config_dir = path, (path.parent if path.name == TOKENIZER_FILE else None)
        if not tokenizer_file.is_file():
            raise ValueError(f"tokenizer file not found: {tokenizer_file}")
        try:
            backend = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises plain Exception for parse errors
            raise ValueError(f"cannot load tokenizer {tokenizer_file}: {error}") from error
        config = _read_config(config_dir / CONFIG_FILE) if config_dir else {}
        chat_template = _pick_chat_template(config.get("chat_template"))
        if config_dir and (config_dir / TEMPLATE_FILE).is_file():
            chat_template = (config_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
        return cls(
            backend,
            chat_template=chat_template,
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            bos_token=_token_content(config.get("bos_token")),
        )

    @classmethod
    def from_gguf(cls, reader) -> "FlintTokenizer":
        """Rebuilds the tokenizer stored under `tokenizer.ggml.*` of a `gguf.GGUFReader`."""
        from flint_sched.tokenizer.gguf_vocab import read_gguf_tokenizer

        return read_gguf_tokenizer(reader)

    def save(self, directory: str | Path) -> None:
        """Writes `tokenizer.json` and `tokenizer_config.json` as Hugging Face ships them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / TOKENIZER_FILE), pretty=True)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        for key, token in (("bos_token", self.bos_token), ("eos_token", self.eos_token), ("pad_token", self.pad_token)):
            if token is not None:
                config[key] = token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        text = json.dumps(config, ensure_ascii=False, indent=2) + "\n"
        (directory / CONFIG_FILE).write_text(text, encoding="utf-8")

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no BOS; special-token text becomes its id), pieces seen before reused
        (piece_cache.py). Off the GIL while the tokenizer works (~9 ms for a 5K-token agent turn on a
        CPU core, during which the event loop and the step thread would wait)."""
        return self._pieces.encode(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, content: str) -> int:
        """The id of a token given by its text, e.g. `token_id("<|user|>")`."""
        token_id = self._vocab.get(content)
        if token_id is None:
            raise KeyError(f"token {content!r} is not in the vocabulary")
        return token_id

    def _stop_ids(self) -> tuple[int, ...]:
        ids = [self._vocab[token] for token in GLM_STOP_TOKENS if token in self._vocab]
        if self.eos_token in self._vocab and self._vocab[self.eos_token] not in ids:
            ids.append(self._vocab[self.eos_token])
        return tuple(ids)

    def token_bytes_table(self) -> list[bytes] | None:
        """The bytes each id decodes to (b"" for unknown ids), or None unless the decoder is ByteLevel.

        Decoding a sequence is then exactly UTF-8 decoding (with replacement) of the joined bytes.
        """
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None
        if self._byte_table is None:
            table = [b""] * self.vocab_size
            for content, token_id in self._vocab.items():
                table[token_id] = token_bytes(content)
            self._byte_table = table
        return self._byte_table


def _read_config(config_file: Path) -> dict:
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot parse {config_file}: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"cannot parse {config_file}: expected a JSON object")
    return config


def _pick_chat_template(value) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} of which we take "default"."""
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def _token_content(value) -> str | None:
    """A config token is a string or a serialized AddedToken ({"content": ...})."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
