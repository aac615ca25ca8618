"""api/streaming.py when the task serving an exchange is cancelled (uvicorn's graceful shutdown
running out): the pending engine read is cancelled first, then the stream is closed, no error."""

import asyncio

from flint_sched.api.streaming import DisconnectWatcher, until_disconnect


async def test_cancelling_a_reader_closes_the_stream_without_an_aclose_race():
    closed = asyncio.Event()
    first_sent = asyncio.Event()

    async def engine_stream():
        try:
            yield "first"
            first_sent.set()
            await asyncio.Event().wait()          # a request that never ends by itself
            yield "never"
        finally:
            closed.set()

    async def never_disconnects():
        await asyncio.Event().wait()

    watcher = DisconnectWatcher(never_disconnects)
    received = []

    async def serve_exchange():
        events = until_disconnect(engine_stream(), watcher)
        try:
            async for item in events:
                received.append(item)
        finally:
            await events.aclose()

    task = asyncio.ensure_future(serve_exchange())
    await asyncio.wait_for(first_sent.wait(), 5)
    await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done and task.cancelled()              # a cancellation, not RuntimeError('aclose(): ... running')
    assert closed.is_set() and received == ["first"]
    watcher.close()
