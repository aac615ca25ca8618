"""Agent sessions through the real engine and scheduler around a fake GPU with a cost model: time to
first token per turn, with and without prefix caching, on a CPU.

Each session sends a prompt (a shared system prompt, then tokens of its own), waits for the answer
and sends the next turn: the last prompt plus --grow new tokens (the answer and a tool result, as
`bench serve --dataset-name agent` scripts them). The fake GPU runs one step at a time, each taking
--step-ms plus --us-per-prompt-token for every prompt token in it (a decode row costs nothing more),
on a timeline the engine's async scheduling launches ahead into (as bench_host's). What this
measures is the scheduling: how many steps, and which, a turn waits for its first token.

    python3 -m flint_sched.benchmarks.bench_agent_sim [--sessions 16 --turns 8 --step-ms 5.4 --us-per-prompt-token 16]
        [--prompt-host-ms 45 --prompt-graph-rows 2048] [--prompt-floor-ms 20] [--max-num-batched-tokens 8192]

The defaults follow the H200 at 16 streams (NVFP4 decode step 5.4 ms, prefill ~62,000 tokens/s:
benchmarks/RESULTS.md session 10; prompt steps of up to 2,048 rows replay graphs, and an eager one
needs ~45 ms of host time for its ~800 launches, session 7).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flint_sched.benchmarks.bench_host import FakeExecutor  # noqa: E402
from flint_sched.executor.graphs import PROMPT_GRAPH_TOKENS  # noqa: E402
from flint_sched.checkpoint.make import dummy_checkpoint  # noqa: E402
from flint_sched.config import preset  # noqa: E402
from flint_sched.core.plan import StepPlan  # noqa: E402
from flint_sched.core.scheduler import Scheduler  # noqa: E402
from flint_sched.core.scheduler_config import SchedulerConfig  # noqa: E402
from flint_sched.engine.async_engine import AsyncEngine  # noqa: E402
from flint_sched.llm import run_async  # noqa: E402
from flint_sched.sampling_params import SamplingParams  # noqa: E402


class CostExecutor(FakeExecutor):
    """FakeExecutor's timeline, each step costing step_ms + us_per_prompt_token per prompt token, and
    at least prompt_host_ms when it has prompt tokens and more rows than prompt_graph_rows (a prompt
    step launched eagerly takes the host that long, whatever the GPU needs)."""

    def __init__(self, vocab: int, step_ms: float, us_per_prompt_token: float, prompt_host_ms: float = 0.0,
                 prompt_graph_rows: int = 0, prompt_floor_ms: float = 0.0):
        super().__init__(vocab, step_ms)
        self.per_token_s = us_per_prompt_token / 1e6
        self.prompt_host_s, self.prompt_graph_rows = prompt_host_ms / 1e3, prompt_graph_rows
        self.prompt_floor_s = prompt_floor_ms / 1e3

    def step_cost_s(self, plan: StepPlan) -> float:
        prompt_tokens = sum(e.num_tokens for e in plan.scheduled_requests if e.num_tokens > 1)
        cost = self.gpu_s + self.per_token_s * prompt_tokens
        if prompt_tokens:
            cost = max(cost, self.prompt_floor_s)
        if prompt_tokens and plan.num_tokens > self.prompt_graph_rows:
            cost = max(cost, self.prompt_host_s)
        return cost


async def run_case(args: argparse.Namespace, caching: bool) -> dict:
    model = preset("flint-tiny")
    vocab = model.vocab_size
    tokenizer = dummy_checkpoint(model, "bf16", 0, "cpu").tokenizer
    executor = CostExecutor(vocab, args.step_ms, args.us_per_prompt_token, args.prompt_host_ms,
                            args.prompt_graph_rows, args.prompt_floor_ms)
    longest = args.system_tokens + args.first_tokens + args.turns * args.grow + args.output_tokens
    snapshots = args.max_num_seqs if args.num_ring_snapshots is None else args.num_ring_snapshots
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             num_blocks=args.sessions * (longest // 16 + 2) * 2, max_model_len=longest + 16,
                             block_size=16, fused_max_seqs=executor.limits.fused_max_batch,
                             sliding_window=513, enable_prefix_caching=caching,
                             num_ring_snapshots=snapshots if caching else 0)
    engine = AsyncEngine(Scheduler(config), executor, tokenizer, vocab, async_scheduling=True,
                         launch_margin_s=args.launch_margin_ms / 1e3)
    engine.start()
    rng = random.Random(0)
    system = [rng.randrange(300, vocab) for _ in range(args.system_tokens)]
    ttft: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    params = SamplingParams(temperature=1.0, max_tokens=args.output_tokens, ignore_eos=True)

    async def session(s: int) -> None:
        await asyncio.sleep(s * args.stagger_ms / 1e3)
        own = random.Random(s + 1)
        prompt = system + [own.randrange(300, vocab) for _ in range(args.first_tokens)]
        for turn in range(args.turns):
            start, first = time.perf_counter(), None
            async for _ in engine.add_request(list(prompt), params):
                first = first or time.perf_counter()
            ttft[turn].append(first - start)
            prompt = prompt + [own.randrange(300, vocab) for _ in range(args.grow)]
            if args.think_ms:                     # the tool runs, the next request travels
                await asyncio.sleep(own.uniform(0.5, 1.5) * args.think_ms / 1e3)

    start = time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(args.sessions)))
    wall = time.perf_counter() - start
    await engine.shutdown()
    later = [t for turn in range(1, args.turns) for t in ttft[turn]]
    cache = engine.scheduler.prefix_cache
    hit_rate = cache.num_hit_tokens / cache.num_queried_tokens if cache and cache.num_queried_tokens else 0.0
    return {"caching": caching, "wall_s": wall, "steps": executor.steps, "hit_rate": hit_rate,
            "ttft_turn0_ms": 1e3 * statistics.median(ttft[0]),
            "ttft_later_ms": 1e3 * statistics.median(later) if later else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1300, help="shared by every session")
    p.add_argument("--first-tokens", type=int, default=200, help="each session's own first message")
    p.add_argument("--grow", type=int, default=450, help="new prompt tokens per turn")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--stagger-ms", type=float, default=0.0, help="session s starts s times this late (0: together)")
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="mean pause before a session's next turn (uniform 0.5-1.5x: a tool's run, the network); "
                        "0: the next turn is sent as the last token arrives")
    p.add_argument("--step-ms", type=float, default=5.4)
    p.add_argument("--us-per-prompt-token", type=float, default=16.0)
    p.add_argument("--prompt-host-ms", type=float, default=45.0,
                   help="host time of an eager prompt step, the least it takes (H200 machine, ~800 launches)")
    p.add_argument("--prompt-graph-rows", type=int, default=max(PROMPT_GRAPH_TOKENS),
                   help="prompt steps of up to this many rows replay a graph: no host floor (0: none do)")
    p.add_argument("--prompt-floor-ms", type=float, default=0.0,
                   help="least GPU time of a step with prompt tokens: a short prompt still reads every expert "
                        "(16 decodes + 512 prompt rows at 5K: 20.3 ms on the H200, RESULTS.md session 14)")
    p.add_argument("--launch-margin-ms", type=float, default=0.0,
                   help="late launch-ahead (engine/async_engine.py): plan the next step this long before the "
                        "running decode step's expected end (0: as soon as it starts)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-ring-snapshots", type=int, default=None, help="default: --max-num-seqs, as the server")
    args = p.parse_args()
    print("| prefix caching | wall s | steps | hit rate | median TTFT turn 0 | median TTFT turns 1+ |")
    print("|---|---|---|---|---|---|")
    for caching in (True, False):
        r = run_async(run_case(args, caching))
        print(f"| {'on' if caching else 'off'} | {r['wall_s']:.1f} | {r['steps']} | {100 * r['hit_rate']:.0f} % | "
              f"{r['ttft_turn0_ms']:.0f} ms | "
              f"{r['ttft_later_ms']:.0f} ms |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
