"""Prefix caching end to end on the torch executor (CPU, float32, flint-tiny): a request served from
the cache (shared full-layer blocks, rings restored from a snapshot) gives the logits of a cold run.

Exactly equal when both runs compute their positions in the same chunks (a budget of the hit's
length: every chunk boundary is a multiple of it in both runs); with other chunkings the two differ as chunked
and unchunked prefill do (float32 rounding, ~1e-6), so those runs are checked against the
reference with the tolerance of test_torch_executor.py.
"""

import random

import pytest
import torch

from conftest import fp32_weights
from flint_sched.core.plan import ScheduledRequest, StepPlan
from flint_sched.core.scheduler import Scheduler
from flint_sched.core.scheduler_config import SchedulerConfig
from flint_sched.executor.kv_cache import KVCache
from flint_sched.sampling_params import SamplingParams
from test_torch_executor import RecordingExecutor, check_against_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class Server:
    """A scheduler and a recording torch executor over one KV cache, stepped by hand."""

    def __init__(self, config, weights, block_size, budget, num_blocks=200, max_num_seqs=2, caching=True,
                 num_snapshots=4):
        self.sched = Scheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_blocks=num_blocks, max_model_len=4096,
            block_size=block_size, sliding_window=config.sliding_window, enable_prefix_caching=caching,
            num_ring_snapshots=num_snapshots if caching else 0))
        kv = KVCache(config, num_blocks, block_size, max_num_seqs + (num_snapshots if caching else 0),
                     torch.float32, "cpu")
        self.ex = RecordingExecutor(config, weights, kv, eos_token_ids=())
        self.outputs, self.cached, self.num_preempted = {}, {}, 0

    def add(self, rid, prompt, params=GREEDY):
        self.sched.add_request(rid, prompt, params)
        self.outputs[rid] = []

    def step(self):
        plan = self.sched.schedule()
        self.num_preempted += len(plan.preempted_request_ids)
        for out in self.sched.update(plan, self.ex.execute(plan)):
            self.outputs[out.request_id].extend(out.new_token_ids)
            self.cached[out.request_id] = out.num_cached_tokens

    def run(self):
        while self.sched.has_unfinished_requests():
            self.step()

    def logits_of(self, rid):
        return {pos: row for (r, pos), row in self.ex.logits.items() if r == rid}

    def assert_no_leak(self):
        allocator = self.sched.kv_allocator
        assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0
        assert allocator.num_free_blocks == allocator.num_total_blocks


def tokens(rng, vocab, n):
    return [rng.randrange(vocab) for _ in range(n)]


# (block_size, shared prefix length): the hit is the last block boundary before the prefix's last
# token, so shorter than, at and past the 513-token window, ending mid-block and on a boundary.
CASES = [(16, 100), (16, 513), (19, 514), (16, 528), (16, 700), (16, 1100), (7, 1030)]


@pytest.mark.parametrize("block_size,prefix_len", CASES)
def test_cached_prefix_equals_a_cold_run_exactly(tiny_config, block_size, prefix_len):
    rng = random.Random(prefix_len)
    weights = fp32_weights(tiny_config, 1)
    first = tokens(rng, tiny_config.vocab_size, prefix_len)
    second = first + tokens(rng, tiny_config.vocab_size, 37)
    hit = (prefix_len - 1) // block_size * block_size
    warm = Server(tiny_config, weights, block_size, budget=hit)
    warm.add("first", first)
    warm.run()
    warm.add("second", second)
    warm.run()
    assert warm.cached == {"first": 0, "second": hit}
    cold = Server(tiny_config, weights, block_size, budget=hit)
    cold.add("second", second)
    cold.run()
    assert cold.cached == {"second": 0}
    assert warm.outputs["second"] == cold.outputs["second"]
    served, computed = warm.logits_of("second"), cold.logits_of("second")
    assert served.keys() == computed.keys() and len(served) == GREEDY.max_tokens
    for pos in served:
        assert torch.equal(served[pos], computed[pos]), f"position {pos}"
    warm.assert_no_leak()
    cache = warm.sched.prefix_cache
    assert (cache.num_queried_tokens, cache.num_hit_tokens) == (len(first) + len(second), hit)


def test_the_same_prompt_twice_hits_all_but_its_last_block(tiny_config):
    weights = fp32_weights(tiny_config, 2)
    prompt = tokens(random.Random(2), tiny_config.vocab_size, 64)        # 4 full blocks of 16
    server = Server(tiny_config, weights, 16, budget=16)
    for rid in ("a", "b"):
        server.add(rid, prompt)
        server.run()
    assert server.cached == {"a": 0, "b": 48}
    assert server.outputs["a"] == server.outputs["b"]
    for pos, row in server.logits_of("a").items():
        assert torch.equal(row, server.logits_of("b")[pos])


def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt(tiny_config):
    weights = fp32_weights(tiny_config, 2)
    prompt = tokens(random.Random(3), tiny_config.vocab_size, 64)        # 4 full blocks of 16
    server = Server(tiny_config, weights, 16, budget=16)
    salts = {"plain": None, "alice": "alice", "bob": "bob", "alice again": "alice", "plain again": None}
    for rid, salt in salts.items():
        server.add(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_salt=salt))
        server.run()
    assert server.cached == {"plain": 0, "alice": 0, "bob": 0, "alice again": 48, "plain again": 48}
    assert len({tuple(out) for out in server.outputs.values()}) == 1
    server.assert_no_leak()
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_recomputing_the_last_window_would_not_be_exact(tiny_config):
    """Why rings are restored from snapshots, not rebuilt: with the full layers' K/V all in place,
    recompute only the window - 1 positions before a hit at 640 into an empty ring, and the
    logits drift: each sliding layer reaches window - 1 positions further back through the one below."""
    weights = fp32_weights(tiny_config, 3)
    prompt = tokens(random.Random(3), tiny_config.vocab_size, 700)
    kv = KVCache(tiny_config, 48, 16, 2, torch.float32, "cpu")
    ex = RecordingExecutor(tiny_config, weights, kv, eos_token_ids=())
    table = list(range(44))

    def run(rid, start, slot):
        entry = ScheduledRequest(rid, prompt[start:], start, table, slot, True, GREEDY, prompt, [], False)
        ex.execute(StepPlan([entry], len(entry.token_ids), "grouped", [], []))
        return ex.logits[(rid, len(prompt) - 1)]

    cold = run("cold", 0, 0)
    assert torch.equal(run("again", 0, 1), cold)           # the same computation is exact
    kv.ring[:, :, 1] = 0
    recomputed = run("recompute", 640 - (tiny_config.sliding_window - 1), 1)
    assert not torch.allclose(recomputed, cold, atol=1e-3)


@pytest.mark.parametrize("budget", [64, 2048])
def test_requests_sharing_a_prefix_while_one_is_preempted_or_aborted(tiny_short_window, budget):
    """Window 8, blocks of 4, a pool too small for all: hits, preemptions (a preempted request
    resumes from the cache) and an abort, checked against the reference; nothing leaks."""
    config = tiny_short_window
    weights = fp32_weights(config, 4)
    rng = random.Random(4)
    shared = tokens(rng, config.vocab_size, 30)
    requests = [(f"r{i}", shared + tokens(rng, config.vocab_size, rng.randint(1, 12)),
                 SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 14), ignore_eos=True)) for i in range(6)]
    server = Server(config, weights, 4, budget=min(budget, 64), num_blocks=22, max_num_seqs=3, num_snapshots=2)
    server.add(*requests[0])
    for _ in range(12):                        # r0 runs past its snapshot position
        server.step()
    for request in requests[1:]:
        server.add(*request)
    server.add("doomed", shared + [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for step in range(400):
        if step == 9:
            assert server.sched.abort_request("doomed")
        if not server.sched.has_unfinished_requests():
            break
        server.step()
    assert not server.sched.has_unfinished_requests()
    assert server.num_preempted > 0
    assert any(server.cached[rid] > 0 for rid, _, _ in requests[1:])
    assert all(len(server.outputs[rid]) == p.max_tokens for rid, _, p in requests)
    check_against_reference(config, weights, server.ex, requests, server.outputs)
    server.assert_no_leak()


@pytest.mark.parametrize("shared_len,hit", [(30, 28), (7, 0)])
def test_a_prefix_shared_across_conversations_is_snapshotted_where_they_part(tiny_short_window, shared_len, hit):
    """Three prompts with one shared start (a system prompt) and different endings: the second
    finds the first's blocks but no snapshot among them, so it is cut and snapshotted where the
    shared blocks end (D = 28 here, blocks of 4); the third hits there and its logits equal a cold
    run's (same chunk boundaries: a budget of 28). A shared run shorter than a window (8) past
    the hit is not worth a snapshot: the third then computes everything."""
    config = tiny_short_window
    weights = fp32_weights(config, 5)
    rng = random.Random(5)
    shared = tokens(rng, config.vocab_size, shared_len)
    prompts = {rid: shared + tokens(rng, config.vocab_size, 13) for rid in ("a", "b", "c")}
    warm = Server(config, weights, 4, budget=28, num_snapshots=4)
    for rid in ("a", "b", "c"):
        warm.add(rid, prompts[rid])
        warm.run()
    assert warm.cached == {"a": 0, "b": 0, "c": hit}
    assert warm.sched.kv_allocator.snapshots.num_used == (4 if hit else 3)     # B of each, and D
    cold = Server(config, weights, 4, budget=28, num_snapshots=4)
    cold.add("c", prompts["c"])
    cold.run()
    served, computed = warm.logits_of("c"), cold.logits_of("c")
    assert served.keys() == computed.keys() and len(served) == GREEDY.max_tokens
    for pos in served:
        assert torch.equal(served[pos], computed[pos]), f"position {pos}"
    warm.assert_no_leak()
