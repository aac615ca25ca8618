"""The engine's watchdog and lifecycle on the CPU: a hung step, a dead loop, abort_all, shutdown."""

import asyncio
import threading

import pytest

from flint_sched.engine.async_engine import StepTimeoutError
from flint_sched.engine.builder import build_engine, build_parts
from flint_sched.engine.config import EngineConfig
from flint_sched.engine.outputs import EngineError
from flint_sched.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def parts():
    return build_parts(EngineConfig(model="flint-tiny", load_format="dummy", device="cpu", num_kv_blocks=64,
                                    max_model_len=128), progress=False)


class HangingExecutor:
    """Runs the real executor until `hang` is set, then blocks its step until `release` is."""

    def __init__(self, executor):
        self.executor = executor
        self.hang = threading.Event()
        self.release = threading.Event()

    def execute(self, plan):
        if self.hang.is_set():
            self.release.wait()
        return self.executor.execute(plan)


async def drain(stream):
    outputs = []
    async for out in stream:
        outputs.append(out)
    return outputs


async def test_a_hung_step_fails_requests_and_frees_everything(parts):
    engine = build_engine(parts)
    hanging = HangingExecutor(engine.executor)
    engine.executor = hanging
    engine.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0)
        done = await drain(engine.add_request([1, 2, 3], params))
        assert done[-1].finished and done[-1].outputs[0].finish_reason == "length"
        engine.step_timeout_s = 0.5           # from here on every step hangs: no slow real step can trip it
        hanging.hang.set()
        stream = engine.add_request([4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(StepTimeoutError, match="has not returned after 0.5 s"):
            await asyncio.wait_for(drain(stream), 30)
        assert isinstance(await asyncio.wait_for(engine.join(), 5), StepTimeoutError)
        assert not engine.is_running and engine.num_unfinished_requests == 0
        assert engine.scheduler.kv_allocator.num_used_blocks == 0
        with pytest.raises(EngineError):
            engine.add_request([1], params)
    finally:
        await asyncio.wait_for(engine.shutdown(), 5)      # does not wait on the hung thread
        hanging.release.set()


async def test_a_dead_loop_is_reported_by_join(parts):
    engine = build_engine(parts)
    engine.start()
    try:
        def broken_update(plan, result):
            raise RuntimeError("scheduler bug")

        engine.scheduler.update = broken_update
        with pytest.raises(EngineError, match="scheduler bug"):
            await drain(engine.add_request([1, 2, 3], SamplingParams(max_tokens=4)))
        assert "scheduler bug" in repr(await asyncio.wait_for(engine.join(), 5))
    finally:
        await engine.shutdown()


async def test_abort_all_ends_every_stream_with_abort(parts):
    engine = build_engine(parts)
    engine.start()
    try:
        params = SamplingParams(max_tokens=100, ignore_eos=True, n=2)
        streams = [engine.add_request([7, 8, 9], params) for _ in range(3)]
        first = [await anext(s) for s in streams]
        assert all(not out.finished for out in first)
        assert engine.abort_all() == 3 and engine.num_unfinished_requests == 0
        for stream in streams:
            last = (await drain(stream))[-1]
            assert last.finished and [o.finish_reason for o in last.outputs] == ["abort", "abort"]
        assert engine.scheduler.kv_allocator.num_used_blocks == 0
        assert engine.is_running
    finally:
        await engine.shutdown()
    assert await engine.join() is None
