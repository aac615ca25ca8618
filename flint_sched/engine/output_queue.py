"""A request's outputs on their way from the engine's loop to the one reader of its stream (the
in-process engine's, engine/async_engine.py, and the API process's client, engine/remote.py)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from flint_sched.engine.outputs import RequestOutput, merge_outputs


class OutputQueue:
    """A request's outputs on their way to its one reader, on the loop's thread: asyncio.Queue's work
    (getter and putter lists, size checks) cut to a deque and a future, since it runs once per
    streamed token. An output put while the reader has not taken the last one is merged into it
    (`merge_outputs`): a reader behind the engine gets the tokens so far in one output, not a backlog."""

    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        items = self._items
        if items and isinstance(item, RequestOutput) and isinstance(last := items[-1], RequestOutput):
            merge_outputs(last, item)
            return
        items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


async def stream_outputs(queue: OutputQueue, abort) -> AsyncIterator[RequestOutput]:
    """A request's outputs until its last one (an exception it gets is raised); a reader that leaves
    before the last (disconnect, break, cancel) has `abort()` called."""
    done = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                done = True                    # the request is over already
                raise item
            yield item
            if item.finished:
                done = True
                return
    finally:
        if not done:
            abort()
