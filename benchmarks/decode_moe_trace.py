"""Where the one-launch decode MoE's time goes, CTA by CTA: the ED_TRACE build of expert_decode_moe.

Each CTA records %globaltimer at its phases (entry, unit taken from the queue, inputs ready: a down
unit's wait for its item's gate/up units, x staged in shared memory, warp 0's rounds done, end), its
SM and its unit. Printed per kind of unit (gate/up, down): how long each phase takes (median / 90th
percentile / max, µs) and when units start and end from the kernel's first entry; then how many
units run at each point of the kernel (gate/up computing, down waiting, down computing) over 16
slices of its span. Flint's MoE shapes, bench_grouped.py's random weights and router; each traced
launch runs eagerly (no PDL) after the same launch over another weight set, so the weights come from
HBM as in a step. Timing is by the GPU's global timer, not a benchmark of the kernel's speed
(bench_grouped.py is).

Run on the GPU machine: python3 benchmarks/decode_moe_trace.py [--tokens 16 64 256] [--config g1t2d4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flint_sched.benchmarks.bench_grouped import EXPERTS, HIDDEN, INTER, SCALING, TOP_K, moe_set  # noqa: E402
from flint_sched.kernels import expert_decode, grouped_moe, moe_routing_workspace  # noqa: E402

PHASES = (("take unit", 0, 1), ("inputs ready", 1, 2), ("stage x", 2, 3), ("rounds (warp 0)", 3, 4),
          ("finish", 4, 5), ("life", 0, 5))
SLICES = 16


def trace_once(m: int, config: str, sets: list[dict], seed: int) -> tuple[torch.Tensor, int, int]:
    """(trace [CTAs, 8] of the last set's launch, items in its work list, gate/up units an item)."""
    torch.manual_seed(seed)
    x = torch.randn(m, HIDDEN, device="cuda").bfloat16()
    ws = moe_routing_workspace(m, EXPERTS, TOP_K, "cuda", hidden_size=HIDDEN, intermediate_size=INTER)
    trace = None
    for i, s in enumerate(sets):
        logits = torch.mm(x, s["router"].t(), out_dtype=torch.float32)
        routing = grouped_moe.route_and_sort(logits, s["bias"], TOP_K, SCALING, ws,
                                             chunk=expert_decode.rows_per_item(config))
        if i == len(sets) - 1:
            ctas = expert_decode.moe_grid_ctas(routing.max_items, config, HIDDEN, INTER)
            trace = torch.zeros(ctas, expert_decode.TRACE_SLOTS, dtype=torch.int64, device="cuda")
        expert_decode.expert_decode_moe(x, routing, ws.queue, s["gate"], s["up"], s["shared_gate"], s["shared_up"],
                                        s["down"], s["shared_down"], ws.h_sorted[:routing.sorted_token.numel()],
                                        out=ws.y_sorted[:routing.sorted_token.numel()], config=config, trace=trace)
    torch.cuda.synchronize()
    items = int(routing.work_args[3].item())
    return trace.cpu(), items, expert_decode.moe_units(config, HIDDEN, INTER)[0]


def quantiles(values: torch.Tensor) -> str:
    if values.numel() == 0:
        return "      -"
    v = values.double() / 1e3
    return f"{v.median():7.2f} {v.quantile(0.9):7.2f} {v.max():7.2f}"


def report(m: int, config: str, trace: torch.Tensor, items: int, gate_up_per_item: int) -> None:
    took = trace[:, 1] > 0
    t = trace[took]
    t0 = int(t[:, 0].min())
    gate_up = t[:, 7] < items * gate_up_per_item
    ran = t[:, 5] > 0                     # down units of an odd pair item exit after taking their unit
    span = int(t[ran, 5].max()) - t0
    print(f"\n{m} tokens, {config}: {items} items, {int(gate_up.sum())} gate/up and {int((~gate_up).sum())} down "
          f"units ({int((~gate_up & ~ran).sum())} exiting at once), {int((~took).sum())} CTAs without a unit, "
          f"{len(set(t[:, 6].tolist()))} SMs; kernel span {span / 1e3:.2f} µs")
    print("| phase (µs: median / p90 / max) | gate/up | down |")
    print("|---|---|---|")
    for name, a, b in PHASES:
        cells = [quantiles((t[sel, b] - t[sel, a])) for sel in (gate_up & ran, ~gate_up & ran)]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    for name, col in (("start", 0), ("end", 5)):
        cells = [quantiles(t[sel, col] - t0) for sel in (gate_up & ran, ~gate_up & ran)]
        print(f"| {name}, from the first entry | {cells[0]} | {cells[1]} |")
    print("| slice (µs from first entry) | gate/up running | down waiting | down running |")
    print("|---|---|---|---|")
    rel = t[:, :6] - t0                   # ns from the first entry, int64 (a float mid-point would round)
    for i in range(SLICES):
        mid = span * (2 * i + 1) // (2 * SLICES)
        def active(sel, a, b):
            return int(((rel[:, a] <= mid) & (mid < rel[:, b]) & sel & ran).sum())
        print(f"| {mid / 1e3:6.1f} | {active(gate_up, 0, 5)} | {active(~gate_up, 0, 2)} | {active(~gate_up, 2, 5)} |")

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    traced = sorted(c for c in grouped_moe.FUSED_DECODE_CONFIGS if not expert_decode.cluster_size(c))
    p.add_argument("--config", choices=traced,
                   help="an expert_decode config with one (queue) launch (default: the pick for the tokens)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_moe_trace: needs a CUDA GPU")
    sets = [moe_set("nvfp4") for _ in range(2)]
    for m in args.tokens:
        config = args.config or expert_decode.pick_config(m, HIDDEN, INTER)
        if config not in traced:
            print(f"\n{m} tokens: {config} runs two launches or clusters; only the queue kernel is traced")
            continue
        report(m, config, *trace_once(m, config, sets, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
