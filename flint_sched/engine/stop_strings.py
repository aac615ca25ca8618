"""Stop strings on streamed text: never emit past a stop string, hold back a possible start of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringChecker:
    """Fed the decoded text piece by piece; returns what is safe to emit.

    Held back: the longest suffix of the text that is a proper prefix of some stop string. On a
    match (the stop string completed first), the text before it is emitted and it is dropped.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.num_emitted = 0
        self.matched: str | None = None

    def feed(self, new_text: str) -> str:
        if self.matched is not None:
            return ""
        self.text += new_text
        if not self.stops:
            return self._emit_to(len(self.text))
        # the stop string completed first wins (ties: the longer one), whatever the chunking
        hit = min(((i + len(s), i, s) for s in self.stops if (i := self.text.find(s, self.num_emitted)) >= 0),
                  default=None)
        if hit is not None:
            self.matched = hit[2]
            return self._emit_to(hit[1])
        return self._emit_to(len(self.text) - self._held_back())

    def flush(self) -> str:
        """At the end of generation (no stop string matched), the held-back text is emitted."""
        return "" if self.matched is not None else self._emit_to(len(self.text))

    def _held_back(self) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.text) - self.num_emitted), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _emit_to(self, end: int) -> str:
        out = self.text[self.num_emitted:end]
        self.num_emitted = max(self.num_emitted, end)
        return out
