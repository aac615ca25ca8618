"""StepWorker: runs the executor's steps one at a time on a daemon thread, each as an asyncio future.

Not a ThreadPoolExecutor: its threads are joined when the interpreter exits, so a step that never
returns (a GPU hang) would keep a dead server alive. A daemon thread lets the watchdog give up on it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class StepWorker:
    """One daemon thread; `submit` queues a call and returns a future of the running loop."""

    def __init__(self, name: str = "flint-step"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Any], Any], arg: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, fn, arg))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, arg = job
            result, error = None, None
            try:
                result = fn(arg)
            except BaseException as e:         # handed to the awaiting loop, which decides
                error = e
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:                # the loop has closed: nobody waits any more
                return

    def shutdown(self) -> None:
        """Ends the thread after the step it runs (if any); does not wait for it."""
        self._jobs.put(None)

    def join(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the thread to end; False when a step still runs."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
