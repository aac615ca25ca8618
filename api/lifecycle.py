"""Graceful shutdown and the engine supervisor, as vLLM's `--shutdown-timeout` behaves.

SIGTERM or SIGINT: admission stops (POSTs and /health answer 503, the listening sockets close),
requests in flight run on for up to `shutdown_timeout_s`, those still running then end with
finish_reason "abort" (their answers still go out, a stream's with `[DONE]`), and uvicorn exits. A
second signal is uvicorn's own (exit now). An engine loop that dies, the step watchdog's included,
makes the process exit with status 1 within seconds, for systemd / Kubernetes to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time

import uvicorn

logger = logging.getLogger("flint_sched.api")
EXIT_ENGINE_DIED = 1
ANSWER_FLUSH_S = 0.5         # after the engine dies: time for the failed requests' answers to go out
FORCE_EXIT_AFTER_S = 15.0    # after the engine dies: the process exits by then even if teardown hangs
DRAIN_POLL_S = 0.05


class Lifecycle:
    """Whether the server admits requests, and how it stops; `server` is None in-process (tests)."""

    def __init__(self, shutdown_timeout_s: float):
        self.shutdown_timeout_s = shutdown_timeout_s
        self.draining = False
        self.exit_code = 0
        self.server: uvicorn.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _exit_server(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    async def drain(self, engine) -> None:
        """Stop admitting, wait for the requests in flight (up to the timeout), abort the rest, exit."""
        if self.draining:
            return
        self.draining = True
        logger.info("shutting down: waiting up to %g s for %d request(s) in flight", self.shutdown_timeout_s,
                    0 if engine is None else engine.num_unfinished_requests)
        for listener in getattr(self.server, "servers", ()):
            listener.close()
        deadline = time.monotonic() + self.shutdown_timeout_s
        while (engine is not None and engine.is_running and engine.num_unfinished_requests
               and time.monotonic() < deadline):
            await asyncio.sleep(DRAIN_POLL_S)
        if engine is not None:
            aborted = engine.abort_all()
            if aborted:
                logger.warning("shutdown timeout (%g s) reached: aborted %d request(s)", self.shutdown_timeout_s,
                               aborted)
        self._exit_server()

    async def supervise(self, engine) -> None:
        """Waits on the engine loop; if it dies, the process exits non-zero within seconds."""
        error = await engine.join()
        if error is None:
            return
        logger.critical("the engine has stopped (%s); exiting with status %d so that the server is restarted",
                        error, EXIT_ENGINE_DIED)
        self.exit_code = EXIT_ENGINE_DIED
        if self.server is None:
            return
        arm_force_exit(EXIT_ENGINE_DIED, FORCE_EXIT_AFTER_S)
        await asyncio.sleep(ANSWER_FLUSH_S)
        self._exit_server()


def arm_force_exit(code: int, after_s: float) -> None:
    """A daemon timer that ends the process with `code` if it is still alive after `after_s`."""
    def force() -> None:
        logger.critical("still alive %g s after the engine stopped: exiting now", after_s)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(after_s, force)
    timer.daemon = True
    timer.start()


class FlintServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains (Lifecycle.drain) instead of exiting."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, get_engine):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.get_engine = get_engine
        lifecycle.server = self

    def handle_exit(self, sig, frame) -> None:
        loop = self.lifecycle.loop
        if self.lifecycle.draining or self.should_exit or loop is None or loop.is_closed():
            super().handle_exit(sig, frame)
            return
        loop.call_soon_threadsafe(self.lifecycle.spawn, self.lifecycle.drain(self.get_engine()))
