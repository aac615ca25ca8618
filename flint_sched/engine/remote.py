"""The engine behind a socket, for an API server in another process (`serve --api-server-count 1`).

One process owns the GPU and runs the AsyncEngine; the HTTP server runs in a second one, so the
per-token work of hundreds of streams (SSE chunks, socket writes, metrics) never holds up the
engine's steps, as vLLM's API server and engine core are split. They talk over a Unix socket, one
pickled message a frame (a 4-byte length, then the pickle):

    engine -> API:  ("setup", {...})            first, once: what the API process builds its app from
                    ("outs", [item, ...])       every output of one turn of the engine's loop
                    ("reply", call_id, value)   to ("call", ...)
                    ("dead", message)           the engine loop died; the connection closes after
    API -> engine:  ("add", request_id, prompt_ids, params)   ("abort", request_id)   ("abort_all",)
                    ("call", call_id, name)     name: "stats" or "reset_prefix_cache"

An item carries an output's deltas only, (request_id, finished, choices, prompt_logprobs,
num_cached_tokens, queue_time_s) with choices [(index, delta_text, delta_token_ids,
delta_logprobs, finish_reason, stop_reason)] and prompt_logprobs only on a request's first item,
or (request_id, message) for a request the engine gave up on; the client rebuilds the running
totals, so a token costs the same on the wire at any length. A stream whose reader is behind gets
its outputs merged (engine/output_queue.py), so a slow API process sends fewer, larger
events instead of falling further behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from collections.abc import AsyncIterator, Sequence

from flint_sched.engine.async_engine import AsyncEngine, check_request
from flint_sched.engine.output_queue import OutputQueue, stream_outputs
from flint_sched.engine.outputs import CompletionOutput, EngineError, RequestOutput
from flint_sched.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_HEADER = struct.Struct("!I")


def frame(message) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader):
    """The next message, or None when the other side has closed the connection."""
    try:
        (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


# -- the engine's side -----------------------------------------------------------------------------

class _Sink:
    """Where one remote request's outputs go: as items into the connection's next frame."""

    __slots__ = ("connection", "request_id", "first")

    def __init__(self, connection: EngineConnection, request_id: str):
        self.connection, self.request_id, self.first = connection, request_id, True

    def put_nowait(self, out) -> None:
        if isinstance(out, BaseException):
            self.connection.send_item((self.request_id, str(out) or repr(out)), self.request_id)
            return
        choices = [(c.index, c.delta_text, c.delta_token_ids, c.delta_logprobs, c.finish_reason, c.stop_reason)
                   for c in out.outputs]
        prompt_logprobs, self.first = (out.prompt_logprobs if self.first else None), False
        self.connection.send_item((self.request_id, out.finished, choices, prompt_logprobs, out.num_cached_tokens,
                                   out.queue_time_s), self.request_id if out.finished else None)


class EngineConnection:
    """Serves one API process's connection from the engine's event loop."""

    def __init__(self, engine: AsyncEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.engine, self.reader, self.writer = engine, reader, writer
        self._items: list = []
        self._open: set[str] = set()          # this connection's requests not yet finished

    def send(self, message) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame(message))

    def send_item(self, item, finished_id: str | None) -> None:
        if not self._items:
            asyncio.get_running_loop().call_soon(self._flush)
        self._items.append(item)
        if finished_id is not None:
            self._open.discard(finished_id)

    def _flush(self) -> None:
        items, self._items = self._items, []
        if items:
            self.send(("outs", items))

    async def serve(self, setup: dict) -> None:
        """Until the API process closes the connection (its requests are then aborted) or the
        engine dies (the API process is told, then the connection closes)."""
        self.send(("setup", setup))
        death = asyncio.ensure_future(self.engine.join())
        death.add_done_callback(self._on_engine_end)
        try:
            while (message := await read_message(self.reader)) is not None:
                await self._handle(message)
        finally:
            death.remove_done_callback(self._on_engine_end)
            death.cancel()
            for request_id in list(self._open):
                self.engine.abort(request_id)
            self._flush()
            self.writer.close()

    def _on_engine_end(self, death: asyncio.Future) -> None:
        if death.cancelled():
            return
        self._flush()
        error = self.engine.dead_error
        self.send(("dead", "the engine was shut down" if error is None else f"the engine loop died: {error}"))
        self.writer.close()

    async def _handle(self, message) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt_ids, params = message
            if params.structured_outputs is not None:     # compiled off the engine's loop (then a cache hit)
                try:
                    await asyncio.to_thread(self.engine.grammar_compiler.compile, params.structured_outputs)
                except ValueError:
                    pass                                  # submit says why
            self._open.add(request_id)
            try:
                self.engine.submit(prompt_ids, params, request_id, _Sink(self, request_id))
            except (ValueError, EngineError) as error:
                self.send_item((request_id, str(error)), request_id)
        elif kind == "abort":
            self.engine.abort(message[1])
        elif kind == "abort_all":
            self.engine.abort_all()
        elif kind == "call":
            _, call_id, name = message
            value = self.engine.stats() if name == "stats" else self.engine.reset_prefix_cache()
            self.send(("reply", call_id, value))
        else:
            logger.error("unknown message from the API process: %r", kind)


# -- the API process's side ------------------------------------------------------------------------

class _RemoteRequest:
    """A request as the API process sees it: the running totals its items add up to."""

    __slots__ = ("request_id", "prompt_token_ids", "with_logprobs", "choices", "prompt_logprobs", "queue")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.with_logprobs = params.logprobs is not None
        self.choices: dict[int, CompletionOutput] = {}
        self.prompt_logprobs = None
        self.queue = OutputQueue()

    def output(self, finished, choices, prompt_logprobs, num_cached_tokens, queue_time_s) -> RequestOutput:
        changed = []
        for index, text, token_ids, logprobs, finish_reason, stop_reason in choices:
            c = self.choices.get(index)
            if c is None:
                c = self.choices[index] = CompletionOutput(index, logprobs=[] if self.with_logprobs else None)
            c.delta_text, c.delta_token_ids = text, token_ids
            c.append_text(text)
            c.token_ids.extend(token_ids)
            if c.logprobs is not None:
                c.delta_logprobs = logprobs or []
                c.logprobs.extend(c.delta_logprobs)
            c.finish_reason, c.stop_reason = finish_reason, stop_reason
            changed.append(c.snapshot())
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        return RequestOutput(self.request_id, self.prompt_token_ids, changed, finished, self.prompt_logprobs,
                             num_cached_tokens, queue_time_s)


class EngineClient:
    """What the API uses of an AsyncEngine (add_request, abort, stats, join...), for an engine in
    another process: requests are checked here first, so a bad one is refused before it is sent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tokenizer, vocab_size: int,
                 max_model_len: int, grammar_compiler):
        self.reader, self.writer = reader, writer
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.grammar_compiler = grammar_compiler
        self.dead_error: BaseException | None = None
        self._requests: dict[str, _RemoteRequest] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._last_stats = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read(), name="flint-engine-client")

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.dead_error is None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.add_request: ValueError when the request can never run."""
        if not self.is_running:
            raise EngineError(f"the engine is not running ({self.dead_error or 'not connected'})")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(prompt_ids, params, self.vocab_size, self.max_model_len, self.grammar_compiler)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self._requests[request_id] = _RemoteRequest(request_id, prompt_ids, params)
        self._send(("add", request_id, prompt_ids, params))
        return stream_outputs(request.queue, lambda: self.abort(request_id))

    def abort(self, request_id: str) -> bool:
        """Ask the engine to finish the request with "abort" (its last output still comes)."""
        if request_id not in self._requests:
            return False
        self._send(("abort", request_id))
        return True

    def abort_all(self) -> int:
        self._send(("abort_all",))
        return len(self._requests)

    def reset_prefix_cache(self) -> bool:
        self._send(("call", next(self._call_ids), "reset_prefix_cache"))   # ordered before later requests
        return True

    def stats(self):
        """The engine's state as of the last `fetch_stats` (None before the first)."""
        return self._last_stats

    async def fetch_stats(self):
        if not self.is_running:
            return self._last_stats
        call_id = next(self._call_ids)
        self._calls[call_id] = reply = asyncio.get_running_loop().create_future()
        self._send(("call", call_id, "stats"))
        self._last_stats = await reply
        return self._last_stats

    async def join(self) -> BaseException | None:
        """Waits until the connection ends: why the engine stopped, or None after `shutdown`."""
        if self._task is not None:
            await asyncio.wait({self._task})
        return self.dead_error

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        self.writer.close()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_all(EngineError("the engine was shut down"))

    def _send(self, message) -> None:
        if not self.writer.is_closing():        # else the connection is over: _read fails what is open
            self.writer.write(frame(message))

    async def _read(self) -> None:
        while (message := await read_message(self.reader)) is not None:
            kind = message[0]
            if kind == "outs":
                self._dispatch(message[1])
            elif kind == "reply":
                reply = self._calls.pop(message[1], None)
                if reply is not None and not reply.done():
                    reply.set_result(message[2])
            elif kind == "dead":
                self.dead_error = EngineError(message[1])
                break
        if self.dead_error is None:
            self.dead_error = EngineError("the engine process closed its connection")
        self.writer.close()
        self._fail_all(self.dead_error)

    def _dispatch(self, items: list) -> None:
        requests = self._requests
        for item in items:
            request = requests.get(item[0])
            if request is None:
                continue
            if len(item) == 2:
                del requests[item[0]]
                request.queue.put_nowait(EngineError(item[1]))
                continue
            out = request.output(*item[1:])
            if out.finished:
                del requests[item[0]]
            request.queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for reply in self._calls.values():
            if not reply.done():
                reply.set_result(self._last_stats)
        self._calls.clear()
        requests, self._requests = self._requests, {}
        for request in requests.values():
            request.queue.put_nowait(error)
