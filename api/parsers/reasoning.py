"""GLM-4.7 reasoning split (`--reasoning-parser glm47`, alias `glm45`). Thinking on: leading whitespace plus
`<think>` is swallowed; output is reasoning until `</think>` (dropped) or `<tool_call>` (kept, starts content).
A `</think>` after the reasoning has ended is dropped from the content too, as vLLM's glm47 parser
does (there the special token is skipped in the text): "a</think>b</think>c" -> reasoning "a",
content "bc". Thinking off: all content. For any chunking, `feed`/`finish` deltas concatenate to
exactly `parse()` (reasoning None <-> ""): trailing whitespace of reasoning is held back until more
reasoning follows, never retracted; a partial `</think>` at the end of content is held back too."""

from dataclasses import dataclass

from flint_sched.api.parsers.tags import next_tag

REASONING_PARSER_NAMES = ("glm47", "glm45")
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
REASONING_ENDS = (THINK_END, TOOL_CALL_START)

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One choice's reasoning split: `parse` for a whole output, `feed`/`finish` for a stream."""

    def __init__(self, thinking: bool = True):
        self.thinking = thinking
        self._state = _START if thinking else _CONTENT
        self._buffer = ""

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a complete output."""
        if not self.thinking:
            return None, text
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            text = stripped[len(THINK_START):]
        reasoning, tag, rest = _split_at_end(text)
        if tag is None:
            return reasoning.rstrip() or None, ""
        content = rest if tag == THINK_END else tag + rest
        return reasoning.rstrip() or None, content.replace(THINK_END, "")

    def feed(self, chunk: str) -> ReasoningDelta:
        self._buffer += chunk
        reasoning = ""
        if self._state == _START:
            self._leave_start(final=False)
        if self._state == _REASONING:
            body, tag, rest = next_tag(self._buffer, REASONING_ENDS)
            reasoning = body.rstrip()
            if tag is None:
                self._buffer = body[len(reasoning):] + rest
            else:
                self._state = _CONTENT
                self._buffer = rest if tag == THINK_END else tag + rest
        content = ""
        if self._state == _CONTENT:
            content = self._content(final=False)
        return ReasoningDelta(reasoning, content)

    def finish(self) -> ReasoningDelta:
        """Flush what was held back at the end of generation."""
        if self._state == _START:
            self._leave_start(final=True)
        if self._state == _REASONING:
            held, self._buffer = self._buffer, ""
            return ReasoningDelta(reasoning=held.rstrip())
        return ReasoningDelta(content=self._content(final=True))

    def _content(self, final: bool) -> str:
        """The buffer as content, every complete `</think>` dropped; unless final, a suffix that may
        still grow into one is held back."""
        if not self.thinking:
            content, self._buffer = self._buffer, ""
            return content
        parts = []
        while True:
            body, tag, rest = next_tag(self._buffer, (THINK_END,))
            parts.append(body)
            self._buffer = rest
            if tag is None:
                break
        if final:
            parts.append(self._buffer)
            self._buffer = ""
        return "".join(parts)

    def _leave_start(self, final: bool) -> None:
        stripped = self._buffer.lstrip()
        if stripped.startswith(THINK_START):
            self._buffer = stripped[len(THINK_START):]
        elif not final and THINK_START.startswith(stripped):
            return
        self._state = _REASONING


def _split_at_end(text: str) -> tuple[str, str | None, str]:
    ends = [(text.find(tag), tag) for tag in REASONING_ENDS if tag in text]
    if not ends:
        return text, None, ""
    index, tag = min(ends)
    return text[:index], tag, text[index + len(tag):]
