"""The byte-level alphabet shared by the generated BPE, the GGUF reader and the detokenizer.

Each of the 256 bytes has one printable stand-in character (GPT-2's scheme: printable Latin-1
bytes stand for themselves, the rest map to U+0100 upwards), so a token string is a byte string.
`token_bytes` mirrors the `tokenizers` ByteLevel decoder exactly, including its fallback to the
raw UTF-8 of a token that holds a character outside the alphabet.
"""

from functools import cache

from tokenizers import Regex, pre_tokenizers

# GLM-4's pre-tokenization split (the cl100k pattern): contractions, letter runs with one leading
# non-letter, numbers of up to three digits, punctuation runs, newline runs, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@cache
def byte_to_char() -> tuple[str, ...]:
    """The stand-in character of each byte value, indexed by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = [""] * 256
    for byte in printable:
        chars[byte] = chr(byte)
    next_code = 256
    for byte in range(256):
        if not chars[byte]:
            chars[byte] = chr(next_code)
            next_code += 1
    return tuple(chars)


@cache
def _decode_table() -> tuple[str, dict[int, int]]:
    chars = byte_to_char()
    return "".join(chars), {ord(char): byte for byte, char in enumerate(chars)}


def token_bytes(token: str) -> bytes:
    """The bytes the ByteLevel decoder produces for one token string."""
    alphabet, table = _decode_table()
    if token.strip(alphabet):
        return token.encode("utf-8")
    return token.translate(table).encode("latin-1")


def glm4_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of the generated tokenizer (llama.cpp calls it `glm4`)."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
