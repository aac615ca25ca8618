"""`tools` / `tool_choice`: validation (the 400s GLM47.md lists) and enforcement of required / named.

Enforcement forces the model into a call: after the generation prompt come `</think>` (if it leaves
the model reasoning) and `<tool_call>`, plus the name (and `<arg_key>` if the function has required
parameters) when only one function is allowed. The parser reads that forced start before the output,
so the call parses as if the model wrote it. `required` with several tools leaves the name free.
"""

from __future__ import annotations

from dataclasses import dataclass

from flint_sched.api.errors import bad_request
from flint_sched.api.parsers.reasoning import THINK_END, THINK_START
from flint_sched.api.parsers.tool_calls import CALL_START, KEY_START
from flint_sched.api.protocol import tool_dicts
from flint_sched.api.protocol_chat import ChatCompletionRequest, NamedToolChoice

ASSISTANT_HEADER = "<|assistant|>"
DEFAULT_TOOL_CALL_PARSER = "glm47"     # the model's own call format, for forced calls without the flag
MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPolicy:
    """What one request does with tools: what the prompt shows, what the parser may return."""

    mode: str                              # "none", "auto", "required" or "named"
    template_tools: list[dict] | None      # rendered into the prompt
    parser_tools: list[dict] | None        # calls the parser may return; None: no tool parsing
    tool_call_parser: str | None
    parallel_tool_calls: bool
    forced_function: dict | None = None    # the one function a forced call names

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")

    def forced_call_start(self) -> str:
        """The start of the call the model is forced into ("" when nothing is forced)."""
        if not self.forces_call:
            return ""
        if self.forced_function is None:
            return CALL_START
        parameters = self.forced_function.get("parameters") or {}
        needs_argument = bool(parameters.get("required")) if isinstance(parameters, dict) else False
        return CALL_START + self.forced_function["name"] + (KEY_START if needs_argument else "")

    def finish_reason(self, engine_reason: str, has_tool_calls: bool) -> str:
        """`tool_calls` when a call was returned and generation ended normally; a named choice: `stop`."""
        if engine_reason == "stop" and has_tool_calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


@dataclass(frozen=True)
class ToolFlags:
    """The server flags that govern tools."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


def tool_policy(request: ChatCompletionRequest, flags: ToolFlags) -> ToolPolicy:
    """Validates `tools` and `tool_choice` (APIError 400) and says how the request uses them."""
    tools = tool_dicts(request.tools)
    if tools is not None and not tools:
        raise bad_request("`tools` must not be empty; leave it out to send no tools", "tools")
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str) and choice not in MODES:
        raise bad_request(f"unknown tool_choice {choice!r}: use none, auto, required or "
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if choice != "none" and not tools:
        raise bad_request("tool_choice other than \"none\" needs `tools`", "tool_choice")
    parallel = request.parallel_tool_calls
    if choice == "none":
        shown = None if flags.exclude_tools_when_tool_choice_none else tools
        return ToolPolicy("none", shown, None, None, parallel)
    if choice == "auto":
        if not (flags.enable_auto_tool_choice and flags.tool_call_parser):
            raise bad_request('"auto" tool choice requires the server flags --enable-auto-tool-choice and '
                              "--tool-call-parser", "tool_choice")
        return ToolPolicy("auto", tools, tools, flags.tool_call_parser, parallel)
    parser = flags.tool_call_parser or DEFAULT_TOOL_CALL_PARSER
    if choice == "required":
        only = tools[0]["function"] if len(tools) == 1 else None
        return ToolPolicy("required", tools, tools, parser, parallel, only)
    return _named(choice, tools, parser)


def _named(choice: NamedToolChoice, tools: list[dict], parser: str) -> ToolPolicy:
    name = choice.function.name
    chosen = [tool for tool in tools if tool["function"]["name"] == name]
    if not chosen:
        raise bad_request(f"tool_choice names function {name!r}, which is not among `tools`", "tool_choice")
    return ToolPolicy("named", tools, chosen[:1], parser, False, chosen[0]["function"])


def ends_in_reasoning(prompt: str) -> bool:
    """Whether generation starts inside reasoning: the last assistant header opened `<think>`
    and did not close it."""
    tail = prompt[prompt.rfind(ASSISTANT_HEADER) + 1:] if ASSISTANT_HEADER in prompt else prompt
    return tail.rfind(THINK_START) > tail.rfind(THINK_END)


def force_call(policy: ToolPolicy, prompt: str) -> tuple[str, str]:
    """(text appended to the prompt, text the parser reads before the output) for a forced call."""
    start = policy.forced_call_start()
    if not start:
        return "", ""
    return (THINK_END if ends_in_reasoning(prompt) else "") + start, start
