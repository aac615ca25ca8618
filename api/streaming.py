"""Streams between the engine and one HTTP exchange: SSE framing, disconnects, cleanup.

Invariant: every engine request a handler adds through an ExchangeGuard is aborted when the exchange
ends (finished, failed or disconnected; `abort` of a finished request is a no-op), so a client that
leaves mid-stream frees its blocks and slots at once. Each function below does one thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import msgspec

from flint_sched.api.errors import APIError, from_value_error, unavailable
from flint_sched.api.metrics import ServerMetrics
from flint_sched.engine.outputs import EngineError, RequestOutput
from flint_sched.sampling_params import SamplingParams

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def sse_event(payload: Any) -> bytes:
    """One `data: {json}` event."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def engine_failed(error: EngineError) -> APIError:
    """A request the engine gave up on (a failed step, a dead loop, a shutdown)."""
    return APIError(500, str(error))


def sse_error(error: APIError) -> bytes:
    """An error that happens after the stream has started: an event carrying OpenAI's error body."""
    return sse_event(error.to_body())


class DisconnectWatcher:
    """Waits on the ASGI receive channel (after the body was read) for `http.disconnect`."""

    def __init__(self, receive):
        self.task = asyncio.ensure_future(self._watch(receive))
        self.read_cancelled = False      # a reader of until_disconnect was cancelled for it (once a watcher)

    @staticmethod
    async def _watch(receive) -> None:
        with contextlib.suppress(Exception):
            while (await receive())["type"] != "http.disconnect":
                pass

    @property
    def disconnected(self) -> bool:
        return self.task.done()

    def close(self) -> None:
        self.task.cancel()


async def until_disconnect(stream: AsyncIterator[T], watcher: DisconnectWatcher) -> AsyncIterator[T]:
    """Items of `stream` until it ends or the client goes; a read pending when the client goes is
    cancelled, which runs the engine stream's cleanup (abort) inside it. So is a read pending when
    this generator is itself cancelled (a server shutting down): `stream` is closed only once idle.
    The read is awaited directly in the consuming task, and the watcher's done-callback cancels
    that task while it waits on the read (not while it writes): no task per item, no asyncio.wait
    on both per item: this runs once per streamed token (a task a token cost ~1 ms of the event
    loop's time a step at 256 streams)."""
    consumer = asyncio.current_task()
    reading = cancelled_here = False

    def on_disconnect(_) -> None:
        nonlocal cancelled_here
        if reading and not watcher.read_cancelled:     # nested readers in one task: the outer cancels
            watcher.read_cancelled = cancelled_here = True
            consumer.cancel()

    watcher.task.add_done_callback(on_disconnect)
    try:
        while not watcher.disconnected:
            reading = True
            try:
                item = await anext(stream)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if cancelled_here and consumer.uncancel() == 0:
                    return                 # the watcher cancelled the read, not someone else us
                raise
            finally:
                reading = False
            yield item
    finally:
        watcher.task.remove_done_callback(on_disconnect)
        await stream.aclose()


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) from several streams as items arrive; the first error is re-raised.
    One stream (the usual request) is read directly: no task and queue hop per item."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None))
            queue.put_nowait((index, done, None))
        except Exception as error:
            queue.put_nowait((index, done, error))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def exchange_ids(prefix: str, headers, body_id: str | None) -> tuple[str, str]:
    """(the response's id, the base of its engine request ids), as vLLM names a response: `prefix`
    and the client's X-Request-Id header, else the body's `request_id`, else a fresh id. A client's
    id gets a suffix in the engine, so that requests reusing one stay apart."""
    given = headers.get("x-request-id") or body_id
    if not given:
        fresh = f"{prefix}{uuid.uuid4().hex}"
        return fresh, fresh
    return f"{prefix}{given}", f"{prefix}{given}-{uuid.uuid4().hex[:8]}"


class ExchangeGuard:
    """The engine requests of one HTTP exchange, and the watcher of its client."""

    def __init__(self, engine, metrics: ServerMetrics, receive):
        self.engine = engine
        self.metrics = metrics
        self.watcher = DisconnectWatcher(receive)
        self.request_ids: list[str] = []

    def add(self, prompt: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Queue one engine request, observed by the metrics; 400 when it can never run."""
        arrival = time.perf_counter()
        try:
            stream = self.engine.add_request(prompt, params, request_id)
        except ValueError as error:
            raise from_value_error(error) from error
        except EngineError as error:
            raise unavailable(str(error)) from error
        self.request_ids.append(request_id)
        return self.metrics.observe(stream, arrival, len(prompt))

    def close(self) -> None:
        for request_id in self.request_ids:
            self.engine.abort(request_id)
        self.watcher.close()


def one_request(engine, metrics: ServerMetrics, receive, prompt: list[int], params: SamplingParams,
                request_id: str) -> tuple[ExchangeGuard, AsyncIterator[RequestOutput]]:
    """The guard of an exchange of one engine request, and the request's stream."""
    guard = ExchangeGuard(engine, metrics, receive)
    try:
        return guard, guard.add(prompt, params, request_id)
    except BaseException:
        guard.close()
        raise


async def last_output(stream: AsyncIterator[RequestOutput], guard: ExchangeGuard) -> RequestOutput | None:
    """The final output of a request (None when the client left first); the exchange is then over."""
    last = None
    try:
        async for out in until_disconnect(stream, guard.watcher):
            last = out
    except EngineError as error:
        raise engine_failed(error) from error
    finally:
        guard.close()
    return last if last is not None and last.finished else None


class SSEResponse:
    """An ASGI response that sends `events` as they come and ends the exchange's requests after."""

    def __init__(self, events: AsyncIterator[bytes], guard: ExchangeGuard):
        self.events = events
        self.guard = guard

    async def __call__(self, scope, receive, send) -> None:
        events = until_disconnect(self.events, self.guard.watcher)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            if not self.guard.watcher.disconnected:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass                        # the client went away while we were writing
        finally:
            await events.aclose()
            self.guard.close()
