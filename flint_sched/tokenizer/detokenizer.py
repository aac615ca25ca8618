"""Incremental detokenization: ids in one at a time, text out, never half a UTF-8 character.

Invariant: the concatenation of every `push` result and the final `flush` equals
`tokenizer.decode(all_ids, skip_special_tokens)`. Byte-level tokenizers go through the id -> bytes
table and an incremental UTF-8 decoder (work proportional to the token's bytes); any other tokenizer
re-decodes only a short window of recent ids (vLLM's prefix and read offsets).
"""

import codecs

from flint_sched.tokenizer.tokenizer import FlintTokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: FlintTokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skipped_ids = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._byte_table = tokenizer.token_bytes_table()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._window = _DecodeWindow(tokenizer)

    def push(self, token_id: int) -> str:
        """The text that token `token_id` completes (often "", e.g. inside a multi-byte character)."""
        if token_id in self._skipped_ids:
            return ""
        if self._byte_table is None:
            return self._window.push(token_id)
        in_range = 0 <= token_id < len(self._byte_table)
        return self._utf8.decode(self._byte_table[token_id] if in_range else b"")

    def extend(self, token_ids: list[int]) -> str:
        return "".join(self.push(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Whatever is held back at the end of the sequence; incomplete bytes become U+FFFD."""
        if self._byte_table is None:
            return self._window.flush()
        return self._utf8.decode(b"", final=True)


class _DecodeWindow:
    """vLLM-style windowed decoding for tokenizers whose ids are not plain byte strings.

        ids:  ... | prefix_offset ... read_offset | ... newest
                    `-- already emitted, kept as context so the next delta decodes in place

    A delta is emitted once decoding the window grows the text and does not end in U+FFFD.
    """

    def __init__(self, tokenizer: FlintTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(self.prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        return self._advance(text) if len(text) > len(self.prefix_text) else ""

    def _advance(self, text: str) -> str:
        delta = text[len(self.prefix_text):]
        del self.ids[:self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.prefix_text = self.tokenizer.decode(self.ids)
        return delta
