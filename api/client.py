"""`AsyncFlintClient`: an async client for any OpenAI-compatible server (chat, completions, models, health).

One pooled `httpx.AsyncClient` per client. Connection errors, HTTP 503 and 429 are retried with exponential
backoff and jitter (honouring a `Retry-After` in seconds) until `max_retries`; other 4xx/5xx never are, nor is
anything after a stream has started. Errors come as the types in `client_types`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any, Literal, overload
from urllib.parse import urlsplit

import httpx
import msgspec

from flint_sched.api.client_stream import Stream, accumulate_chat, accumulate_completion
from flint_sched.api.client_types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    Completion,
    FlintAPIError,
    FlintConnectionError,
    FlintError,
    FlintResponseError,
    FlintTimeoutError,
    Model,
    ModelList,
    ToolCall,
    Usage,
    decode_response,
    parse_error,
)

__all__ = [
    "AsyncFlintClient", "ChatCompletion", "ChatCompletionChunk", "ChatMessage", "ChatStream", "Completion",
    "CompletionStream", "FlintAPIError", "FlintConnectionError", "FlintError", "FlintResponseError",
    "FlintTimeoutError", "Model", "ToolCall", "Usage",
]

ChatStream = Stream[ChatCompletionChunk, ChatCompletion]
CompletionStream = Stream[Completion, Completion]

DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
RETRY_STATUSES = frozenset({429, 503})
# Failures that happen before the server has read the request, so a retry cannot run a generation twice.
RETRY_TRANSPORT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError)


def split_base_url(base_url: str) -> tuple[str, str]:
    """(server root, API root): `http://h:8000` and `http://h:8000/v1` both give (`http://h:8000`, `…/v1`)."""
    url = base_url.rstrip("/")
    if urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"base_url needs a scheme (http:// or https://): {base_url!r}")
    if url.endswith("/v1"):
        return url[: -len("/v1")], url
    return url, url + "/v1"


class AsyncFlintClient:
    """Use as `async with AsyncFlintClient(...) as client:`; `aclose()` releases the connection pool."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, *,
                 model: str | None = None, timeout: float | httpx.Timeout = DEFAULT_TIMEOUT, max_retries: int = 3,
                 backoff_base_s: float = 0.5, backoff_max_s: float = 8.0, max_connections: int | None = 100,
                 headers: dict[str, str] | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.server_url, self.api_url = split_base_url(base_url)
        self.model = model
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        all_headers = {"Accept": "application/json", **(headers or {})}
        if api_key:
            all_headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.AsyncClient(
            headers=all_headers, timeout=timeout, transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))
        self._chat_decoder = msgspec.json.Decoder(ChatCompletion)
        self._completion_decoder = msgspec.json.Decoder(Completion)
        self._models_decoder = msgspec.json.Decoder(ModelList)

    async def __aenter__(self) -> AsyncFlintClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @overload
    async def chat(self, messages: Sequence[Any], *, model: str | None = None, tools: list[dict] | None = None,
                   tool_choice: str | dict | None = None, stream: Literal[False] = False,
                   **params: Any) -> ChatCompletion: ...

    @overload
    async def chat(self, messages: Sequence[Any], *, model: str | None = None, tools: list[dict] | None = None,
                   tool_choice: str | dict | None = None, stream: Literal[True],
                   **params: Any) -> ChatStream: ...

    async def chat(self, messages, *, model=None, tools=None, tool_choice=None, stream=False, **params):
        """POST /v1/chat/completions. `params` go into the body as given (max_tokens, temperature,
        chat_template_kwargs, ignore_eos, ...). With `stream=True`, returns an open `ChatStream`; usage is
        requested (`stream_options.include_usage`) unless `stream_options` is passed."""
        body: dict[str, Any] = {"model": await self._model(model), "messages": list(messages), **params}
        if tools is not None:
            body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        if stream:
            return Stream(await self._open_stream("/chat/completions", body), ChatCompletionChunk, accumulate_chat)
        response = await self._send("POST", self.api_url + "/chat/completions", body)
        return decode_response(self._chat_decoder, response.content)

    @overload
    async def completions(self, prompt: str | list[int] | list[str] | list[list[int]], *, model: str | None = None,
                          stream: Literal[False] = False, **params: Any) -> Completion: ...

    @overload
    async def completions(self, prompt: str | list[int] | list[str] | list[list[int]], *, model: str | None = None,
                          stream: Literal[True], **params: Any) -> CompletionStream: ...

    async def completions(self, prompt, *, model=None, stream=False, **params):
        """POST /v1/completions with a text prompt or token ids; `stream=True` returns a `CompletionStream`."""
        body: dict[str, Any] = {"model": await self._model(model), "prompt": prompt, **params}
        if stream:
            return Stream(await self._open_stream("/completions", body), Completion, accumulate_completion)
        response = await self._send("POST", self.api_url + "/completions", body)
        return decode_response(self._completion_decoder, response.content)

    async def models(self) -> list[Model]:
        """GET /v1/models."""
        response = await self._send("GET", self.api_url + "/models")
        return decode_response(self._models_decoder, response.content).data

    async def health(self) -> bool:
        """GET /health once, without retries: True on HTTP 200, False on any other answer or none."""
        try:
            response = await self._http.get(self.server_url + "/health")
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def _model(self, model: str | None) -> str:
        """The request's model, else the client's, else the first one the server lists (then remembered)."""
        if model is None and self.model is None:
            listed = await self.models()
            if not listed:
                raise FlintResponseError("the server lists no models; pass model=")
            self.model = listed[0].id
        return model or self.model

    async def _open_stream(self, path: str, body: dict[str, Any]) -> httpx.Response:
        body = {**body, "stream": True}
        body.setdefault("stream_options", {"include_usage": True})
        return await self._send("POST", self.api_url + path, body, stream=True)

    def backoff_s(self, attempt: int, retry_after_s: float | None) -> float:
        """Seconds before retry number `attempt` (0-based): base * 2^attempt plus up to 25 % jitter, capped,
        but never less than a server's `Retry-After`."""
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** attempt) * (1.0 + 0.25 * random.random())
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, self.backoff_max_s))
        return delay

    async def _send(self, method: str, url: str, body: dict[str, Any] | None = None, *,
                    stream: bool = False) -> httpx.Response:
        """Sends with retries; returns a response with status < 400 (still open when `stream`)."""
        content = None if body is None else msgspec.json.encode(body)
        headers = None if body is None else {"Content-Type": "application/json"}
        for attempt in range(self.max_retries + 1):
            retry_after_s = None
            try:
                request = self._http.build_request(method, url, content=content, headers=headers)
                response = await self._http.send(request, stream=stream)
            except RETRY_TRANSPORT_ERRORS as e:
                if attempt == self.max_retries:
                    error_type = FlintTimeoutError if isinstance(e, httpx.TimeoutException) else FlintConnectionError
                    raise error_type(f"{method} {url}: {e!r} (after {attempt + 1} attempts)") from e
            except httpx.TimeoutException as e:
                raise FlintTimeoutError(f"{method} {url}: {e!r}") from e
            except httpx.TransportError as e:
                raise FlintConnectionError(f"{method} {url}: {e!r}") from e
            else:
                if response.status_code < 400:
                    return response
                error_body = await response.aread()
                await response.aclose()
                if response.status_code not in RETRY_STATUSES or attempt == self.max_retries:
                    raise parse_error(response.status_code, error_body)
                retry_after_s = _retry_after_s(response)
            await asyncio.sleep(self.backoff_s(attempt, retry_after_s))
        raise AssertionError("unreachable")


def _retry_after_s(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None
