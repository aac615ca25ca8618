"""Issue 17's first question: what does a dependency cost as a counter inside one persistent launch,
against a kernel boundary (a launch per GEMV in a CUDA graph, with and without PDL)?

A chain of L NVFP4 GEMVs of one token, h[i + 1] = W[i] . h[i], W [L, 2048, 2048] (Flint's hidden
size; 2.4 MB a layer, ~0.55 µs of the H200's bandwidth): launched as L `linear` calls, or as one
`gemv_chain_nvfp4` (cuda/gemv_chain.cu) whose CTAs wait on per-layer counters. Both compute the
same tiles in the same order, so the chains must agree bit for bit (checked before timing). Two
chain lengths above the L2's 60 MB give the cost per layer as the slope, without the fixed cost of
a graph launch:

    python3 benchmarks/bench_persistent.py [--layers 32 64] [--warps 8 16]

Each persistent chain runs twice: its counts after fence.sc.gpu (as the kernels' tickets do by
default) and as one release atomic (kernels/tickets.py ACQ_REL): the difference in the slope is what
the fence costs a dependency.

The ring chains (`gemv_chain_ring_nvfp4`) add a producer warp a CTA that streams the coming layers'
rows into shared-memory stages ahead of the counters (issue 17's design): their slope is what a
dependency costs once an operation's weights are already on the SM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flint_sched.benchmarks.graph_timing import time_graph  # noqa: E402
from flint_sched.kernels import linear  # noqa: E402
from flint_sched.kernels._runtime import I32, compile_kernel  # noqa: E402
from flint_sched.kernels.linear import resident_ctas  # noqa: E402
from flint_sched.quant.nvfp4 import NVFP4Tensor, quantize  # noqa: E402

HIDDEN = 2048
TILE_ROWS = 16
BANDWIDTH = 4.26e12       # bytes/s, the H200's measured read bandwidth (KERNELS.md)


def chain_shape(h: torch.Tensor, w: NVFP4Tensor, done: torch.Tensor) -> tuple[int, int, int]:
    """(layers L, N, CTAs) of a chain over w [L, N, N], h [L + 1, N] and done [>= L] checked."""
    layers, n, k = w.shape
    if n != k or n % TILE_ROWS or tuple(h.shape) != (layers + 1, n) or done.numel() < layers:
        raise ValueError(f"h [{layers + 1}, {n}] and done [>= {layers}] for w {tuple(w.shape)} with N == K")
    return layers, n, n // TILE_ROWS


def gemv_chain(h: torch.Tensor, w: NVFP4Tensor, done: torch.Tensor, warps: int, sleep_ns: int = 0,
               acq_rel: bool = False) -> None:
    """h [L + 1, N] bf16 (h[0] the input) <- the chain of w [L, N, N]; done: int32 [L], zeroed here.
    acq_rel: each count one release atomic (cuda/common.cuh TICKET_ACQ_REL) instead of fence.sc first."""
    layers, n, tiles = chain_shape(h, w, done)
    if tiles > resident_ctas(warps, "nvfp4"):     # every CTA must be resident, or the waits never end
        raise ValueError(f"{tiles} CTAs of {warps} warps do not fit on this GPU at once")
    done.zero_()
    kernel = compile_kernel("gemv_chain.cu", "gemv_chain_nvfp4",
                            {"GEMV_WARPS": warps, "X_BATCH": 0, "GEMV_GROUPS": 1, "CHAIN_SLEEP_NS": sleep_ns,
                             "TICKET_ACQ_REL": int(acq_rel)})
    kernel.launch((tiles, 1, 1), (32 * warps, 1, 1),
                  [h, w.codes, w.block_scales, w.tensor_scale, done, I32(layers), I32(n), I32(n)])


def gemv_chain_ring(h: torch.Tensor, w: NVFP4Tensor, done: torch.Tensor, warps: int, stages: int,
                    sleep_ns: int = 0) -> None:
    """As gemv_chain, with the weights streamed into `stages` shared-memory stages a CTA by one more
    warp, ahead of the counters (cuda/gemv_chain.cu gemv_chain_ring_nvfp4)."""
    layers, n, tiles = chain_shape(h, w, done)
    kernel = compile_kernel("gemv_chain.cu", "gemv_chain_ring_nvfp4",
                            {"GEMV_WARPS": warps, "X_BATCH": 0, "GEMV_GROUPS": 1, "CHAIN_SLEEP_NS": sleep_ns,
                             "RING_STAGES": stages, "TICKET_ACQ_REL": 1})
    threads, ring_bytes = 32 * (warps + 1), stages * 9 * n      # a stage: 16 rows of K/2 codes, K/16 scales
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    if tiles > sms * kernel.resident_blocks(threads, ring_bytes):
        raise ValueError(f"{tiles} CTAs of {warps} + 1 warps and {ring_bytes} B of stages do not fit on this GPU at once")
    done.zero_()
    kernel.launch((tiles, 1, 1), (threads, 1, 1),
                  [h, w.codes, w.block_scales, w.tensor_scale, done, I32(layers), I32(n), I32(n)],
                  shared_bytes=ring_bytes)


def layer(w: NVFP4Tensor, i: int) -> NVFP4Tensor:
    return NVFP4Tensor(w.codes[i], w.block_scales[i], w.tensor_scale[i:i + 1])


def launched_chain(h: torch.Tensor, w: NVFP4Tensor, warps: int, pdl: bool) -> None:
    for i in range(w.shape[0]):
        linear(h[i:i + 1], layer(w, i), out=h[i + 1:i + 2], pdl=pdl, warps=warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=2, default=[32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--sleep-ns", type=int, nargs="+", default=[0, 64])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8], help="the ring chains' stages")
    args = parser.parse_args()
    short, long = args.layers
    w_all = quantize(torch.randn(long, HIDDEN, HIDDEN, device="cuda") / HIDDEN**0.5, per_leading_scale=True)
    per_layer = (w_all.codes[0].numel() + w_all.block_scales[0].numel()) / BANDWIDTH * 1e6
    x = torch.randn(HIDDEN, device="cuda").bfloat16()
    print(f"NVFP4 {HIDDEN} x {HIDDEN} GEMVs of one token; the bandwidth's time a layer: {per_layer:.2f} µs")
    print("| chain | warps | µs for {} layers | for {} | µs a layer (slope) |".format(short, long))
    print("|---|---|---|---|---|")
    for warps in args.warps:
        chains = {"launches, PDL": lambda h, w: launched_chain(h, w, warps, True),
                  "launches, no PDL": lambda h, w: launched_chain(h, w, warps, False)}
        for sleep_ns in args.sleep_ns:
            for acq_rel in (False, True):      # fence.sc then the count, or one acquire-release atomic
                chains[f"persistent, counters (pause {sleep_ns} ns{', acq_rel' if acq_rel else ''})"] = (
                    lambda h, w, d=torch.zeros(long, dtype=torch.int32, device="cuda"), s=sleep_ns, a=acq_rel:
                    gemv_chain(h, w, d, warps, s, a))
        for stages in args.stages:
            chains[f"ring of {stages} stages"] = (
                lambda h, w, d=torch.zeros(long, dtype=torch.int32, device="cuda"), st=stages:
                gemv_chain_ring(h, w, d, warps, st))
        results = {}
        for name, run in chains.items():
            times = []
            for layers in (short, long):
                w = NVFP4Tensor(w_all.codes[:layers], w_all.block_scales[:layers], w_all.tensor_scale[:layers])
                h = torch.zeros(layers + 1, HIDDEN, dtype=torch.bfloat16, device="cuda")
                h[0] = x
                times.append(time_graph([lambda h=h, w=w: run(h, w)], reps=4))
                results.setdefault(layers, []).append(h.clone())
            slope = (times[1] - times[0]) / (long - short)
            print(f"| {name} | {warps} | {times[0]:.1f} | {times[1]:.1f} | **{slope:.2f}** |", flush=True)
        for layers, outs in results.items():          # every chain the same, bit for bit
            if not all(torch.equal(outs[0], o) for o in outs[1:]):
                raise SystemExit(f"the chains of {layers} layers at {warps} warps disagree")


if __name__ == "__main__":
    main()
