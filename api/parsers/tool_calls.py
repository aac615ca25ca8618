"""GLM-4.7 tool calls (`--tool-call-parser glm47`, alias `glm45`): text around `<tool_call>NAME(<arg_key>K
</arg_key><arg_value>V</arg_value>)*</tool_call>`. Only `</arg_key>` ends a key, only `</arg_value>` a value;
the end of output ends a call, which keeps its complete pairs. Streamed `arguments` concatenate per index to
exactly `parse()`'s JSON, except that a repeated key is sent each time (same object: last wins) and a string
value cut off by the end of output is sent and closed rather than dropped."""

import json
import uuid
from dataclasses import dataclass, field

from flint_sched.api.parsers.schema_types import convert_value, is_plain_string, tool_param_types
from flint_sched.api.parsers.tags import find_first, next_tag, without_held_suffix

TOOL_CALL_PARSER_NAMES = ("glm47", "glm45")
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"

_TEXT, _NAME, _BETWEEN, _KEY, _BEFORE_VALUE, _VALUE = "text", "name", "between", "key", "before_value", "value"
_TAGS_ENDING = {
    _TEXT: (CALL_START,),
    _NAME: (KEY_START, CALL_END),
    _BETWEEN: (KEY_START, CALL_END),
    _KEY: (KEY_END,),
    _BEFORE_VALUE: (VALUE_START, KEY_START, CALL_END),
    _VALUE: (VALUE_END,),
}
_STATE_AFTER = {CALL_START: _NAME, KEY_START: _KEY, CALL_END: _TEXT, KEY_END: _BEFORE_VALUE,
                VALUE_START: _VALUE, VALUE_END: _BETWEEN}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True)
class ToolParseResult:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolStreamDelta:
    """Content text and OpenAI-shaped `delta.tool_calls` entries (headers, argument fragments)."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def normalize_content(text: str, has_tool_calls: bool) -> str | None:
    """The final `content` from all text outside the calls; also turns the concatenated streamed
    content into `parse()`'s content (the stream cannot know in advance to drop leading spaces)."""
    return (text.strip() if has_tool_calls else text) or None


def arguments_json(pairs: list[tuple[str, object]]) -> str:
    return json.dumps(dict(pairs), ensure_ascii=False)


class ToolCallParser:
    """One choice's tool calls: `parse` for a whole content text, `feed`/`finish` for a stream.
    Calls to tools not in `tools` are dropped; `parallel_tool_calls=False` keeps only the first."""

    def __init__(self, tools: list | None, parallel_tool_calls: bool = True):
        self.param_types = tool_param_types(tools)
        self.parallel_tool_calls = parallel_tool_calls
        self.num_calls = 0
        self._state = _TEXT
        self._buffer = ""
        self._pending_space = ""
        self._content_started = False
        self._content: list[str] = []
        self._deltas: list[dict] = []
        self._start_call()

    def accepts(self, name: str, num_calls: int) -> bool:
        return name in self.param_types and (self.parallel_tool_calls or num_calls == 0)

    def parse(self, text: str) -> ToolParseResult:
        content, calls, pos = [], [], 0
        while (start := text.find(CALL_START, pos)) != -1:
            content.append(text[pos:start])
            name, pairs, pos = _read_call(text, start + len(CALL_START))
            if self.accepts(name, len(calls)):
                types = self.param_types[name]
                typed = [(key, convert_value(raw, types.get(key, frozenset()))) for key, raw in pairs]
                calls.append(ToolCall(new_tool_call_id(), name, arguments_json(typed)))
        content.append(text[pos:])
        return ToolParseResult(normalize_content("".join(content), bool(calls)), calls)

    def feed(self, chunk: str) -> ToolStreamDelta:
        self._buffer += chunk
        while True:
            body, tag, self._buffer = next_tag(self._buffer, _TAGS_ENDING[self._state])
            self._on_text(body)
            if tag is None:
                return self._take_delta()
            self._on_tag(tag)

    def finish(self) -> ToolStreamDelta:
        """Flush at the end of generation: held-back content, or the cut-off call."""
        if self._state == _TEXT:
            self._on_text(self._buffer)
        elif self._state == _NAME:
            self._resolve_name()
        if self._state == _VALUE and self._value_prefix_sent:
            self._send_arguments('"')
        if self._state != _TEXT:
            self._close_call()
        self._buffer, self._state = "", _TEXT
        if not self.num_calls:
            self._emit_content(self._pending_space)
        self._pending_space = ""
        return self._take_delta()

    def _start_call(self) -> None:
        self._name = self._key = self._value = ""
        self._index: int | None = None
        self._types: dict[str, frozenset[str]] = {}
        self._arguments_open = self._value_prefix_sent = self._value_streams = False

    def _on_text(self, text: str) -> None:
        if not text:
            return
        if self._state == _TEXT:
            self._on_content(text)
        elif self._state == _NAME:
            self._name += text
        elif self._state == _KEY:
            self._key += text
        elif self._state == _VALUE and self._index is not None:
            if self._value_streams:
                self._send_value_prefix()
                self._send_arguments(json.dumps(text, ensure_ascii=False)[1:-1])
            else:
                self._value += text

    def _on_tag(self, tag: str) -> None:
        if tag == CALL_START:
            self._start_call()
        elif self._state == _NAME:
            self._resolve_name()
        if tag == CALL_END:
            self._close_call()
        elif tag == KEY_START:
            self._key = ""
        elif tag == KEY_END:
            self._key = self._key.strip()
        elif tag == VALUE_START:
            self._value, self._value_prefix_sent = "", False
            self._value_streams = is_plain_string(self._key_types())
        elif tag == VALUE_END:
            self._close_value()
        self._state = _STATE_AFTER[tag]

    def _on_content(self, text: str) -> None:
        core = text.rstrip()
        if not core:
            self._pending_space += text
            return
        if self._content_started or not self.num_calls:
            self._emit_content(self._pending_space + core)
        else:
            self._emit_content(core.lstrip())
        self._content_started = True
        self._pending_space = text[len(core):]

    def _resolve_name(self) -> None:
        name = self._name.strip()
        if not self.accepts(name, self.num_calls):
            return
        self._index, self._types = self.num_calls, self.param_types[name]
        self.num_calls += 1
        header = {"index": self._index, "id": new_tool_call_id(), "type": "function", "function": {"name": name}}
        self._deltas.append(header)

    def _key_types(self) -> frozenset[str]:
        return self._types.get(self._key, frozenset())

    def _send_value_prefix(self) -> None:
        if not self._value_prefix_sent:
            self._send_arguments(f'{self._separator()}{json.dumps(self._key, ensure_ascii=False)}: "')
            self._value_prefix_sent = True

    def _close_value(self) -> None:
        if self._index is None:
            return
        if self._value_streams:
            self._send_value_prefix()
            self._send_arguments('"')
            return
        key = json.dumps(self._key, ensure_ascii=False)
        value = json.dumps(convert_value(self._value, self._key_types()), ensure_ascii=False)
        self._send_arguments(f"{self._separator()}{key}: {value}")

    def _close_call(self) -> None:
        if self._index is not None:
            self._send_arguments("}" if self._arguments_open else "{}")
        self._index = None

    def _separator(self) -> str:
        separator = ", " if self._arguments_open else "{"
        self._arguments_open = True
        return separator

    def _send_arguments(self, fragment: str) -> None:
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last["index"] == self._index and "arguments" in last["function"]:
            last["function"]["arguments"] += fragment
        else:
            self._deltas.append({"index": self._index, "function": {"arguments": fragment}})

    def _emit_content(self, text: str) -> None:
        self._content.append(text)

    def _take_delta(self) -> ToolStreamDelta:
        delta = ToolStreamDelta("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return delta


def _read_call(text: str, pos: int) -> tuple[str, list[tuple[str, str]], int]:
    """(name, complete (key, raw value) pairs, end position) of the call whose name starts at `pos`."""
    hit = _tag_after(text, (KEY_START, CALL_END), pos)
    if hit is None:
        return without_held_suffix(text[pos:], (KEY_START, CALL_END)).strip(), [], len(text)
    name, pairs = text[pos:hit[0]].strip(), []
    _, tag, pos = hit
    while tag == KEY_START:
        key_end = text.find(KEY_END, pos)
        after_key = key_end + len(KEY_END)
        hit = None if key_end == -1 else _tag_after(text, (VALUE_START, KEY_START, CALL_END), after_key)
        if hit is None:
            return name, pairs, len(text)
        key, (_, tag, pos) = text[pos:key_end].strip(), hit
        if tag == VALUE_START:
            value_end = text.find(VALUE_END, pos)
            if value_end == -1:
                return name, pairs, len(text)
            pairs.append((key, text[pos:value_end]))
            hit = _tag_after(text, (KEY_START, CALL_END), value_end + len(VALUE_END))
            if hit is None:
                return name, pairs, len(text)
            _, tag, pos = hit
    return name, pairs, pos


def _tag_after(text: str, tags: tuple[str, ...], start: int) -> tuple[int, str, int] | None:
    """(start, tag, end) of the earliest of `tags` at or after `start`."""
    hit = find_first(text, tags, start)
    return None if hit is None else (hit[0], hit[1], hit[0] + len(hit[1]))
