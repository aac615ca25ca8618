"""Helpers for the API tests: `flint-sched serve` subprocesses on free loopback ports.

Two servers live for the whole test session, started together on first use: "real" runs flint-tiny
on the CPU, "scripted" replays SCRIPTS through the ScriptedExecutor (and needs API_KEY). Both read
the checkpoint from one session cache dir, made once before they start.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "sk-flint-test"
SCRIPTED_MODEL = "flint-scripted"
SCRIPTED_BODY_LIMIT = 1 << 20
STARTUP_TIMEOUT_S = 60.0
_STASH = pytest.StashKey[dict]()
_BASE = pytest.StashKey[Path]()

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def _call(name: str, **args) -> list[str]:
    pieces = ["<tool_call>", name]
    for key, value in args.items():
        pieces += ["<arg_key>", key, "</arg_key>", "<arg_value>", str(value), "</arg_value>"]
    return pieces + ["</tool_call>"]


# prompt substring -> what the scripted model says; the longest substring in the prompt wins
SCRIPTS = {
    "": ["ok"],
    "WEATHER_ONE": ["Need the", " tool.", "</think>", "Let me check.", *_call("get_weather", city="Beijing", days=3)],
    "WEATHER_MANY": ["Two cities.", "</think>", *_call("get_weather", city="Beijing"), "\n",
                     *_call("launch_rockets", count=3), *_call("get_weather", city="Paris", days=2)],
    "THINK_ONLY": ["Just", " thinking", " more  "],
    "PLAIN_ANSWER": ["Plain", " answer."],
    "FORCED_NAMED": ["city", "</arg_key>", "<arg_value>", "Oslo", "</arg_value>", "</tool_call>"],
    "FORCED_REQUIRED": ["get_time", "<arg_key>", "zone", "</arg_key>", "<arg_value>", "UTC", "</arg_value>",
                        "</tool_call>"],
    "STOP_STRINGS": ["alpha", " beta ", "STOP", " gamma"],
    "LONG_STORY": ["word "] * 40,
    "SLOW_STORY": ["word ", {"sleep_s": 0.02}] * 50,           # about 1 s, however many run at once
    "ENDLESS_STORY": ["word ", {"sleep_s": 0.05}] * 2000,      # 100 s: ended by a shutdown
    "QUICK_ANSWER": ["quick", {"sleep_s": 0.5}, " answer"],
    "HUNG_GPU_STEP": ["a", {"sleep_s": 3600}, "b"],             # for servers with a step watchdog
}


@dataclass
class ServerProcess:
    name: str
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server {self.name} not healthy after {timeout_s} s:\n{self.log()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(name: str, args: list[str], cache_dir: Path, log_dir: Path) -> ServerProcess:
    port = free_port()
    env = {**os.environ, "FLINT_SCHED_CACHE": str(cache_dir)}
    log_path = log_dir / f"{name}.log"
    argv = [sys.executable, "-m", "flint_sched.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
            "--port", str(port), "--uvicorn-log-level", "warning", *args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return ServerProcess(name, process, port, log_path)


def make_checkpoint_once(cache_dir: Path) -> None:
    """The servers' flint-tiny checkpoint, made here so two servers never race to make it."""
    previous = os.environ.get("FLINT_SCHED_CACHE")
    os.environ["FLINT_SCHED_CACHE"] = str(cache_dir)
    try:
        from flint_sched.checkpoint.make import default_checkpoint_path

        default_checkpoint_path("flint-tiny", progress=False)
    finally:
        if previous is None:
            del os.environ["FLINT_SCHED_CACHE"]
        else:
            os.environ["FLINT_SCHED_CACHE"] = previous


def session_dir(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's server directory: the checkpoint cache, SCRIPTS as script.json, the logs."""
    if _BASE not in config.stash:
        base = tmp_path_factory.mktemp("api-servers")
        make_checkpoint_once(base / "cache")
        (base / "script.json").write_text(json.dumps(SCRIPTS), encoding="utf-8")
        config.stash[_BASE] = base
    return config.stash[_BASE]


def own_server(request: pytest.FixtureRequest, name: str, args: list[str]) -> ServerProcess:
    """A scripted server of the test's own (one it may stop or break), ready; stopped after the test."""
    base = session_dir(request.config, request.getfixturevalue("tmp_path_factory"))
    server = start_server(name, ["--scripted-executor", str(base / "script.json"), *args], base / "cache", base)
    request.addfinalizer(server.stop)
    server.wait_ready()
    return server


def _start_all(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServerProcess]:
    base = session_dir(config, tmp_path_factory)
    script = base / "script.json"
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "glm47", "--reasoning-parser", "glm47"]
    servers = {
        # async scheduling and the API process as on a GPU (their defaults there), so the HTTP tests run through them
        "real": start_server("real", [*tools, "--max-model-len", "2048", "--max-num-seqs", "64", "--async-scheduling",
                                               "--api-server-count", "1"],
                             base / "cache", base),
        "scripted": start_server("scripted", [*tools, "--exclude-tools-when-tool-choice-none", "--api-key", API_KEY,
                                              "--served-model-name", SCRIPTED_MODEL, "--scripted-executor",
                                              str(script), "--max-request-body-bytes", str(SCRIPTED_BODY_LIMIT)],
                                 base / "cache", base),
    }
    config.add_cleanup(lambda: [server.stop() for server in servers.values()])
    for server in servers.values():
        server.wait_ready()
    return servers


def shared_server(request: pytest.FixtureRequest, name: str) -> ServerProcess:
    """The session's server `name` ("real" or "scripted"), both started on the first call."""
    config = request.config
    if _STASH not in config.stash:
        config.stash[_STASH] = _start_all(config, request.getfixturevalue("tmp_path_factory"))
    return config.stash[_STASH][name]


def error_of(response: httpx.Response) -> dict:
    """The OpenAI error object of a response, checking its shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def sse_events(text: str) -> list:
    """The JSON payloads of an SSE body, checking the framing and the final [DONE]."""
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]", text[-200:]
    events = []
    for block in blocks[:-2]:
        assert block.startswith("data: "), block
        events.append(json.loads(block[len("data: "):]))
    return events
