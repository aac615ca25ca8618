"""Async scheduling: plans made one step ahead (decodes fed PLACEHOLDER_TOKEN) give the same
tokens, finish reasons and freed KV as plans made after every update."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.core import Scheduler, SchedulerConfig, StepResult
from flint_sched.core.plan import PLACEHOLDER_TOKEN, fill_placeholders
from flint_sched.engine import EngineConfig
from flint_sched.engine.async_engine import AsyncEngine
from flint_sched.engine.builder import build_engine, build_parts
from flint_sched.executor.limits import ExecutorLimits
from flint_sched.sampling_params import SamplingParams

EOS = 2
VOCAB = 12


def next_token(request_id: str, tokens: list[int]) -> int:
    """A deterministic stand-in for a model: the next token depends on the request and its history."""
    return random.Random(f"{request_id}:{len(tokens)}:{sum(tokens)}").randrange(VOCAB)


class FakeModel:
    """Feeds placeholders from its own last step, as an executor does, and checks that every fed
    token equals the request's history (so a wrong placeholder changes the outputs)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler, self.last, self.history = scheduler, {}, {}

    def run(self, plan) -> StepResult:
        fill_placeholders(plan.scheduled_requests, self.last)
        sampled = {}
        for e in plan.scheduled_requests:
            tokens = self.history.setdefault(e.request_id, [])
            del tokens[e.start_position:]                      # a preempted request starts again
            assert len(tokens) == e.start_position
            tokens += e.token_ids
            assert PLACEHOLDER_TOKEN not in tokens
            if e.samples:
                sampled[e.request_id] = [next_token(e.request_id, tokens)]
        self.last = {rid: t[-1] for rid, t in sampled.items()}
        return StepResult(sampled)


def drive(config: SchedulerConfig, requests, ahead: bool, abort_at: dict[int, str]) -> dict:
    scheduler = Scheduler(config)
    for rid, prompt, params in requests:
        scheduler.add_request(rid, prompt, params, eos_token_ids=[EOS])
    model, outputs, in_flight, steps = FakeModel(scheduler), {}, [], 0
    while scheduler.has_unfinished_requests() or in_flight:
        if not in_flight:
            plan = scheduler.schedule()
            assert not plan.is_empty, "stalled"
            in_flight.append((plan, model.run(plan)))
        if ahead and len(in_flight) == 1 and scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            if not plan.is_empty:
                in_flight.append((plan, model.run(plan)))
        plan, result = in_flight.pop(0)
        for out in scheduler.update(plan, result):
            got = outputs.setdefault(out.request_id, [[], None])
            got[0] += out.new_token_ids
            got[1] = out.finish_reason
        steps += 1
        if steps in abort_at and scheduler.abort_request(abort_at[steps]):
            outputs.setdefault(abort_at[steps], [[], None])[1] = "abort"
    allocator = scheduler.kv_allocator
    assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0
    return {rid: (tokens, str(reason)) for rid, (tokens, reason) in outputs.items()}


@st.composite
def cases(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(8, 48))
    config = SchedulerConfig(max_num_seqs=draw(st.integers(1, 5)), max_num_batched_tokens=draw(st.integers(5, 24)),
                             num_blocks=draw(st.integers(-(-max_model_len // block_size), 60)),
                             max_model_len=max_model_len, block_size=block_size, sliding_window=5)
    requests = []
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=max_model_len - 2))
        params = SamplingParams(max_tokens=draw(st.integers(1, max_model_len - len(prompt))),
                                ignore_eos=draw(st.booleans()), stop_token_ids=tuple(draw(st.sets(st.integers(3, 11),
                                                                                                 max_size=1))))
        requests.append((f"r{i}", prompt, params))
    abort_at = {draw(st.integers(1, 30)): f"r{draw(st.integers(0, len(requests) - 1))}"
                for _ in range(draw(st.integers(0, 2)))}
    return config, requests, abort_at


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plans_made_one_step_ahead_give_the_same_outputs(case):
    config, requests, abort_at = case
    sync = drive(config, requests, ahead=False, abort_at={})
    assert drive(config, requests, ahead=True, abort_at={}) == sync
    # Aborts land at different steps of the two drivers; both must drain without leaks or stale plans.
    drive(config, requests, ahead=True, abort_at=abort_at)


def test_a_decode_is_fed_a_placeholder_while_its_previous_step_runs():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, num_blocks=20, max_model_len=32, block_size=4,
                             sliding_window=5)
    scheduler = Scheduler(config)
    scheduler.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3))
    first = scheduler.schedule()                  # the prompt, sampling o0
    second = scheduler.schedule()                 # made before first's update: o0 unknown
    [entry] = second.scheduled_requests
    assert entry.token_ids == [PLACEHOLDER_TOKEN] and entry.start_position == 3 and entry.samples
    scheduler.update(first, StepResult({"a": [9]}))
    scheduler.update(second, StepResult({"a": [10]}))
    assert scheduler.get_request("a").all_token_ids == [5, 6, 7, 9, 10]
    third = scheduler.schedule()                  # o2 would be the last: nothing is pending beyond it
    assert third.scheduled_requests[0].token_ids == [10]
    assert scheduler.schedule().is_empty          # o2 in flight ends the request by length


# -- the engine on flint-tiny ----------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tiny_short_window):
    return dummy_checkpoint(tiny_short_window, "bf16", seed=11, device="cpu")


async def run(ckpt, async_scheduling: bool, requests):
    parts = build_parts(EngineConfig(device="cpu", max_num_seqs=6, max_num_batched_tokens=24, block_size=4,
                                     num_kv_blocks=60, async_scheduling=async_scheduling), progress=False,
                        checkpoint=ckpt)
    engine = build_engine(parts)
    assert engine.async_scheduling is async_scheduling
    engine.start()

    async def one(prompt, params):
        last = None
        async for out in engine.add_request(prompt, params):
            last = out
        return [(c.token_ids, c.finish_reason) for c in last.outputs]

    try:
        results = await asyncio.gather(*(one(p, sp) for p, sp in requests))
        allocator = engine.scheduler.kv_allocator
        assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0
        return results
    finally:
        await engine.shutdown()


async def test_engine_outputs_are_the_same_with_and_without_async_scheduling(ckpt):
    rng = random.Random(3)
    requests = []
    for i in range(14):
        params = SamplingParams(
            temperature=0.0 if i % 3 else 0.8, seed=i, max_tokens=rng.randint(1, 14), ignore_eos=True,
            # penalties and min_tokens read the output history: the engine waits for those steps
            presence_penalty=0.5 if i % 5 == 0 else 0.0, min_tokens=2 if i % 7 == 0 else 0,
            stop=("e",) if i % 4 == 0 else ())
        requests.append(([rng.randrange(4000) for _ in range(rng.randint(1, 30))], params))
    assert await run(ckpt, True, requests) == await run(ckpt, False, requests)


async def agent_turns(ckpt, async_scheduling: bool, caching: bool):
    """Four sessions at once, three turns each: a turn's prompt is the last prompt, its output and
    new tokens (so later turns hit the prefix cache). Greedy tokens of every turn, and cached tokens."""
    parts = build_parts(EngineConfig(device="cpu", max_num_seqs=6, max_num_batched_tokens=24, block_size=4,
                                     num_kv_blocks=200, async_scheduling=async_scheduling,
                                     enable_prefix_caching=caching), progress=False, checkpoint=ckpt)
    engine = build_engine(parts)
    engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def session(n):
        rng, prompt, turns = random.Random(n), [], []
        for _ in range(3):
            prompt = prompt + [rng.randrange(4000) for _ in range(rng.randint(3, 30))]
            last = None
            async for last in engine.add_request(prompt, params):
                pass
            turns.append((last.outputs[0].token_ids, last.num_cached_tokens))
            prompt = prompt + last.outputs[0].token_ids
        return turns

    try:
        return await asyncio.gather(*(session(n) for n in range(4)))
    finally:
        await engine.shutdown()


async def test_prefix_cache_hits_under_async_scheduling_give_the_tokens_of_a_cold_run(ckpt):
    cold = await agent_turns(ckpt, async_scheduling=False, caching=False)
    for async_scheduling in (False, True):
        warm = await agent_turns(ckpt, async_scheduling=async_scheduling, caching=True)
        assert [[tokens for tokens, _ in s] for s in warm] == [[tokens for tokens, _ in s] for s in cold]
        assert all(cached > 0 for s in warm for _, cached in s[1:])      # later turns hit


class LaunchesThatRun:
    """launch returns once its step has run (the torch executor's, or one that samples on the host);
    every launch after the first waits for `release` too."""

    limits = ExecutorLimits(fused_max_batch=8)

    def __init__(self):
        self.release, self.last = threading.Event(), {}

    def launch(self, plan) -> StepResult:
        if self.last:
            self.release.wait()
        fill_placeholders(plan.scheduled_requests, self.last)
        self.last = {e.request_id: 7 for e in plan.scheduled_requests if e.samples}
        return StepResult({rid: [token] for rid, token in self.last.items()})

    def collect(self, launched: StepResult) -> StepResult:
        return launched


async def test_a_step_is_read_back_while_the_next_launch_still_runs(ckpt):
    """The prompt's first token streams while the decode launched after it (one step ahead) still runs."""
    executor = LaunchesThatRun()
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, num_blocks=20, max_model_len=32,
                             block_size=4, sliding_window=5)
    engine = AsyncEngine(Scheduler(config), executor, ckpt.tokenizer, ckpt.config.vocab_size, async_scheduling=True)
    engine.start()
    try:
        stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        first = await asyncio.wait_for(anext(stream), 30)            # a hang guard, not a timing
        assert first.outputs[0].token_ids == [7] and not executor.release.is_set()
        executor.release.set()
        async for last in stream:
            pass
        assert last.outputs[0].token_ids == [7, 7, 7] and last.finished
    finally:
        executor.release.set()
        await engine.shutdown()


class Timeline:
    """A GPU of one stream: a launched step starts when the one before it ends (or at once) and
    takes `step_s`; collect waits for its end. Records each step's requests and interval."""

    limits = ExecutorLimits(fused_max_batch=8)

    def __init__(self, step_s: float):
        self.step_s, self.last = step_s, {}
        self.steps: list[tuple[set[str], float, float]] = []     # (request ids, start, end)

    def launch(self, plan):
        fill_placeholders(plan.scheduled_requests, self.last)
        now = time.perf_counter()
        start = max(now, self.steps[-1][2]) if self.steps else now
        self.steps.append(({e.request_id for e in plan.scheduled_requests}, start, start + self.step_s))
        self.last = {e.request_id: 7 for e in plan.scheduled_requests if e.samples}
        return start + self.step_s, StepResult({rid: [t] for rid, t in self.last.items()})

    def collect(self, launched):
        end, result = launched
        time.sleep(max(0.0, end - time.perf_counter()))
        return result


async def first_step_of_a_request_arriving_mid_step(ckpt, margin_s: float) -> int:
    """Steps between the one running when a request arrives (15 ms into a 60 ms decode step) and its
    first: the engine launches a step ahead, `margin_s` the late launch-ahead."""
    executor = Timeline(step_s=0.06)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, num_blocks=40, max_model_len=64,
                             block_size=4, sliding_window=5)
    engine = AsyncEngine(Scheduler(config), executor, ckpt.tokenizer, ckpt.config.vocab_size,
                         async_scheduling=True, launch_margin_s=margin_s)
    engine.start()
    try:
        long = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
        consume = asyncio.ensure_future(asyncio.wait_for(asyncio.gather(*[_drain(long)]), 30))
        while len(executor.steps) < 5:                         # decode steps timed back to back
            await asyncio.sleep(0.002)
        _, start, end = next(s for s in executor.steps if s[1] <= time.perf_counter() < s[2])
        target = start + 0.015 if time.perf_counter() < start + 0.010 else end + 0.015   # (decode steps run back to back)
        await asyncio.sleep(max(0.0, target - time.perf_counter()))
        arrival = time.perf_counter()
        assert any(s + 0.005 <= arrival < s + 0.040 for _, s, _ in executor.steps[-2:]), "the arrival missed mid-step"
        running = next(i for i, (_, s, e) in enumerate(executor.steps) if s <= arrival < e)
        await asyncio.wait_for(anext(engine.add_request([8, 9], SamplingParams(max_tokens=1, ignore_eos=True),
                                                        request_id="new")), 30)
        first = next(i for i, (ids, _, _) in enumerate(executor.steps) if "new" in ids)
        await consume
        return first - running
    finally:
        await engine.shutdown()


async def _drain(stream):
    async for _ in stream:
        pass


async def test_late_launch_ahead_lets_a_new_request_join_the_next_step(ckpt):
    """With a step launched ahead, a request arriving mid-step waits for the step after the next;
    with the late launch-ahead (the next step planned 10 ms before the running one ends, or on an
    arrival) it joins the next one."""
    assert await first_step_of_a_request_arriving_mid_step(ckpt, 0.0) == 2
    assert await first_step_of_a_request_arriving_mid_step(ckpt, 0.010) == 1


def test_launch_margin_must_not_be_negative(ckpt):
    with pytest.raises(ValueError, match="launch margin"):
        AsyncEngine(Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, num_blocks=8, max_model_len=16,
                                              block_size=4)), Timeline(0.01), ckpt.tokenizer, ckpt.config.vocab_size,
                    async_scheduling=True, launch_margin_s=-1.0)
    with pytest.raises(ValueError, match="launch_margin_ms"):
        EngineConfig(launch_margin_ms=-0.5)
