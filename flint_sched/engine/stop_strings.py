"""Stop strings on streamed text: never emit past a stop string, hold back a possible start of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringChecker:
    """Fed the decoded text piece by piece; returns what is safe to emit.

    Held back: the longest suffix of the text that is a proper prefix of some stop string. On a
    match (the stop string completed first), the text before it is emitted and it is dropped, or
    with `include` (vLLM's include_stop_str_in_output) emitted too.
    """

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self.pending = ""           # fed, not yet emitted: at most a possible start of a stop string
        self.matched: str | None = None

    def feed(self, new_text: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return new_text
        # Only the held-back text and the new piece are searched (emitted text holds no start of a
        # stop string): O(piece) a token, not O(text). The stop string completed first wins (ties:
        # the longer one), whatever the chunking.
        text = self.pending + new_text
        hit = min(((i + len(s), i, s) for s in self.stops if (i := text.find(s)) >= 0), default=None)
        if hit is not None:
            self.matched, self.pending = hit[2], ""
            return text[:hit[0] if self.include else hit[1]]
        keep = held_suffix_len(text, self.stops)
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of generation (no stop string matched), the held-back text is emitted."""
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out


def held_suffix_len(text: str, prefixes_of: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `prefixes_of`
    (text a stream must hold back: the next piece may complete it). Such a suffix starts with
    the string's first character, so only those positions in the text's tail are tried: one
    `find` per string for text that cannot start one (most tokens)."""
    longest, end = 0, len(text)
    for s in prefixes_of:
        limit = min(len(s) - 1, end)
        start = text.find(s[0], end - limit) if limit > longest else -1
        while start != -1 and end - start > longest:
            if s.startswith(text[start:]):
                longest = end - start
                break
            start = text.find(s[0], start + 1)
    return longest
