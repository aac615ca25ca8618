"""`serve --api-server-count 1`: the HTTP server in a process of its own, the engine in this one.

    this process (the GPU's): load, start the engine, listen on a Unix socket, start the API process,
                              serve its connection (engine/remote.py) until it exits, stop the engine
    the API process:          connect, read the setup, build the app around an EngineClient, uvicorn

At hundreds of streams the per-token work of the HTTP side (SSE chunks, socket writes, metrics)
takes as long as a GPU step; in one process it runs between the engine's steps and the GPU waits
(benchmarks/RESULTS.md, session 28: 7-10 % idle at 256 streams). Split, the engine's loop only
schedules, launches and detokenizes, and an API process that falls behind sends merged outputs.

Signals: the API process runs in a session of its own, so a terminal's Ctrl-C reaches this process
only, which forwards each SIGINT / SIGTERM: the first drains (api/lifecycle.py), a second exits at
once. The API process exits with status 1 when the engine dies or this process goes away (its
connection ends); this process exits with the API process's status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile

from flint_sched.api.gc_pauses import PauseWatch, freeze_startup_heap
from flint_sched.api.lifecycle import EXIT_ENGINE_DIED
from flint_sched.api.server import EngineState, ServerConfig, serve
from flint_sched.engine.remote import EngineClient, EngineConnection


def serve_with_api_process(state: EngineState, server_config: ServerConfig) -> int:
    """Serve until the API process exits (drained by a signal: 0; the engine died: EXIT_ENGINE_DIED)."""
    from flint_sched.llm import run_async     # uvloop where installed, as uvicorn's "auto" loop

    return run_async(_engine_process(state, server_config))


async def _engine_process(state: EngineState, server_config: ServerConfig) -> int:
    await state.start()
    engine = state.engine
    freeze_startup_heap()                        # as the API process does in its app's lifespan
    gc_watch = PauseWatch()                      # the engine's long collections are logged too
    gc_watch.install()
    fields = {f.name: getattr(server_config, f.name) for f in dataclasses.fields(server_config)}
    for name in ("default_chat_template_kwargs", "sampling_defaults"):   # read-only views do not pickle
        fields[name] = dict(fields[name])
    setup = {"server_config": fields, "tokenizer": state.tokenizer, "model_root": state.model_root,
             "max_model_len": state.max_model_len, "vocab_size": state.vocab_size}
    connected: list[EngineConnection] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if connected:                                    # one API process, one connection
            writer.close()
            return
        connected.append(connection := EngineConnection(engine, reader, writer))
        await connection.serve(setup)

    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory(prefix="flint-sched-") as folder:
        path = os.path.join(folder, "engine.sock")
        listener = await asyncio.start_unix_server(on_connect, path)
        process = subprocess.Popen([sys.executable, "-m", "flint_sched.api.api_process", path],
                                   start_new_session=True, stdin=subprocess.DEVNULL)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, process.send_signal, sig)
        try:
            code = await asyncio.to_thread(process.wait)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if process.poll() is None:                   # this process is failing: take it along
                process.kill()
                process.wait()
            listener.close()
            died = engine.dead_error is not None
            await state.stop()
            gc_watch.remove()
    if code < 0:                                         # killed by a signal
        return EXIT_ENGINE_DIED
    return EXIT_ENGINE_DIED if died else code


class RemoteEngineState:
    """EngineState's surface for the API process: the engine is an EngineClient over `sock`."""

    def __init__(self, sock: socket.socket, setup: dict):
        from flint_sched.structured.compiler import GrammarCompiler

        self.sock = sock
        self.tokenizer = setup["tokenizer"]
        self.model_root = setup["model_root"]
        self.max_model_len = setup["max_model_len"]
        self.vocab_size = setup["vocab_size"]
        self.grammar_compiler = GrammarCompiler(self.tokenizer)
        self.engine: EngineClient | None = None

    async def start(self) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=self.sock)
        self.engine = EngineClient(reader, writer, self.tokenizer, self.vocab_size, self.max_model_len,
                                   self.grammar_compiler)
        self.engine.start()

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()

    async def refresh_stats(self) -> None:
        if self.engine is not None:
            await self.engine.fetch_stats()

    @property
    def is_healthy(self) -> bool:
        return self.engine is not None and self.engine.is_running


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the engine process closed the connection during setup")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def main(argv: list[str]) -> int:
    """The API process: `python -m flint_sched.api.api_process SOCKET_PATH`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(argv[0])
    size = int.from_bytes(_receive_exactly(sock, 4), "big")
    kind, setup = pickle.loads(_receive_exactly(sock, size))
    if kind != "setup":
        raise ConnectionError(f"expected the setup from the engine process, got {kind!r}")
    return serve(RemoteEngineState(sock, setup), ServerConfig(**setup["server_config"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
