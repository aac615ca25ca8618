"""Prefix caching under random traffic, against a content-tracking fake executor (no torch).

The fake executor writes each position's token into its block row and ring row, and before every
chunk checks what a real one would read: the full-layer rows of all earlier positions and the ring
rows of the last window - 1 positions must hold this request's tokens. So a hit that served the
wrong blocks, a snapshot copied at the wrong time, or a write into a shared block fails here.
After every step: block states partition the pool, ref counts equal the live tables holding each
block, a snapshot's key block is cached, and no chunk writes a keyed or shared block; once every
request has ended (finished, aborted, preempted and resumed), nothing is held.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flint_sched.core import Scheduler, SchedulerConfig, StepResult
from flint_sched.core.kv_allocator import ring_rows
from flint_sched.core.plan import PLACEHOLDER_TOKEN
from flint_sched.sampling_params import SamplingParams

VOCAB = 50


class ContentExecutor:
    """Tokens instead of K/V: blocks[(block, row)] and rings[slot][row] = (position, token), a ring
    of ring_rows(window, block_size) rows as the executors keep."""

    def __init__(self, block_size: int, window: int) -> None:
        self.block_size, self.window = block_size, window
        self.ring_rows = ring_rows(window, block_size)
        self.blocks: dict[tuple[int, int], int] = {}
        self.rings: dict[int, dict[int, tuple[int, int]]] = {}
        self.num_restored_tokens = 0
        self.last: dict[str, int] = {}

    def execute(self, plan) -> StepResult:
        bs, w = self.block_size, self.window
        for source, destination in plan.ring_copies:
            self.rings[destination] = dict(self.rings.get(source, {}))
        sampled = {}
        for e in plan.scheduled_requests:
            tokens = e.prompt_token_ids + e.output_token_ids
            if len(tokens) < e.end_position:      # async scheduling: fed the token the last plan sampled
                assert e.token_ids[-1] == PLACEHOLDER_TOKEN and len(tokens) + 1 == e.end_position
                tokens = tokens + [self.last[e.request_id]]
            ring = self.rings.setdefault(e.ring_slot, {})
            for p in range(e.start_position):
                assert self.blocks.get((e.block_table[p // bs], p % bs)) == tokens[p], f"{e.request_id} block row {p}"
            for p in range(max(0, e.start_position - w + 1), e.start_position):
                assert ring.get(p % self.ring_rows) == (p, tokens[p]), f"{e.request_id} ring row of {p}"
            for p in range(e.start_position, e.end_position):
                self.blocks[(e.block_table[p // bs], p % bs)] = tokens[p]
                ring[p % self.ring_rows] = (p, tokens[p])
            if e.samples:
                sampled[e.request_id] = [sum(tokens[-3:]) % VOCAB]
        self.last = {rid: t[-1] for rid, t in sampled.items()}
        return StepResult(sampled)


def check_pool(scheduler: Scheduler, plan) -> None:
    allocator = scheduler.kv_allocator
    pool = allocator.blocks
    live = {rid: allocator.get(rid) for rid in list(scheduler._running)}
    holds = Counter(b for a in live.values() for b in a.block_table)
    for block in range(pool.num_total):
        assert pool.ref_count(block) == holds[block], f"block {block}"
    assert len(pool._free) + len(pool._lru) + sum(1 for b in holds) == pool.num_total
    assert not set(pool._free) & set(pool._lru) and not set(pool._free) & set(holds)
    assert all(pool._key_of_block[b] is not None for b in pool._lru)
    for key in allocator.snapshots._slot_of_key:
        assert pool.cached_block(key) is not None, "a snapshot outlived its key block"
    for e in plan.scheduled_requests:
        for block in e.block_table[e.start_position // allocator.block_size:]:
            assert pool.ref_count(block) == 1 and pool._key_of_block[block] is None, "a chunk writes a shared block"


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_seqs = draw(st.integers(1, 4))
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 40)),
        num_blocks=draw(st.integers(24 // block_size + 2, 120 // block_size + 4)),
        max_model_len=64,
        block_size=block_size,
        sliding_window=draw(st.sampled_from([2, 3, 5, 513])),
        enable_prefix_caching=True,
        num_ring_snapshots=draw(st.integers(1, 5)),
    )
    ops = draw(st.lists(st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 12), st.integers(1, 8)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.just(("reset",)),
    ), min_size=1, max_size=40))
    return config, ops, draw(st.integers(0, 2**16)), draw(st.booleans())


# Found by this test: one snapshot slot, two requests, async scheduling. Each request's snapshot
# evicted the other's, and the update after re-took it while the next chunk was already in flight,
# so the copy kept a later window under the old key and the preempted request restored it.
ONE_SLOT_TWO_REQUESTS = (
    SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=7, num_blocks=26, max_model_len=64, block_size=1,
                    sliding_window=2, enable_prefix_caching=True, num_ring_snapshots=1),
    [("add", 0, 2, 7), ("add", 1, 5, 8)], 57581, True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
@example(ONE_SLOT_TWO_REQUESTS)
def test_random_traffic_with_shared_prefixes(scenario):
    config, ops, seed, ahead = scenario
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    scheduler = Scheduler(config)
    executor = ContentExecutor(config.block_size, config.sliding_window)
    added, in_flight = [], []

    def launch():
        plan = scheduler.schedule()
        check_pool(scheduler, plan)
        if not plan.is_empty:
            in_flight.append((plan, executor.execute(plan)))

    def step():
        """One update; `ahead` (async scheduling): the next plan is made and run before it."""
        if not in_flight:
            launch()
        if ahead and len(in_flight) == 1:
            launch()
        if in_flight:
            scheduler.update(*in_flight.pop(0))

    for op in ops:
        if op[0] == "add":
            _, which, suffix_len, max_tokens = op
            prompt = prefixes[which] + [rng.randrange(VOCAB) for _ in range(suffix_len)]
            rid = f"r{len(added)}"
            try:
                scheduler.add_request(rid, prompt[:63], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                added.append(rid)
            except ValueError:
                pass
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        elif op[0] == "abort" and added:
            scheduler.abort_request(added[op[1] % len(added)])
        elif op[0] == "reset":
            assert scheduler.reset_prefix_cache()
    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        step()
    assert not scheduler.has_unfinished_requests()
    allocator = scheduler.kv_allocator
    assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0
    assert allocator.num_free_blocks == allocator.num_total_blocks
    cache = scheduler.prefix_cache
    assert 0 <= cache.num_hit_tokens <= cache.num_queried_tokens


def test_hits_happen_in_this_traffic():
    """The property test is not vacuous: shared prefixes do hit, and cached blocks get evicted."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, num_blocks=12, max_model_len=64,
                             block_size=4, sliding_window=5, enable_prefix_caching=True, num_ring_snapshots=2)
    scheduler = Scheduler(config)
    executor = ContentExecutor(4, 5)
    shared = list(range(1, 22))
    for i in range(8):
        scheduler.add_request(f"r{i}", shared + [30 + i] * (i % 3), SamplingParams(max_tokens=3, ignore_eos=True))
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            check_pool(scheduler, plan)
            scheduler.update(plan, executor.execute(plan))
    cache = scheduler.prefix_cache
    assert cache.num_hit_tokens == 7 * 20
    assert scheduler.kv_allocator.blocks.num_cached > 0


def test_a_snapshot_is_taken_before_the_next_chunk_when_plans_run_ahead():
    """Async scheduling: the chunk past the snapshot position must not run before the rings are
    copied, or a later hit restores rings that already hold positions past it; the plan made
    while the chunk to the snapshot position runs carries the copy ahead of its own chunk."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, num_blocks=40, max_model_len=64,
                             block_size=4, sliding_window=3, enable_prefix_caching=True, num_ring_snapshots=2)
    scheduler = Scheduler(config)
    executor = ContentExecutor(4, 3)
    shared = list(range(1, 23))
    in_flight = []
    for i in range(3):
        scheduler.add_request(f"r{i}", shared + [40 + i], SamplingParams(max_tokens=4, ignore_eos=True))
        while scheduler.has_unfinished_requests() or in_flight:
            while len(in_flight) < 2 and not (plan := scheduler.schedule()).is_empty:
                check_pool(scheduler, plan)
                in_flight.append((plan, executor.execute(plan)))       # the ring checks run here
            scheduler.update(*in_flight.pop(0))
    assert scheduler.prefix_cache.num_hit_tokens == 2 * 20


def test_each_conversation_keeps_its_snapshot_with_one_slot_per_conversation():
    """Four conversations, four snapshot slots, three turns each, one request at a time: every turn
    after the first hits its conversation's last snapshot. With LRU alone, conversation 0's second
    turn (restored from its snapshot, so the most recently used) would evict conversation 1's
    snapshot before conversation 1 comes back for it."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, num_blocks=200, max_model_len=128,
                             block_size=4, sliding_window=3, enable_prefix_caching=True, num_ring_snapshots=4)
    scheduler = Scheduler(config)
    executor = ContentExecutor(4, 3)
    rng = random.Random(7)
    prompts = {c: [rng.randrange(VOCAB) for _ in range(10 + c)] for c in range(4)}
    expected_hits = 0
    for turn in range(3):
        for c, prompt in prompts.items():
            scheduler.add_request(f"c{c}-{turn}", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            while scheduler.has_unfinished_requests():
                plan = scheduler.schedule()
                check_pool(scheduler, plan)
                scheduler.update(plan, executor.execute(plan))
            if turn:
                expected_hits += (len(prompt) - 9 - 1) // 4 * 4      # the last turn's snapshot position
            prompts[c] = prompt + [rng.randrange(VOCAB) for _ in range(9)]
    assert scheduler.prefix_cache.num_hit_tokens == expected_hits


def test_one_of_several_requests_arriving_together_snapshots_their_shared_prefix():
    """Three prompts sharing a 40-token start with a finished one, admitted in one step: one of them
    stops and snapshots where the cached blocks end (D = 40), the others run through; a fourth
    arriving later hits there."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, num_blocks=200, max_model_len=128,
                             block_size=4, sliding_window=3, enable_prefix_caching=True, num_ring_snapshots=8)
    scheduler = Scheduler(config)
    executor = ContentExecutor(4, 3)
    rng = random.Random(11)
    shared = [rng.randrange(VOCAB) for _ in range(40)]
    chunks = []

    def run(*rids):
        for rid in rids:
            scheduler.add_request(rid, shared + [rng.randrange(VOCAB) for _ in range(20)],
                                  SamplingParams(max_tokens=2, ignore_eos=True))
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            check_pool(scheduler, plan)
            chunks.extend((e.request_id, e.start_position, e.end_position) for e in plan.scheduled_requests)
            scheduler.update(plan, executor.execute(plan))

    run("first")
    run("a", "b", "c")
    assert sum(1 for rid, start, end in chunks if rid in "abc" and end == 40) == 1
    assert all(start == 0 for rid, start, _ in chunks if rid in "abc" and start < 40)
    run("late")
    assert [start for rid, start, _ in chunks if rid == "late"][0] == 40
