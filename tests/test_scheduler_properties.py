"""Random steps against a shadow model: invariants after every schedule() and update().

Harness keeps its own picture of every request (tokens, computed count, waiting order) and checks
the scheduler against it: budget and max_num_seqs, exact block coverage, no shared or leaked
blocks or ring slots, FCFS admission, finish reasons, each request finishing exactly once, and
that the engine never stalls while requests are unfinished.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from flint_sched.core import Scheduler, SchedulerConfig, StepResult
from flint_sched.sampling_params import SamplingParams

EOS = 2
STOP_TOKEN = 7
VOCAB = 10


@dataclass
class Shadow:
    prompt: list[int]
    params: SamplingParams
    max_num_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_preemptions: int = 0
    running: bool = False
    admitted_at: int = -1

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(4, 96))
    blocks_for_one = -(-max_model_len // block_size)
    max_num_seqs = draw(st.integers(1, 6))
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 48)),
        num_blocks=draw(
            st.integers(max(1, blocks_for_one // 2), blocks_for_one + 2)
            | st.integers(blocks_for_one, 3 * blocks_for_one)
        ),
        max_model_len=max_model_len,
        block_size=block_size,
        sliding_window=draw(st.sampled_from([5, 513])),
        fused_max_seqs=draw(st.integers(0, 8)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 3, 8])),
    )


class Harness:
    """A Scheduler plus the shadow model it is checked against after every call."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.shadows: dict[str, Shadow] = {}
        self.waiting: deque[str] = deque()
        self.finished: dict[str, str] = {}
        self.reported_finished: set[str] = set()
        self.num_added = 0
        self.num_admissions = 0

    def running_ids(self) -> list[str]:
        return [rid for rid, shadow in self.shadows.items() if shadow.running]

    def add(self, prompt_len, max_tokens, min_tokens, ignore_eos, stop) -> None:
        rid = f"r{self.num_added}"
        self.num_added += 1
        prompt = [(self.num_added * 31 + i * 7) % VOCAB for i in range(prompt_len)]
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            stop_token_ids=[STOP_TOKEN] if stop else [],
        )
        max_num_tokens = min(prompt_len + max_tokens, self.config.max_model_len)
        max_kv_blocks = -(-(max_num_tokens - 1) // self.config.block_size)
        if prompt_len >= self.config.max_model_len or max_kv_blocks > self.config.num_blocks:
            with pytest.raises(ValueError):
                self.scheduler.add_request(rid, prompt, params, eos_token_ids={EOS})
            return
        self.scheduler.add_request(rid, prompt, params, eos_token_ids={EOS})
        self.shadows[rid] = Shadow(prompt, params, max_num_tokens)
        self.waiting.append(rid)

    def finish_early(self, pick: int, reason: str) -> None:
        """Abort (or finish for a stop string) any request ever added, finished ones included."""
        if self.num_added == 0:
            return
        rid = f"r{pick % self.num_added}"
        expected = rid in self.shadows
        assert self.scheduler.finish_request(rid, reason) is expected
        if expected:
            self._mark_finished(rid, reason)

    def _mark_finished(self, rid: str, reason: str) -> None:
        assert rid not in self.finished, f"{rid} finished twice"
        self.finished[rid] = reason
        shadow = self.shadows.pop(rid)
        if not shadow.running:
            self.waiting.remove(rid)

    def step(self, sample, abort_pick: int | None = None) -> None:
        plan = self.scheduler.schedule()
        self.check_plan(plan)
        if abort_pick is not None and plan.scheduled_requests:
            entry = plan.scheduled_requests[abort_pick % len(plan.scheduled_requests)]
            self.finish_early(int(entry.request_id[1:]), "abort")
        sampled = {e.request_id: sample(e.request_id) for e in plan.scheduled_requests if e.samples}
        outputs = self.scheduler.update(plan, StepResult(sampled))
        self.check_outputs(plan, sampled, outputs)
        self.check_allocator()

    def check_plan(self, plan) -> None:
        config = self.config
        entries = plan.scheduled_requests
        for rid in plan.finished_request_ids:
            assert rid in self.finished and rid not in self.reported_finished
            self.reported_finished.add(rid)
        if self.shadows:
            assert entries, "stalled: unfinished requests but nothing scheduled"
        assert plan.num_tokens == sum(len(e.token_ids) for e in entries)
        assert plan.num_tokens <= config.max_num_batched_tokens
        assert len(entries) <= config.max_num_seqs
        assert len({e.request_id for e in entries}) == len(entries)
        if config.long_prefill_token_threshold:
            assert all(len(e.token_ids) <= config.long_prefill_token_threshold for e in entries)

        victims = plan.preempted_request_ids
        if victims:
            ages = [self.shadows[rid].admitted_at for rid in victims]
            survivors = [
                s.admitted_at for rid, s in self.shadows.items() if s.running and rid not in victims
            ]
            assert ages == sorted(ages, reverse=True) and len(set(victims)) == len(victims)
            assert not survivors or max(survivors) < min(ages), "the newest running are preempted"
        for rid in victims:
            shadow = self.shadows[rid]
            assert shadow.running and rid not in {e.request_id for e in entries}
            shadow.running, shadow.num_computed = False, 0
            shadow.num_preemptions += 1
        for rid in victims:
            self.waiting.appendleft(rid)

        was_running = [e for e in entries if self.shadows[e.request_id].running]
        admitted = [e.request_id for e in entries if not self.shadows[e.request_id].running]
        assert entries[: len(was_running)] == was_running, "running requests come before admissions"
        assert admitted == list(self.waiting)[: len(admitted)], "admission is first come, first served"
        assert not (admitted and plan.preempted_request_ids), "no admission in a step that preempts"
        remaining = [len(self.shadows[e.request_id].all_tokens) - e.start_position for e in was_running]
        is_decode = [n == 1 for n in remaining]
        assert is_decode == sorted(is_decode, reverse=True), "decodes before prefill chunks"
        for rid in admitted:
            self.waiting.popleft()
            self.shadows[rid].running = True
            self.shadows[rid].admitted_at = self.num_admissions
            self.num_admissions += 1

        seen_blocks: set[int] = set()
        for entry in entries:
            shadow = self.shadows[entry.request_id]
            tokens = shadow.all_tokens
            end = entry.start_position + len(entry.token_ids)
            assert entry.start_position == shadow.num_computed and len(entry.token_ids) >= 1
            assert entry.token_ids == tokens[entry.start_position : end]
            assert end <= config.max_model_len and end <= shadow.max_num_tokens
            assert entry.samples == (end == len(tokens))
            assert len(entry.block_table) == -(-end // config.block_size), "blocks cover the chunk"
            assert seen_blocks.isdisjoint(entry.block_table)
            seen_blocks.update(entry.block_table)
            assert 0 <= entry.ring_slot < config.max_num_seqs
            is_resumed = entry.start_position == 0 and shadow.num_preemptions > 0
            assert entry.is_resumed_after_preemption == is_resumed
            assert entry.output_token_ids == shadow.output and entry.sampling_params is shadow.params
        assert len({e.ring_slot for e in entries}) == len(entries)
        is_decode_only = all(len(e.token_ids) == 1 and e.samples for e in entries)
        expected_path = is_decode_only and len(entries) <= config.fused_max_seqs
        assert plan.path == ("fused" if expected_path else "grouped")

    def check_outputs(self, plan, sampled, outputs) -> None:
        expected_ids = [
            e.request_id for e in plan.scheduled_requests if e.samples and e.request_id in self.shadows
        ]
        assert [o.request_id for o in outputs] == expected_ids
        for entry in plan.scheduled_requests:
            if entry.request_id in self.shadows:
                self.shadows[entry.request_id].num_computed += len(entry.token_ids)
        for output in outputs:
            shadow = self.shadows[output.request_id]
            reason = None
            consumed = []
            for token in sampled[output.request_id]:
                shadow.output.append(token)
                consumed.append(token)
                params = shadow.params
                if len(shadow.output) >= params.min_tokens and (
                    (token == EOS and not params.ignore_eos) or token in params.stop_token_ids
                ):
                    reason = "stop"
                elif len(shadow.all_tokens) >= shadow.max_num_tokens:
                    reason = "length"
                if reason:
                    break
            assert output.new_token_ids == consumed and output.finish_reason == reason
            if reason:
                self._mark_finished(output.request_id, reason)

    def check_allocator(self) -> None:
        allocator = self.scheduler.kv_allocator
        assert allocator.num_free_blocks + allocator.num_used_blocks == allocator.num_total_blocks
        num_ring_slots = allocator.num_free_ring_slots + allocator.num_used_ring_slots
        assert num_ring_slots == allocator.num_total_ring_slots
        running = self.running_ids()
        assert self.scheduler.num_running_requests == len(running) <= self.config.max_num_seqs
        assert self.scheduler.num_waiting_requests == len(self.waiting)
        held = [allocator.get(rid) for rid in running]
        assert all(allocation is not None for allocation in held)
        assert all(allocator.get(rid) is None for rid in self.waiting)
        blocks = [b for allocation in held for b in allocation.block_table]
        assert len(blocks) == len(set(blocks)) == allocator.num_used_blocks, "block leaked or shared"
        ring_slots = {allocation.ring_slot for allocation in held}
        assert len(ring_slots) == allocator.num_used_ring_slots == len(held)

    def drain(self, sample) -> None:
        """Finish everything. The oldest running request gains >= 1 token every step (it only
        loses its blocks when it runs alone, and alone it fits), which bounds the step count."""
        max_steps = sum(shadow.max_num_tokens + 1 for shadow in self.shadows.values())
        for _ in range(max_steps):
            if not self.shadows:
                break
            self.step(sample)
        assert not self.shadows and not self.scheduler.has_unfinished_requests(), "did not drain"
        self.check_plan(self.scheduler.schedule())
        assert self.reported_finished == set(self.finished)
        allocator = self.scheduler.kv_allocator
        assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0


def random_sampler(rng: random.Random):
    return lambda rid: [rng.randrange(VOCAB) for _ in range(1 if rng.random() < 0.95 else 2)]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), seed=st.integers(0, 2**32 - 1))
def test_random_driver_keeps_every_invariant(config, seed):
    rng = random.Random(seed)
    harness = Harness(config)
    sample = random_sampler(rng)
    for _ in range(500):
        roll = rng.random()
        if roll < 0.3:
            harness.add(
                prompt_len=rng.randint(1, 48),
                max_tokens=rng.randint(1, 24),
                min_tokens=rng.randint(0, 3),
                ignore_eos=rng.random() < 0.2,
                stop=rng.random() < 0.5,
            )
        elif roll < 0.33:
            harness.finish_early(rng.randrange(10**6), "abort")
        elif roll < 0.35:
            harness.finish_early(rng.randrange(10**6), "stop")
        else:
            harness.step(sample, rng.randrange(10**6) if rng.random() < 0.03 else None)
    harness.drain(sample)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(config=configs())
    def start(self, config):
        self.harness = Harness(config)

    @rule(
        prompt_len=st.integers(1, 40),
        max_tokens=st.integers(1, 20),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        stop=st.booleans(),
    )
    def add_request(self, prompt_len, max_tokens, min_tokens, ignore_eos, stop):
        self.harness.add(prompt_len, max_tokens, min_tokens, ignore_eos, stop)

    @rule(lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=2, max_size=8))
    def add_requests(self, lengths):
        for prompt_len, max_tokens in lengths:
            self.harness.add(prompt_len, max_tokens, 0, False, False)

    @rule(pick=st.integers(0, 1000), reason=st.sampled_from(["abort", "stop", "length"]))
    def finish_early(self, pick, reason):
        self.harness.finish_early(pick, reason)

    @rule(
        tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
        abort_pick=st.none() | st.integers(0, 1000),
    )
    def step(self, tokens, abort_pick):
        cycle = iter(tokens * 64)
        self.harness.step(lambda rid: [next(cycle)], abort_pick)

    @rule(
        tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
        repeat=st.integers(1, 20),
    )
    def run_steps(self, tokens, repeat):
        for i in range(repeat):
            cycle = iter(tokens[i % len(tokens) :] * 64)
            self.harness.step(lambda rid: [next(cycle)])

    @invariant()
    def counts_add_up(self):
        if hasattr(self, "harness"):
            self.harness.check_allocator()

    def teardown(self):
        if hasattr(self, "harness"):
            self.harness.drain(random_sampler(random.Random(0)))


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
