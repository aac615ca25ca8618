"""Chat prompt rendering with Jinja2, the way Hugging Face renders chat templates.

Templates run in an immutable sandbox with HF's globals (`raise_exception`, `strftime_now`) and a
`tojson` filter that keeps non-ASCII. Tool-call `arguments` given as a JSON string are parsed before
rendering (invalid JSON becomes {}); every template failure surfaces as a ValueError.
`continue_final_message` leaves the last message open (the model goes on writing it), as
transformers' `apply_chat_template` does: the text ends where that message's text does.
"""

import json
from datetime import datetime
from functools import lru_cache
from importlib import resources

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_RESOURCE = "chat_template.jinja"


def default_chat_template() -> str:
    """Flint's own template (the GLM-4.7 format), shipped with the package."""
    return resources.files(__package__).joinpath(TEMPLATE_RESOURCE).read_text(encoding="utf-8")


def render_chat(
    template: str,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **template_kwargs,
) -> str:
    """Renders OpenAI-style `messages` into prompt text; kwargs (e.g. `enable_thinking`) go to the template."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    try:
        text = _compile(template).render(
            messages=[_with_parsed_arguments(message) for message in messages],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except (TemplateError, TypeError, ValueError) as error:
        raise ValueError(f"chat template failed: {error}") from error
    return _open_final_message(text, messages) if continue_final_message else text


def _open_final_message(text: str, messages: list[dict]) -> str:
    """`text` cut right after the last message's own text (what a template writes after it, an
    end-of-turn token, goes), keeping its trailing whitespace where the template kept it."""
    if not messages:
        raise ValueError("continue_final_message needs a message to continue")
    final = _final_text(messages[-1].get("content"))
    stripped, kept = final.strip(), final.lstrip()
    at = text.rfind(stripped)
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the final message's text")
    return text[:at + len(kept if text.startswith(kept, at) else stripped)]


def _final_text(content) -> str:
    """The text of a message's `content` that continuing it extends (of a list: its last text part)."""
    if content is None or isinstance(content, str):
        return content or ""
    for part in reversed(content):
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            return part["text"]
    raise ValueError("continue_final_message: the final message has no text to continue")


@lru_cache(maxsize=8)
def _compile(template: str) -> Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except TemplateError as error:
        raise ValueError(f"chat template does not compile: {error}") from error


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """HF's `tojson`: json.dumps keeping non-ASCII; our template asks for compact separators itself."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _with_parsed_arguments(message: dict) -> dict:
    """A copy of `message` whose tool calls carry `arguments` as a dict."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls:
        return message
    parsed = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            function = call["function"]
            call = {**call, "function": {**function, "arguments": _parse_arguments(function.get("arguments"))}}
        elif isinstance(call, dict) and "arguments" in call:
            call = {**call, "arguments": _parse_arguments(call["arguments"])}
        parsed.append(call)
    return {**message, "tool_calls": parsed}


def _parse_arguments(arguments):
    if not isinstance(arguments, str):
        return arguments if arguments is not None else {}
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
