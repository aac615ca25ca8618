"""Benchmark requests: `random` (word prompts, or token ids, of sampled lengths), `agent` (multi-turn tool-calling
sessions over one shared system prompt and tool set, the history growing turn by turn) and `file` (JSONL or one
prompt per line). Generators are seeded and do no I/O except `file_requests`. Lengths are in tokens, estimated as
one token per word: the words are common English words, one token each in usual BPE vocabularies.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORDS = tuple("""the of and to in is that it for was on are as with be at by this have from or one had not but
what all were when we there can an your which their said if do will each about how up out them then she many some
so these would other into has more her two like him see time could no make than first been its who now people my
made over did down only way find use may water long little very after words called just where most know get
through back much go good new write our used me man too any day same right look think also around another came
come work three word must because does part even place well such here take why things help put years different
away again off went old number great tell men say small every found still between name should home big give air
line set own under read last never us left end along while might next sound below saw something thought both few
those always looked show large often together asked house world going want school important until form food keep
children feet land side without boy once animals life enough took sometimes four head above kind began almost live
page got earth need far hand high year mother light parts country father let night following picture being study
second eyes soon times story boys since white days ever paper hard near sentence better best across during today
others however sure means knew try told young miles sun ways thing whole hear example heard several change answer
room sea against top turned learn point city play toward five using himself usually""".split())

AGENT_TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"},
                                                        "timeout_s": {"type": "integer"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "max_results": {"type": "integer"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace the contents of a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
]
AGENT_TOOLS_TOKENS = len(json.dumps(AGENT_TOOLS)) // 4
TOKEN_ID_MIN = 100


@dataclass(frozen=True)
class BenchRequest:
    """One request: `prompt` for completions (or a single user turn in chat), or `messages` (+ `tools`) for chat."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompt_len: int = 0  # estimated input tokens; the server's usage replaces it when given
    output_len: int | None = None  # max_tokens; None leaves it to the server
    session: int | None = None
    turn: int | None = None


def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float, num: int) -> list[int]:
    """`num` integers uniform in [floor(length * (1 - r)), ceil(length * (1 + r))], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def random_text(rng: np.random.Generator, num_words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=num_words))


def random_requests(rng: np.random.Generator, num: int, input_len: int, output_len: int, range_ratio: float,
                    token_ids: bool = False, vocab_size: int = 4000) -> list[BenchRequest]:
    """Prompts of random words (or token ids in [100, vocab_size)) with sampled input and output lengths."""
    input_lens = sample_lengths(rng, input_len, range_ratio, num)
    output_lens = sample_lengths(rng, output_len, range_ratio, num)
    if token_ids and vocab_size <= TOKEN_ID_MIN:
        raise ValueError(f"--random-vocab-size must be > {TOKEN_ID_MIN}, got {vocab_size}")
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        prompt = ([int(t) for t in rng.integers(TOKEN_ID_MIN, vocab_size, size=n_in)] if token_ids
                  else random_text(rng, n_in))
        requests.append(BenchRequest(prompt=prompt, prompt_len=n_in, output_len=n_out))
    return requests


def _agent_tool_call(rng: np.random.Generator, call_id: str) -> dict:
    name = AGENT_TOOLS[int(rng.integers(len(AGENT_TOOLS)))]["function"]["name"]
    words = random_text(rng, 4).split()
    arguments = {
        "read_file": {"path": "src/" + "_".join(words[:2]) + ".py"},
        "run_command": {"command": "pytest -q -k " + words[0], "timeout_s": 60},
        "search_code": {"query": " ".join(words[:2]), "max_results": 20},
        "write_file": {"path": "src/" + words[0] + ".py", "content": " ".join(words)},
    }[name]
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def agent_session(rng: np.random.Generator, session: int, system_prompt: str, num_turns: int,
                  tool_result_len: int) -> list[list[dict]]:
    """The messages of each turn of one session: turn t has the system prompt, the task, then t assistant turns
    (a short note and one or two tool calls) each followed by their tool results. Turn t is a prefix of turn t+1."""
    history = [{"role": "system", "content": system_prompt},
               {"role": "user", "content": f"Task {session}: " + random_text(rng, 40)}]
    turns = []
    for turn in range(num_turns):
        turns.append(list(history))
        calls = [_agent_tool_call(rng, f"call_{session}_{turn}_{j}") for j in range(1 + int(rng.random() < 0.3))]
        history.append({"role": "assistant", "content": random_text(rng, 12), "tool_calls": calls})
        history += [{"role": "tool", "tool_call_id": call["id"], "content": random_text(rng, tool_result_len)}
                    for call in calls]
    return turns


def estimate_tokens(messages: list[dict], with_tools: bool) -> int:
    words = sum(len(str(m.get("content") or "").split()) + 8 * len(m.get("tool_calls") or ()) for m in messages)
    return words + 4 * len(messages) + (AGENT_TOOLS_TOKENS if with_tools else 0)


def agent_requests(rng: np.random.Generator, num: int, num_turns: int, system_prompt_len: int,
                   tool_result_len: int, output_len: int, range_ratio: float) -> list[BenchRequest]:
    """`num` requests from ceil(num / num_turns) sessions, ordered turn by turn (every session's turn 0, then
    every turn 1, ...), so histories grow over the run as in a pool of agents sharing one server."""
    if num_turns < 1:
        raise ValueError(f"--agent-num-turns must be >= 1, got {num_turns}")
    system_prompt = "You are a coding agent working in a repository. Use the tools. " + random_text(
        rng, system_prompt_len)
    num_sessions = math.ceil(num / num_turns)
    sessions = [agent_session(rng, s, system_prompt, num_turns, tool_result_len) for s in range(num_sessions)]
    output_lens = iter(sample_lengths(rng, output_len, range_ratio, num_sessions * num_turns))
    ordered = [(s, t) for t in range(num_turns) for s in range(num_sessions)][:num]
    return [BenchRequest(messages=sessions[s][t], tools=AGENT_TOOLS, prompt_len=estimate_tokens(sessions[s][t], True),
                         output_len=next(output_lens), session=s, turn=t) for s, t in ordered]


def _file_entry(line: str, jsonl: bool, output_len: int) -> BenchRequest:
    if not jsonl:
        return BenchRequest(prompt=line, prompt_len=len(line.split()), output_len=output_len)
    entry = json.loads(line)
    if isinstance(entry, str):
        entry = {"prompt": entry}
    n_out = entry.get("output_len", entry.get("max_tokens", output_len))
    if "messages" in entry:
        tools = entry.get("tools")
        return BenchRequest(messages=entry["messages"], tools=tools, output_len=n_out,
                            prompt_len=estimate_tokens(entry["messages"], bool(tools)))
    prompt = entry["prompt"]
    return BenchRequest(prompt=prompt, prompt_len=len(prompt) if isinstance(prompt, list) else len(prompt.split()),
                        output_len=n_out)


def file_requests(path: str | Path, num: int, output_len: int) -> list[BenchRequest]:
    """`.jsonl`: one object per line with `prompt` (text or token ids) or `messages` (+ `tools`), and optionally
    `output_len` / `max_tokens`; any other file: one prompt per non-empty line. Cycled to reach `num`."""
    path = Path(path)
    jsonl = path.suffix == ".jsonl"
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no prompts")
    try:
        entries = [_file_entry(line, jsonl, output_len) for line in lines]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: each line must be a JSON object with 'prompt' or 'messages' ({e})") from e
    return list(itertools.islice(itertools.cycle(entries), num))
