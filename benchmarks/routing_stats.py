"""How the full model's router spreads a decode step's tokens over the experts, layer by layer: experts
touched, rows per expert, and the work items the decode expert GEMMs (cuda/expert_decode.cu) get
at each chunk. One eager step of `bench latency`'s decode case (dummy weights, random KV), the
routing read back after every MoE layer. Run on the GPU machine:

    python3 benchmarks/routing_stats.py --batch-sizes 64,256 --contexts 1024
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flint_sched.benchmarks import latency  # noqa: E402
from flint_sched.kernels import grouped_moe  # noqa: E402


def layer_counts(executor, plan) -> list[list[int]]:
    """Rows per expert (routed experts, then the shared one) of each MoE layer of one eager step."""
    seen: list[list[int]] = []
    original = grouped_moe.route_and_sort

    def recording(*args, **kwargs):
        routing = original(*args, **kwargs)
        torch.cuda.synchronize()
        offsets = routing.offsets[:routing.num_experts + 2].tolist()
        seen.append([b - a for a, b in zip(offsets, offsets[1:])])
        return routing

    graphs, executor.use_graphs = executor.use_graphs, False
    grouped_moe.route_and_sort = recording
    try:
        executor.execute(plan)
    finally:
        grouped_moe.route_and_sort = original
        executor.use_graphs = graphs
    return seen


def summary(counts: list[int], chunks: tuple[int, ...]) -> str:
    routed = counts[:-1]
    touched = [c for c in routed if c]
    items = {k: sum(math.ceil(c / k) for c in counts) for k in chunks}
    return (f"touched {len(touched):3d}, rows/touched median {statistics.median(touched):4.1f} "
            f"max {max(touched):4d}, >8 rows {sum(c > 8 for c in touched):3d}, >16 {sum(c > 16 for c in touched):3d}, "
            + ", ".join(f"items@{k} {n:4d}" for k, n in items.items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    latency.add_arguments(p)
    p.add_argument("--layers", default="2,10,24,40,48", help="layers to print one by one")
    p.set_defaults(executor="cuda", device="cuda", prefill_lens="", weight_format="nvfp4")
    args = p.parse_args()
    try:
        executor, _, _, num_blocks = latency.build(args)
    except ValueError as e:
        raise SystemExit(f"routing_stats: {e}") from None
    show = {int(x) for x in args.layers.split(",") if x}
    chunks = (8, 16, 32)
    for batch, context, blocks in latency.decode_cases(args, num_blocks)[0]:
        plan = latency.decode_plan(batch, context, blocks, latency.GREEDY, executor.limits.fused_max_batch)
        per_layer = layer_counts(executor, plan)
        first_moe = executor.config.num_hidden_layers - len(per_layer)
        print(f"B={batch} C={context}: {len(per_layer)} MoE layers")
        for i, counts in enumerate(per_layer):
            if i + first_moe in show:
                print(f"  layer {i + first_moe:2d}: {summary(counts, chunks)}")
        touched = sum(sum(1 for c in counts[:-1] if c) for counts in per_layer) / len(per_layer)
        items = {k: sum(math.ceil(c / k) for counts in per_layer for c in counts) / len(per_layer) for k in chunks}
        print(f"  mean over layers: touched {touched:.1f} of {len(per_layer[0]) - 1}, "
              + ", ".join(f"items@{k} {n:.1f}" for k, n in items.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
