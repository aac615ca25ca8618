"""flint-tiny's server with bench_agent_sim's cost-model GPU in place of the model: HTTP, chat template,
tokenizer, parsers, scheduler and prefix cache are the real host path, so a request's TTFT less the
GPU time of the steps it waits for is the host's share. Measure it with `flint-sched bench serve`:

    python3 -m flint_sched.benchmarks.serve_cost_model --port 8000 &
    flint-sched bench serve --endpoint /v1/completions --dataset-name random --random-token-ids \
        --random-input-len 1024 --random-output-len 16 --num-prompts 40 --max-concurrency 1
    flint-sched bench serve --dataset-name agent --num-prompts 64 --agent-num-turns 4 --request-rate 4

The defaults follow the H200 (a step 5.4 ms plus 16 µs a prompt token: a lone 1K prompt 21.8 ms).
"""

from __future__ import annotations

import argparse
import dataclasses

from flint_sched.api.server import EngineState, ServerConfig, serve
from flint_sched.benchmarks.bench_agent_sim import CostExecutor
from flint_sched.engine.builder import build_parts
from flint_sched.engine.config import GPU_DEFAULTS, EngineConfig


SERVER_CONFIG = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="glm47", reasoning_parser="glm47",
                             log_level="warning")


def engine_state(step_ms: float, us_per_prompt_token: float, max_num_seqs: int, async_scheduling: bool) -> EngineState:
    """flint-tiny's engine parts, the cost model in place of the model's executor."""
    parts = build_parts(EngineConfig(device="cpu", max_num_seqs=max_num_seqs, max_num_batched_tokens=GPU_DEFAULTS[1]),
                        progress=False)
    # tokens drawn below the first special id: never a stop token, so every turn streams text
    executor = CostExecutor(min(parts.checkpoint.tokenizer.special_ids), step_ms, us_per_prompt_token)
    return EngineState(dataclasses.replace(parts, executor=executor, async_scheduling=async_scheduling), "flint-tiny")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--step-ms", type=float, default=5.4)
    p.add_argument("--us-per-prompt-token", type=float, default=16.0)
    p.add_argument("--max-num-seqs", type=int, default=16, help="each takes two ring slots of real CPU memory")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch a step ahead, as with the CUDA executor (default: on)")
    args = p.parse_args()
    state = engine_state(args.step_ms, args.us_per_prompt_token, args.max_num_seqs, args.async_scheduling)
    return serve(state, dataclasses.replace(SERVER_CONFIG, port=args.port))


if __name__ == "__main__":
    raise SystemExit(main())
