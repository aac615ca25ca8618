"""Scheduler overhead per decode step: schedule() + update() with 256 running requests.

A fake executor returns one made-up token per sampling request; prompts are prefilled first and
only pure decode steps are timed. Goal: <= 1000 µs per step. Run: python benchmarks/bench_scheduler.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flint_sched.core import Scheduler, SchedulerConfig, StepPlan, StepResult  # noqa: E402
from flint_sched.sampling_params import SamplingParams  # noqa: E402

GOAL_US = 1000.0


def fake_execute(plan: StepPlan, step_index: int) -> StepResult:
    return StepResult(
        {e.request_id: [1000 + step_index % 7] for e in plan.scheduled_requests if e.samples}
    )


def run(num_requests: int, prompt_len: int, num_steps: int, block_size: int,
        enable_prefix_caching: bool = False) -> list[float]:
    num_warmup_steps = 50
    max_num_batched_tokens = 8192
    max_prefill_steps = -(-num_requests * prompt_len // max_num_batched_tokens)
    max_tokens = max_prefill_steps + num_warmup_steps + num_steps + 8
    max_model_len = prompt_len + max_tokens
    config = SchedulerConfig(
        max_num_seqs=num_requests,
        max_num_batched_tokens=max_num_batched_tokens,
        num_blocks=num_requests * -(-max_model_len // block_size),
        max_model_len=max_model_len,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_ring_snapshots=num_requests if enable_prefix_caching else 0,
    )
    scheduler = Scheduler(config)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        prompt = [i * prompt_len + j for j in range(prompt_len)]         # no shared prefixes
        scheduler.add_request(f"req-{i}", prompt, params, eos_token_ids={2})

    step_index = 0
    while True:
        plan = scheduler.schedule()
        is_decode_only = plan.is_decode_only and plan.num_tokens == num_requests
        scheduler.update(plan, fake_execute(plan, step_index))
        step_index += 1
        if is_decode_only and step_index > num_warmup_steps:
            break

    timings_us = []
    for _ in range(num_steps):
        start_ns = time.perf_counter_ns()
        plan = scheduler.schedule()
        scheduled_ns = time.perf_counter_ns()
        result = fake_execute(plan, step_index)
        executed_ns = time.perf_counter_ns()
        outputs = scheduler.update(plan, result)
        updated_ns = time.perf_counter_ns()
        assert len(outputs) == num_requests and not any(o.finished for o in outputs)
        timings_us.append((scheduled_ns - start_ns + updated_ns - executed_ns) / 1000.0)
        step_index += 1
    return timings_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--num-steps", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    args = parser.parse_args()
    timings_us = sorted(run(args.num_requests, args.prompt_len, args.num_steps, args.block_size,
                            args.enable_prefix_caching))
    p99 = timings_us[min(len(timings_us) - 1, int(0.99 * len(timings_us)))]
    median = statistics.median(timings_us)
    print(
        f"schedule()+update(), {args.num_requests} running decodes, {args.num_steps} steps, prefix caching "
        f"{'on' if args.enable_prefix_caching else 'off'}: "
        f"mean {statistics.fmean(timings_us):.1f} µs, median {median:.1f} µs, p99 {p99:.1f} µs "
        f"per step (goal <= {GOAL_US:.0f} µs: {'met' if median <= GOAL_US else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
