"""Bounds checked before any expensive work, so hostile input is a cheap 400, never a 500 or a stall.

- JSON nesting: at most MAX_JSON_DEPTH levels, for the body and for JSON carried inside strings
  (tool-call `arguments`), checked before decoding (deeper input would hit Python's recursion limit).
- Prompt text: a text of c characters has at least c / max_chars_per_token tokens, so a prompt that
  cannot fit `--max-model-len` is refused without tokenizing it.
"""

from __future__ import annotations

import re

import numpy as np

from flint_sched.api.errors import APIError, bad_request

MAX_JSON_DEPTH = 64
MAX_CHOICES_PER_REQUEST = 1024          # prompts x n of one /v1/completions request
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1
_CHUNK_BYTES = 1 << 20


def json_depth(text: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (an estimate for invalid JSON)."""
    outside_strings = np.frombuffer(_JSON_STRING.sub(b"", text), np.uint8)
    depth, deepest = 0, 0
    for start in range(0, len(outside_strings), _CHUNK_BYTES):
        running = np.cumsum(_BRACKET_STEP[outside_strings[start:start + _CHUNK_BYTES]], dtype=np.int64) + depth
        if len(running):
            deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest


def check_json_depth(text: bytes | str, what: str = "the request body", param: str | None = None) -> None:
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and json_depth(data) > MAX_JSON_DEPTH:
        raise bad_request(f"{what} nests JSON more than {MAX_JSON_DEPTH} levels deep", param)


def check_tool_call_arguments(messages) -> None:
    """Tool-call `arguments` strings of the history are parsed as JSON by the chat template."""
    for i, message in enumerate(messages):
        for j, call in enumerate(message.tool_calls or ()):
            if isinstance(call.function.arguments, str):
                check_json_depth(call.function.arguments, "tool-call arguments",
                                 f"messages[{i}].tool_calls[{j}].function.arguments")


def max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters of text one token stands for (special tokens included)."""
    longest = max((len(content) for content in tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)
    if tokenizer.token_bytes_table() is None:
        longest *= 4            # NOTE: a normalizer may shrink text before it is split; stay on the safe side
    return max(longest, 1)


def too_long(num_tokens: int, max_model_len: int, param: str | None = None) -> APIError:
    return bad_request(f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                       f"{num_tokens}", param)


def check_text_fits(text: str, chars_per_token: int, max_model_len: int, param: str | None = None) -> None:
    """400 when `text` surely has max_model_len tokens or more, without tokenizing it."""
    at_least = -(-len(text) // chars_per_token)
    if at_least >= max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                          f"at least {at_least} ({len(text)} characters)", param)


def kept_prompt_tokens(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """vLLM's `truncate_prompt_tokens`: None keeps the whole prompt; k >= 1 keeps its last k tokens
    (left truncation); -1 keeps the last max_model_len. 400 for anything else."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if not 1 <= k <= max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the maximum context "
                          f"length), got {k}", "truncate_prompt_tokens")
    return k
