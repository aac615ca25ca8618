"""Output parsing for one choice: the reasoning split first, then tool calls in the content.

`OutputParser.parse(text)` gives the final message fields. The `feed`/`finish` deltas of a stream
concatenate to the same result: reasoning exactly (None ↔ ""), content after `normalize_content`,
and per-index `arguments` exactly (the two exceptions are in tool_calls.py's docstring).
"""

from dataclasses import dataclass, field

from flint_sched.api.parsers.reasoning import REASONING_PARSER_NAMES, ReasoningDelta, ReasoningParser
from flint_sched.api.parsers.tool_calls import (
    TOOL_CALL_PARSER_NAMES,
    ToolCall,
    ToolCallParser,
    ToolParseResult,
    ToolStreamDelta,
    normalize_content,
)

__all__ = [
    "REASONING_PARSER_NAMES", "TOOL_CALL_PARSER_NAMES", "OutputDelta", "OutputParser", "ParsedOutput",
    "ReasoningDelta", "ReasoningParser", "ToolCall", "ToolCallParser", "ToolParseResult",
    "ToolStreamDelta", "make_output_parser", "normalize_content",
]


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class OutputParser:
    """Reasoning parser (optional) -> tool-call parser (optional) for one choice's output text."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self.reasoning = reasoning
        self.tools = tools

    @property
    def has_tool_calls(self) -> bool:
        """Whether the stream so far has sent a tool call (for `finish_reason`)."""
        return self.tools is not None and self.tools.num_calls > 0

    def parse(self, text: str) -> ParsedOutput:
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        if self.tools is None:
            return ParsedOutput(reasoning, content or None, [])
        result = self.tools.parse(content)
        return ParsedOutput(reasoning, result.content, result.tool_calls)

    def feed(self, chunk: str) -> OutputDelta:
        split = self.reasoning.feed(chunk) if self.reasoning else ReasoningDelta(content=chunk)
        return self._through_tools(split, final=False)

    def finish(self) -> OutputDelta:
        split = self.reasoning.finish() if self.reasoning else ReasoningDelta()
        return self._through_tools(split, final=True)

    def _through_tools(self, split: ReasoningDelta, final: bool) -> OutputDelta:
        if self.tools is None:
            return OutputDelta(split.reasoning, split.content)
        delta = self.tools.feed(split.content)
        if final:
            last = self.tools.finish()
            delta = ToolStreamDelta(delta.content + last.content, delta.tool_calls + last.tool_calls)
        return OutputDelta(split.reasoning, delta.content, delta.tool_calls)


def make_output_parser(reasoning_parser: str | None, tool_call_parser: str | None, *, thinking: bool = True,
                       tools: list | None = None, parallel_tool_calls: bool = True) -> OutputParser:
    """An OutputParser from the server flags and one request; no tool parsing without tools."""
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSER_NAMES:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {REASONING_PARSER_NAMES}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSER_NAMES:
        raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; known: {TOOL_CALL_PARSER_NAMES}")
    reasoning = ReasoningParser(thinking) if reasoning_parser else None
    tool_parser = ToolCallParser(tools, parallel_tool_calls) if tool_call_parser and tools else None
    return OutputParser(reasoning, tool_parser)
