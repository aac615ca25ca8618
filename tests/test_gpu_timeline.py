"""The GPU timeline behind /metrics' flint:gpu_busy_seconds / flint:gpu_idle_seconds: busy is each
step's start -> end, idle the gap from one step's end to the next one's start while the engine had
work; a gap after the engine scheduled nothing counts as stalled (it held requests) or quiet."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from flint_sched.api.metrics import EngineCollector
from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.core import Scheduler, SchedulerConfig, StepResult
from flint_sched.core.plan import fill_placeholders
from flint_sched.engine.async_engine import AsyncEngine
from flint_sched.executor.gpu_timeline import GpuTimeline
from flint_sched.executor.limits import ExecutorLimits
from flint_sched.sampling_params import SamplingParams

CONFIG = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, num_blocks=20, max_model_len=32, block_size=4,
                         sliding_window=8)


class Event:
    """A completed CUDA event at `ms` on the GPU's clock."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, end: "Event") -> float:
        return end.ms - self.ms


def test_busy_is_each_step_and_idle_the_gaps_between_steps_with_work():
    timeline = GpuTimeline()
    for start, end in ((0, 10), (10, 18), (21, 30)):           # back to back, then 3 ms waiting for the host
        timeline.collected(Event(start), Event(end))
    assert timeline.busy_s == pytest.approx(0.027) and timeline.idle_s == pytest.approx(0.003)
    timeline.break_chain()                                     # the engine ran out of work
    timeline.collected(Event(500), Event(505), prompt=True)
    assert timeline.busy_s == pytest.approx(0.032) and timeline.idle_s == pytest.approx(0.003)
    assert timeline.quiet_s == pytest.approx(0.470) and timeline.stalled_s == 0.0
    assert timeline.prompt_busy_s == pytest.approx(0.005)
    timeline.break_chain(has_requests=True)                    # requests held, nothing scheduled
    timeline.collected(Event(507), Event(510))
    timeline.collected(Event(511), Event(512))                 # the chain is back: idle again
    assert timeline.stalled_s == pytest.approx(0.002) and timeline.idle_s == pytest.approx(0.004)
    timeline.lose_track()                                      # a step without events: the gap is unknown
    timeline.collected(Event(600), Event(601))
    assert timeline.idle_s == pytest.approx(0.004) and timeline.quiet_s == pytest.approx(0.470)
    assert timeline.steps == 7 and timeline.idle_share == pytest.approx(4 / 41)
    assert GpuTimeline().idle_share == 0.0


def stats_engine(**parts) -> SimpleNamespace:
    """An engine of just the parts AsyncEngine.stats reads (what /metrics scrapes)."""
    engine = SimpleNamespace(**parts)
    engine.stats = lambda: AsyncEngine.stats(engine)
    return engine


def test_metrics_show_the_timeline_when_the_executor_has_one():
    timeline = GpuTimeline()
    timeline.collected(Event(0), Event(250))
    timeline.collected(Event(300), Event(400), prompt=True)
    text = {}
    for engine_timeline in (timeline, None):
        registry = CollectorRegistry()
        engine = stats_engine(scheduler=Scheduler(CONFIG), num_preemptions=0, gpu_timeline=engine_timeline,
                              executor=None)
        registry.register(EngineCollector(lambda engine=engine: engine, "m"))
        text[engine_timeline is not None] = generate_latest(registry).decode()
    assert 'flint:gpu_busy_seconds_total{model_name="m"} 0.35' in text[True]
    assert 'flint:gpu_idle_seconds_total{model_name="m"} 0.05' in text[True]
    assert 'flint:gpu_prompt_busy_seconds_total{model_name="m"} 0.1' in text[True]
    assert 'flint:gpu_stalled_seconds_total{model_name="m"} 0.0' in text[True]
    assert "gpu_busy" not in text[False]                      # the torch executor has no timeline


def test_cache_config_info_names_the_kv_dtype():
    """vLLM's cache_config_info: the cache's block size, dtype label and sizes, value 1."""
    text = {}
    for dtype in ("torch.bfloat16", "torch.float8_e4m3fn"):
        executor = SimpleNamespace(kv=SimpleNamespace(dtype=dtype))
        engine = stats_engine(scheduler=Scheduler(CONFIG), num_preemptions=0, gpu_timeline=None, executor=executor)
        registry = CollectorRegistry()
        registry.register(EngineCollector(lambda engine=engine: engine, "m"))
        text[dtype] = generate_latest(registry).decode()
    line = [x for x in text["torch.bfloat16"].splitlines() if x.startswith("flint:cache_config_info{")]
    assert len(line) == 1 and 'cache_dtype="auto"' in line[0] and line[0].endswith(" 1.0"), line
    assert 'cache_dtype="fp8_e4m3"' in text["torch.float8_e4m3fn"]
    assert 'num_gpu_blocks="20"' in line[0] and 'block_size="4"' in line[0] and 'num_ring_slots="2"' in line[0]


@pytest.fixture(scope="module")
def ckpt(tiny_short_window):
    return dummy_checkpoint(tiny_short_window, "bf16", seed=11, device="cpu")


class TimedSteps:
    """Steps that take no time, and a timeline that counts the engine's chain breaks."""

    limits = ExecutorLimits(fused_max_batch=8)

    def __init__(self):
        self.last, self.breaks = {}, []
        self.timeline = SimpleNamespace(break_chain=self._break)

    def _break(self, has_requests=False):
        self.breaks.append(has_requests)

    def launch(self, plan):
        fill_placeholders(plan.scheduled_requests, self.last)
        self.last = {e.request_id: 7 for e in plan.scheduled_requests if e.samples}
        return StepResult({rid: [t] for rid, t in self.last.items()})

    def collect(self, launched):
        return launched


async def test_the_engine_breaks_the_chain_when_it_runs_out_of_work(ckpt):
    executor = TimedSteps()
    engine = AsyncEngine(Scheduler(CONFIG), executor, ckpt.tokenizer, ckpt.config.vocab_size, async_scheduling=True)
    assert engine.gpu_timeline is executor.timeline
    engine.start()
    try:
        for _ in range(2):
            before = len(executor.breaks)
            async for _ in engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)):
                assert len(executor.breaks) == before        # busy: no break while the request runs
            for _ in range(100):                               # the loop reaches its wait (a hang guard)
                if len(executor.breaks) > before:
                    break
                await asyncio.sleep(0.01)
            assert executor.breaks[before:] == [False]        # out of requests: the gap is quiet
    finally:
        await engine.shutdown()
