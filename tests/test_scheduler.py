"""Scheduler step by step with a fake executor: chunks, order, paths, stops, preemption, aborts."""

import pytest

from flint_sched.core import (
    FinishReason,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from flint_sched.sampling_params import SamplingParams

EOS = 2
TOKEN = 100


def make_scheduler(**overrides):
    config = dict(
        max_num_seqs=4, max_num_batched_tokens=32, num_blocks=64, max_model_len=256, block_size=4,
        fused_max_seqs=8,
    )
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))


def params(**kwargs):
    kwargs.setdefault("max_tokens", 100)
    return SamplingParams(**kwargs)


def step(scheduler, tokens=None, logprobs=None):
    """schedule() then update() with TOKEN (or tokens[request_id], an int or a list) per sampler."""
    plan = scheduler.schedule()
    sampled = {}
    for entry in plan.scheduled_requests:
        if entry.samples:
            token = (tokens or {}).get(entry.request_id, TOKEN)
            sampled[entry.request_id] = token if isinstance(token, list) else [token]
    return plan, scheduler.update(plan, StepResult(sampled, logprobs))


def ids(plan):
    return [entry.request_id for entry in plan.scheduled_requests]


def prompt(n, start=10):
    return list(range(start, start + n))


# --- configuration and admission checks ---------------------------------------------------------

BAD_CONFIGS = [
    ("max_num_seqs", 0), ("max_num_seqs", 2.0), ("max_num_batched_tokens", 0),
    ("num_blocks", 0), ("max_model_len", 1), ("block_size", 0), ("block_size", True),
    ("sliding_window", 0), ("fused_max_seqs", -1), ("max_num_batched_tokens", 3),
    ("long_prefill_token_threshold", -1),
]


@pytest.mark.parametrize("field, value", BAD_CONFIGS)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        make_scheduler(**{field: value})


def test_config_defaults():
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, num_blocks=10, max_model_len=100
    )
    assert (config.block_size, config.sliding_window, config.fused_max_seqs) == (16, 513, 0)
    scheduler = Scheduler(config)
    assert scheduler.kv_allocator.num_total_ring_slots == 8
    assert scheduler.kv_allocator.sliding_window == 513


def test_add_request_rejections():
    scheduler = make_scheduler(max_model_len=20, num_blocks=5)
    scheduler.add_request("a", prompt(3), params(max_tokens=5))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request("a", prompt(3), params())
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request("b", [], params())
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request("b", prompt(20), params())
    scheduler.add_request("c", prompt(19), params(max_tokens=1000))
    assert scheduler.get_request("c").max_num_tokens == 20
    assert [scheduler.get_request(r).arrival_index for r in "ac"] == [0, 1]
    assert scheduler.num_waiting_requests == 2 and scheduler.get_request("b") is None


def test_add_request_rejects_what_the_whole_pool_cannot_hold():
    scheduler = make_scheduler(max_model_len=100, num_blocks=4)
    scheduler.add_request("fits", prompt(10), params(max_tokens=7))
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.add_request("too-long", prompt(10), params(max_tokens=8))


# --- chunks, positions and block tables ---------------------------------------------------------


def test_prefill_then_decodes_feed_the_right_tokens_at_the_right_positions():
    scheduler = make_scheduler()
    request = scheduler.add_request("a", prompt(10), params(temperature=0.0), eos_token_ids={EOS})
    plan, outputs = step(scheduler, {"a": 7})
    (entry,) = plan.scheduled_requests
    assert (entry.token_ids, entry.start_position, entry.samples) == (prompt(10), 0, True)
    assert len(entry.block_table) == 3 and entry.ring_slot == 0
    assert entry.sampling_params is request.sampling_params
    assert entry.prompt_token_ids is request.prompt_token_ids
    assert entry.output_token_ids is request.output_token_ids
    assert plan.path == "grouped" and plan.num_tokens == 10 and not entry.is_resumed_after_preemption
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("a", [7], None)]

    for position, num_blocks, token in [(10, 3, 8), (11, 3, 9), (12, 4, 5)]:
        plan, outputs = step(scheduler, {"a": token})
        (entry,) = plan.scheduled_requests
        assert entry.start_position == position and len(entry.block_table) == num_blocks
        assert entry.token_ids == [request.all_token_ids[position]]
        assert plan.path == "fused" and plan.num_tokens == 1
    assert request.output_token_ids == [7, 8, 9, 5]
    assert request.all_token_ids == prompt(10) + [7, 8, 9, 5]
    assert request.num_computed_tokens == 13 and request.status is RequestStatus.RUNNING


def test_long_prompt_is_chunked_and_only_the_last_chunk_samples():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request("a", prompt(20), params())
    chunks = []
    for _ in range(3):
        plan, outputs = step(scheduler)
        (entry,) = plan.scheduled_requests
        chunks.append((entry.start_position, len(entry.token_ids), entry.samples, len(outputs)))
        assert len(entry.block_table) == -(-entry.end_position // 4)
        assert entry.token_ids == prompt(20)[entry.start_position : entry.end_position]
    assert chunks == [(0, 8, False, 0), (8, 8, False, 0), (16, 4, True, 1)]


def test_budget_is_shared_decodes_then_prefills_then_waiting():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request("a", prompt(2), params())
    scheduler.add_request("b", prompt(30), params())
    plan, _ = step(scheduler)
    assert [(e.request_id, len(e.token_ids)) for e in plan.scheduled_requests] == [("a", 2), ("b", 8)]
    scheduler.add_request("c", prompt(3), params())
    plan, _ = step(scheduler, {"a": [5, 6]})
    assert [(e.request_id, len(e.token_ids)) for e in plan.scheduled_requests] == [("a", 1), ("b", 9)]
    plan, _ = step(scheduler)
    assert [(e.request_id, len(e.token_ids)) for e in plan.scheduled_requests] == [
        ("a", 2), ("b", 8)], "a's two speculative tokens are fed as one chunk"
    plan, _ = step(scheduler)
    assert [(e.request_id, len(e.token_ids)) for e in plan.scheduled_requests] == [
        ("a", 1), ("b", 5), ("c", 3)]


def test_long_prefill_token_threshold_caps_each_prompts_chunk_not_the_step():
    """vLLM's --long-prefill-token-threshold: every prompt (running or newly admitted) advances at
    most 6 tokens a step, short prompts and decodes as before, the budget still the step's limit."""
    scheduler = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    scheduler.add_request("a", prompt(4), params())
    scheduler.add_request("b", prompt(20), params())
    scheduler.add_request("c", prompt(20, start=50), params())
    steps = []
    for _ in range(5):
        plan, outputs = step(scheduler)
        assert plan.num_tokens <= 16
        steps.append([(e.request_id, e.start_position, len(e.token_ids), e.samples) for e in plan.scheduled_requests])
    assert steps == [
        [("a", 0, 4, True), ("b", 0, 6, False), ("c", 0, 6, False)],
        [("a", 4, 1, True), ("b", 6, 6, False), ("c", 6, 6, False)],
        [("a", 5, 1, True), ("b", 12, 6, False), ("c", 12, 6, False)],
        [("a", 6, 1, True), ("b", 18, 2, True), ("c", 18, 2, True)],
        [("a", 7, 1, True), ("b", 20, 1, True), ("c", 20, 1, True)],
    ]
    # a threshold above the budget changes nothing: the budget cuts first
    wide = make_scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=100)
    wide.add_request("d", prompt(20), params())
    plan, _ = step(wide)
    assert [len(e.token_ids) for e in plan.scheduled_requests] == [8]


def test_decodes_go_before_an_older_requests_chunk():
    scheduler = make_scheduler()
    scheduler.add_request("old", prompt(2), params())
    scheduler.add_request("new", prompt(2), params())
    step(scheduler, {"old": [5, 6]})
    plan, _ = step(scheduler)
    assert ids(plan) == ["new", "old"] and plan.path == "grouped"


def test_max_num_seqs_caps_running_and_waiting_is_first_come_first_served():
    scheduler = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        scheduler.add_request(rid, prompt(3), params(max_tokens=2))
    plan, _ = step(scheduler)
    assert ids(plan) == ["a", "b"] and scheduler.num_running_requests == 2
    plan, outputs = step(scheduler)
    assert ids(plan) == ["a", "b"] and all(o.finish_reason == "length" for o in outputs)
    plan, _ = step(scheduler)
    assert ids(plan) == ["c"] and plan.finished_request_ids == ["a", "b"]


def test_waiting_head_blocks_later_requests_until_it_fits():
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    scheduler.add_request("a", prompt(8), params(max_tokens=4))
    scheduler.add_request("big", prompt(12), params(max_tokens=2))
    scheduler.add_request("small", prompt(1), params(max_tokens=2))
    plan, _ = step(scheduler)
    assert ids(plan) == ["a"], "big needs 3 blocks, 2 are free; small must not overtake it"


@pytest.mark.parametrize("num_requests, path", [(1, "fused"), (8, "fused"), (9, "grouped")])
def test_path_is_fused_only_for_at_most_eight_decodes(num_requests, path):
    scheduler = make_scheduler(max_num_seqs=16, max_num_batched_tokens=64)
    for i in range(num_requests):
        scheduler.add_request(f"r{i}", prompt(2), params())
    plan, _ = step(scheduler)
    assert plan.path == "grouped"
    plan, _ = step(scheduler)
    assert plan.path == path and plan.num_tokens == num_requests


def test_a_one_token_chunk_that_does_not_sample_is_not_a_decode():
    scheduler = make_scheduler(max_num_batched_tokens=3, max_num_seqs=3)
    scheduler.add_request("a", prompt(1), params())
    scheduler.add_request("b", prompt(1), params())
    scheduler.add_request("c", prompt(9), params())
    for _ in range(2):
        plan, _ = step(scheduler)
        assert [(e.request_id, len(e.token_ids), e.samples) for e in plan.scheduled_requests] == [
            ("a", 1, True), ("b", 1, True), ("c", 1, False)]
        assert plan.path == "grouped"


def test_empty_plan():
    plan, outputs = step(make_scheduler())
    assert plan.is_empty and plan.num_tokens == 0 and outputs == []


# --- finishing: stop tokens, lengths, aborts, stop strings ---------------------------------------


def run_to_finish(scheduler, rid, tokens):
    """Feed the given sampled tokens to one request; return its outputs."""
    outputs = []
    for token in tokens:
        _, step_outputs = step(scheduler, {rid: token})
        outputs += step_outputs
    return outputs


def test_eos_stops_after_min_tokens_and_frees_everything():
    scheduler = make_scheduler()
    scheduler.add_request("a", prompt(5), params(min_tokens=3), eos_token_ids={EOS, 3})
    outputs = run_to_finish(scheduler, "a", [EOS, 3, EOS])
    assert [o.new_token_ids for o in outputs] == [[EOS], [3], [EOS]]
    assert [o.finish_reason for o in outputs] == [None, None, "stop"]
    assert outputs[-1].finished and outputs[-1].stop_reason is None
    allocator = scheduler.kv_allocator
    assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0
    assert not scheduler.has_unfinished_requests() and scheduler.num_running_requests == 0


def test_ignore_eos_keeps_going_but_stop_token_ids_still_stop_with_a_stop_reason():
    scheduler = make_scheduler()
    sampling_params = params(ignore_eos=True, stop_token_ids=[42])
    request = scheduler.add_request("a", prompt(5), sampling_params, eos_token_ids={EOS})
    outputs = run_to_finish(scheduler, "a", [EOS, EOS, 42])
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].stop_reason == 42
    assert request.status is RequestStatus.FINISHED_STOPPED and request.finish_reason == "stop"
    assert request.output_token_ids == [EOS, EOS, 42]


def test_max_tokens_finishes_with_length_and_eos_at_the_last_place_says_stop():
    scheduler = make_scheduler()
    first = scheduler.add_request("a", prompt(5), params(max_tokens=3), eos_token_ids={EOS})
    outputs = run_to_finish(scheduler, "a", [7, 7, 7])
    assert [o.finish_reason for o in outputs] == [None, None, "length"]
    assert first.status is RequestStatus.FINISHED_LENGTH_CAPPED and first.num_output_tokens == 3
    scheduler.add_request("b", prompt(5), params(max_tokens=2), eos_token_ids={EOS})
    assert run_to_finish(scheduler, "b", [7, EOS])[-1].finish_reason == "stop"


def test_max_model_len_finishes_with_length_and_positions_stay_below_it():
    scheduler = make_scheduler(max_model_len=12)
    request = scheduler.add_request("a", prompt(9), params(max_tokens=100))
    outputs, ends = [], []
    while scheduler.has_unfinished_requests():
        plan, step_outputs = step(scheduler)
        ends += [e.end_position for e in plan.scheduled_requests]
        outputs += step_outputs
    assert [o.finish_reason for o in outputs] == [None, None, "length"]
    assert request.num_tokens == 12 and max(ends) == 11


def test_abort_a_waiting_and_a_running_request_frees_at_once():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request("run", prompt(6), params())
    scheduler.add_request("wait", prompt(6), params())
    step(scheduler)
    allocator = scheduler.kv_allocator
    assert allocator.num_used_blocks == 2 and allocator.num_used_ring_slots == 1
    assert scheduler.abort_request("wait") and scheduler.num_waiting_requests == 0
    assert scheduler.abort_request("run")
    assert allocator.num_used_blocks == 0 and allocator.num_used_ring_slots == 0
    assert not scheduler.abort_request("run") and not scheduler.abort_request("never-added")
    plan = scheduler.schedule()
    assert plan.is_empty and plan.finished_request_ids == ["wait", "run"]
    assert scheduler.schedule().finished_request_ids == []


def test_finish_request_for_a_stop_string_uses_the_same_freeing_path():
    scheduler = make_scheduler()
    request = scheduler.add_request("a", prompt(6), params())
    step(scheduler)
    assert scheduler.finish_request("a", "stop")
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_allocator.num_used_blocks == 0
    assert not scheduler.finish_request("a", FinishReason.LENGTH)
    with pytest.raises(ValueError):
        scheduler.finish_request("a", "eos")


def test_update_skips_requests_finished_between_schedule_and_update():
    scheduler = make_scheduler()
    scheduler.add_request("a", prompt(3), params())
    scheduler.add_request("b", prompt(3), params())
    plan = scheduler.schedule()
    scheduler.abort_request("a")
    outputs = scheduler.update(plan, StepResult({"a": [5], "b": [6]}, {"a": "lp-a", "b": "lp-b"}))
    assert [(o.request_id, o.new_token_ids, o.logprobs) for o in outputs] == [("b", [6], "lp-b")]


def test_update_rejects_a_stale_plan_and_a_missing_token():
    scheduler = make_scheduler()
    scheduler.add_request("a", prompt(3), params())
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update(plan, StepResult({}))
    scheduler.update(plan, StepResult({"a": [5]}))
    with pytest.raises(RuntimeError, match="stale plan"):
        scheduler.update(plan, StepResult({"a": [5]}))


def test_speculative_tokens_after_a_stop_are_dropped():
    scheduler = make_scheduler()
    request = scheduler.add_request("a", prompt(3), params(), eos_token_ids={EOS})
    _, outputs = step(scheduler, {"a": [5, EOS, 6]})
    assert outputs[0].new_token_ids == [5, EOS] and outputs[0].finish_reason == "stop"
    assert request.output_token_ids == [5, EOS]


# --- preemption by recompute ---------------------------------------------------------------------


def test_newest_request_is_preempted_and_resumes_with_prompt_plus_output():
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=2)
    old = scheduler.add_request("old", prompt(8), params(max_tokens=8))
    new = scheduler.add_request("new", prompt(8, start=50), params(max_tokens=8))
    for _ in range(5):
        plan, _ = step(scheduler)
        assert ids(plan) == ["old", "new"] and not plan.preempted_request_ids
    assert scheduler.kv_allocator.num_free_blocks == 0 and new.num_output_tokens == 5
    plan, _ = step(scheduler)
    assert ids(plan) == ["old"] and plan.preempted_request_ids == ["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and new.output_token_ids == [TOKEN] * 5
    assert scheduler.kv_allocator.get("new") is None and scheduler.kv_allocator.num_used_ring_slots == 1

    while old.status is RequestStatus.RUNNING:
        plan, _ = step(scheduler)
        assert ids(plan) == ["old"]
    plan, outputs = step(scheduler)
    (entry,) = plan.scheduled_requests
    assert entry.request_id == "new" and entry.is_resumed_after_preemption and entry.samples
    assert entry.token_ids == prompt(8, start=50) + [TOKEN] * 5 and entry.start_position == 0
    assert len(entry.block_table) == 4 and plan.finished_request_ids == ["old"]
    plan, _ = step(scheduler)
    assert not plan.scheduled_requests[0].is_resumed_after_preemption
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert new.num_output_tokens == 8 and new.finish_reason == "length"


def test_preempted_request_goes_back_in_front_of_the_waiting_queue():
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=3)
    scheduler.add_request("old", prompt(8), params(max_tokens=8))
    scheduler.add_request("new", prompt(8), params(max_tokens=8))
    for _ in range(5):
        step(scheduler)
    scheduler.add_request("later", prompt(1), params(max_tokens=1))
    plan, _ = step(scheduler)
    assert plan.preempted_request_ids == ["new"] and ids(plan) == ["old"], "no admission this step"
    assert scheduler.kv_allocator.num_free_blocks == 2, "enough for later, but new is first"
    scheduled = []
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler)
        scheduled += [rid for rid in ids(plan) if rid not in scheduled]
    assert scheduled == ["old", "new", "later"]


def test_a_chunk_may_preempt_a_newer_decode_already_in_the_plan():
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=2)
    scheduler.add_request("old", prompt(8), params(max_tokens=10))
    scheduler.add_request("new", prompt(8), params(max_tokens=10))
    for _ in range(3):
        step(scheduler)
    step(scheduler, {"old": [5, 6]})
    plan, _ = step(scheduler)
    assert [(e.request_id, e.start_position, len(e.token_ids)) for e in plan.scheduled_requests] == [
        ("old", 11, 2)]
    assert plan.preempted_request_ids == ["new"] and plan.num_tokens == 2
    assert len(plan.scheduled_requests[0].block_table) == 4
