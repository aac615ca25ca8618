"""A small OpenAI-compatible fake server for the client and `bench serve` tests, run by uvicorn on 127.0.0.1.

Answers chat and completions from a `Script` (reasoning, content, parallel tool calls; the same answer streamed
or not) or, without a script, with `max_tokens` one-word tokens. Failures, delays and endless streams can be
injected; it records every request and notices client disconnects.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

CREATED = 1_700_000_000


@dataclass
class Script:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments JSON)
    piece_chars: int = 3  # characters per streamed fragment


@dataclass
class FakeOpenAIServer:
    script: Script | None = None
    failures: list[tuple[int, object]] = field(default_factory=list)  # (status, body), one per request
    response_delay_s: float = 0.0
    token_delay_s: float = 0.0
    endless_stream: bool = False
    requests: list[dict] = field(default_factory=list)
    disconnected: threading.Event = field(default_factory=threading.Event)
    open_streams: int = 0                                             # SSE bodies being written now
    url: str = ""                                                     # set by `running_fake_server`

    def reset(self) -> None:
        self.script, self.failures, self.requests = None, [], []
        self.response_delay_s = self.token_delay_s = 0.0
        self.endless_stream = False
        self.disconnected.clear()

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", lambda request: PlainTextResponse("ok"), methods=["GET"]),
        ])

    async def _models(self, request: Request) -> Response:
        self.requests.append({"path": "/v1/models", "headers": dict(request.headers), "body": None})
        return JSONResponse({"object": "list", "data": [{"id": "flint-fake", "object": "model", "created": CREATED,
                                                         "owned_by": "flint-sched"}]})

    async def _begin(self, request: Request) -> tuple[dict, Response | None]:
        body = await request.json()
        self.requests.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        if self.failures:
            status, payload = self.failures.pop(0)
            headers = {"Retry-After": "0"} if status in (429, 503) else None
            if isinstance(payload, str):
                return body, PlainTextResponse(payload, status_code=status, headers=headers)
            return body, JSONResponse(payload, status_code=status, headers=headers)
        await asyncio.sleep(self.response_delay_s)
        return body, None

    async def _chat(self, request: Request) -> Response:
        body, failure = await self._begin(request)
        if failure is not None:
            return failure
        n = body.get("n", 1)
        scripts = [self._script_for(body, i) for i in range(n)]
        if body.get("stream"):
            per_choice = [chat_deltas(s) for s in scripts]  # interleaved round-robin when n > 1
            deltas = [(i, d) for step in itertools.zip_longest(*per_choice) for i, d in enumerate(step) if d]
            return self._sse(body, deltas, "chat.completion.chunk", scripts)
        choices = [{"index": i, "message": chat_message(s), "logprobs": None,
                    "finish_reason": "tool_calls" if s.tool_calls else "stop"} for i, s in enumerate(scripts)]
        return JSONResponse({"id": "chatcmpl-fake", "object": "chat.completion", "created": CREATED,
                             "model": body["model"], "choices": choices, "usage": usage(body, scripts)})

    async def _completions(self, request: Request) -> Response:
        body, failure = await self._begin(request)
        if failure is not None:
            return failure
        script = self._script_for(body, 0)
        if body.get("stream"):
            pieces = split(script.content or "", script.piece_chars)
            deltas = [(0, {"text": p}) for p in pieces] + [(0, {"text": "", "finish_reason": "length"})]
            return self._sse(body, deltas, "text_completion", [script])
        return JSONResponse({"id": "cmpl-fake", "object": "text_completion", "created": CREATED,
                             "model": body["model"], "usage": usage(body, [script]),
                             "choices": [{"index": 0, "text": script.content, "finish_reason": "length"}]})

    def _script_for(self, body: dict, index: int) -> Script:
        if self.script is None:
            return Script(content="".join(" tok" for _ in range(body.get("max_tokens") or 16)), piece_chars=4)
        if index == 0:
            return self.script
        s = self.script
        return Script(s.reasoning and f"{s.reasoning} #{index}", s.content and f"{s.content} #{index}",
                      s.tool_calls, s.piece_chars)

    def _sse(self, body: dict, deltas: list[tuple[int, dict]], object_name: str, scripts: list[Script]) -> Response:
        chunk_head = {"id": "chatcmpl-fake" if "chat" in object_name else "cmpl-fake", "object": object_name,
                      "created": CREATED, "model": body["model"]}

        def chunk(index: int, delta: dict) -> str:
            if object_name == "text_completion":
                choice = {"index": index, "text": delta["text"], "finish_reason": delta.get("finish_reason")}
            else:
                reason = delta.pop("finish_reason", None)
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            return f"data: {json.dumps({**chunk_head, 'choices': [choice]})}\n\n"

        async def events():
            self.open_streams += 1
            try:
                if self.endless_stream:
                    for _ in range(1000):
                        yield chunk(0, {"content": "x"})
                        await asyncio.sleep(0.01)
                for index, delta in deltas:
                    yield chunk(index, dict(delta))
                    await asyncio.sleep(self.token_delay_s)
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({**chunk_head, 'choices': [], 'usage': usage(body, scripts)})}\n\n"
                yield "data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                self.disconnected.set()
                raise
            finally:
                self.open_streams -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


def split(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def chat_message(s: Script) -> dict:
    message = {"role": "assistant", "content": s.content, "reasoning": s.reasoning}
    if s.tool_calls:
        message["tool_calls"] = [{"id": f"chatcmpl-tool-{i}", "type": "function",
                                  "function": {"name": name, "arguments": args}}
                                 for i, (name, args) in enumerate(s.tool_calls)]
    return message


def chat_deltas(s: Script) -> list[dict]:
    """The stream of one choice: role, reasoning, content, then each call's header and argument fragments."""
    deltas = [{"role": "assistant", "content": ""}]
    deltas += [{"reasoning": p} for p in split(s.reasoning or "", s.piece_chars)]
    deltas += [{"content": p} for p in split(s.content or "", s.piece_chars)]
    for i, (name, args) in enumerate(s.tool_calls):
        deltas.append({"tool_calls": [{"index": i, "id": f"chatcmpl-tool-{i}", "type": "function",
                                       "function": {"name": name}}]})
        deltas += [{"tool_calls": [{"index": i, "function": {"arguments": p}}]} for p in split(args, s.piece_chars)]
    deltas.append({"finish_reason": "tool_calls" if s.tool_calls else "stop"})
    return deltas


def usage(body: dict, scripts: list[Script]) -> dict:
    prompt = body.get("prompt") or json.dumps(body.get("messages"))
    prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
    completion_tokens = sum(len((s.content or "").split()) + len((s.reasoning or "").split()) for s in scripts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@contextmanager
def serve(app: Starlette) -> Iterator[str]:
    """Runs `app` on 127.0.0.1 on a free port in a background thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


@contextmanager
def running_fake_server() -> Iterator[FakeOpenAIServer]:
    """A FakeOpenAIServer served on loopback (`serve`), its base URL in `.url`."""
    fake = FakeOpenAIServer()
    with serve(fake.app()) as url:
        fake.url = url
        yield fake
