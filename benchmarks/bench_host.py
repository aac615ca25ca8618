"""The engine's host side alone, at many running streams: schedule, update, detokenize, stop strings
and the streams' outputs (on uvloop, as the server), around a fake executor that answers at once, or after `--gpu-ms` (a GPU
step's time, slept in the worker thread as the GPU would run it).

    python3 -m flint_sched.benchmarks.bench_host --streams 64,256 --tokens 256 --gpu-ms 0,10

Per case: decode steps per second, host milliseconds per step (wall time less the executor's,
divided by the steps) and, with a GPU time, the share of the wall time the GPU would sit idle
between steps (the loop overlaps step N's host work with step N+1's execution; what is left shows),
over the whole run and in its steady state alone (the steps that decode every stream: admitting the
streams and the last ones' tail left out).
With `--async-scheduling both`, each case also runs with the engine's async scheduling: the fake
executor then keeps a GPU timeline (a launched step starts when the previous one ends, or at its
launch if later) and `collect` sleeps until its step's end, as a CUDA event wait would.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from flint_sched.api.gc_pauses import freeze_startup_heap
from flint_sched.checkpoint.make import dummy_checkpoint
from flint_sched.config import preset
from flint_sched.core.plan import StepPlan, StepResult, fill_placeholders
from flint_sched.core.scheduler import Scheduler
from flint_sched.core.scheduler_config import SchedulerConfig
from flint_sched.engine.async_engine import GIL_SWITCH_INTERVAL_S, AsyncEngine
from flint_sched.executor.limits import ExecutorLimits
from flint_sched.llm import run_async
from flint_sched.sampling_params import SamplingParams


class FakeExecutor:
    """One random non-special token per sampling entry, after `gpu_ms` of sleep."""

    limits = ExecutorLimits(fused_max_batch=8)

    def __init__(self, vocab: int, gpu_ms: float, seed: int = 0):
        self.vocab, self.gpu_s, self.rng = vocab, gpu_ms / 1e3, random.Random(seed)
        self.steps, self.busy_s = 0, 0.0
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.rows: list[int] = []          # a step's decode rows (0: a step with prompt rows)
        self.last: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        self.starts.append(start)
        self.rows.append(len(plan.scheduled_requests) if plan.is_decode_only else 0)
        if (cost := self.step_cost_s(plan)) > 0:
            time.sleep(cost)
        tokens = {e.request_id: [self.rng.randrange(300, self.vocab)] for e in plan.scheduled_requests if e.samples}
        self.steps += 1
        self.ends.append(time.perf_counter())
        self.busy_s += self.ends[-1] - start
        return StepResult(tokens)

    def step_cost_s(self, plan: StepPlan) -> float:
        """The fake GPU's time for the step (subclasses model more)."""
        return self.gpu_s

    def launch(self, plan: StepPlan) -> tuple[float, StepResult]:
        """Queue the step on the fake GPU's timeline; the host returns at once."""
        fill_placeholders(plan.scheduled_requests, self.last)
        cost = self.step_cost_s(plan)
        now = time.perf_counter()
        start = max(now, self.ends[-1]) if self.ends else now
        self.starts.append(start)
        self.rows.append(len(plan.scheduled_requests) if plan.is_decode_only else 0)
        self.ends.append(start + cost)
        self.busy_s += cost
        self.steps += 1
        tokens = {e.request_id: [self.rng.randrange(300, self.vocab)] for e in plan.scheduled_requests if e.samples}
        self.last = {rid: t[-1] for rid, t in tokens.items()}
        return self.ends[-1], StepResult(tokens)

    def collect(self, launched: tuple[float, StepResult]) -> StepResult:
        end, result = launched
        if (wait := end - time.perf_counter()) > 0:
            time.sleep(wait)
        return result


async def run_case(tokenizer, vocab: int, streams: int, tokens: int, gpu_ms: float,
                   switch_interval_s: float | None = None, async_scheduling: bool = False) -> dict:
    executor = FakeExecutor(vocab, gpu_ms)
    config = SchedulerConfig(max_num_seqs=streams, max_num_batched_tokens=max(2048, streams),
                             num_blocks=streams * (tokens // 16 + 8), max_model_len=tokens + 128, block_size=16,
                             fused_max_seqs=executor.limits.fused_max_batch)
    engine = AsyncEngine(Scheduler(config), executor, tokenizer, vocab, async_scheduling=async_scheduling)
    engine.start()
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    params = SamplingParams(temperature=0.8, max_tokens=tokens, ignore_eos=True, stop=["never appears"])

    async def consume(n: int) -> int:
        chunks = 0
        async for _ in engine.add_request(f"Request {n}: tell a long story.", params):
            chunks += 1
        return chunks

    step_starts, step_ends = executor.starts, executor.ends
    start = time.perf_counter()
    await asyncio.gather(*(consume(n) for n in range(streams)))
    wall = time.perf_counter() - start
    await engine.shutdown()
    host_ms = (wall - executor.busy_s) / executor.steps * 1e3
    gaps = sorted(b - a for a, b in zip(step_ends[:-1], step_starts[1:]))
    # The steady state: steps decoding every stream (admission and the last streams' tail left out)
    full = [i for i in range(1, executor.steps) if executor.rows[i] == streams]
    steady_gap = sum(max(0.0, step_starts[i] - step_ends[i - 1]) for i in full)
    steady_span = sum(step_ends[i] - step_ends[i - 1] for i in full)
    return {"streams": streams, "gpu_ms": gpu_ms, "async": async_scheduling, "steps": executor.steps,
            "steps_per_s": executor.steps / wall,
            "median_gap_ms": 1e3 * gaps[len(gaps) // 2] if gaps else 0.0,
            "host_ms_per_step": host_ms, "gpu_idle_share": 1 - executor.busy_s / wall if gpu_ms else None,
            "steady_idle_share": steady_gap / steady_span if gpu_ms and steady_span > 0 else None,
            "tokens_per_s": streams * tokens / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="64,256")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per stream")
    p.add_argument("--gpu-ms", default="0,10", help="the fake executor's step time(s) in ms")
    p.add_argument("--switch-interval", default="", help="also run with these GIL switch intervals in s "
                   "(the engine sets async_engine.GIL_SWITCH_INTERVAL_S), e.g. 0.005 for CPython's default")
    p.add_argument("--server-gc-off", action="store_true",
                   help="keep Python's default collector (the server freezes its start-up heap and raises "
                   "the thresholds: api/gc_pauses.py)")
    p.add_argument("--async-scheduling", default="both", choices=("off", "on", "both"),
                   help="run the engine without, with, or both ways (%(default)s)")
    args = p.parse_args()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    tokenizer = dummy_checkpoint(preset("flint-tiny"), "bf16", 0, "cpu").tokenizer
    vocab = preset("flint-tiny").vocab_size
    if not args.server_gc_off:
        freeze_startup_heap()   # as the server does before its first request (api/gc_pauses.py)
    print("| streams | GPU ms/step | async | switch s | steps/s | host ms/step | gap ms (median) | GPU idle | "
          "steady idle | output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    intervals = [None] + [float(s) for s in args.switch_interval.split(",") if s]
    for streams in (int(s) for s in args.streams.split(",")):
        for gpu_ms in (float(g) for g in args.gpu_ms.split(",")):
            for interval, mode in ((i, m) for i in intervals for m in modes):
                r = run_async(run_case(tokenizer, vocab, streams, args.tokens, gpu_ms, interval, mode))
                idle, steady = ("–" if r[k] is None else f"{100 * r[k]:.1f} %"
                                for k in ("gpu_idle_share", "steady_idle_share"))
                shown = GIL_SWITCH_INTERVAL_S if interval is None else interval
                print(f"| {streams} | {gpu_ms:g} | {'on' if mode else 'off'} | {shown:g} | {r['steps_per_s']:.1f} | "
                      f"{r['host_ms_per_step']:.2f} | {r['median_gap_ms']:.2f} | {idle} | {steady} | "
                      f"{r['tokens_per_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
