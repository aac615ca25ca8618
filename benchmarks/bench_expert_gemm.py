"""The MoE expert GEMMs alone at prefill sizes: tiled (cuda/expert_gemm.cu, each config) against the
swap-AB kernels (cuda/grouped_gemm.cu), Flint's shapes (E=256 + shared, top-6, hidden 2048, I 512).

Routing is done once outside the timing (router logits from random x); gate/up and down are timed
together in a CUDA graph over rotating weight sets larger than L2. TFLOP/s count the real rows:
2 * P * (2 I H + H I), P = tokens * 7. A quick check first: relative L2 error of h and y against
an fp32 per-expert loop at 1,000 tokens, per format and config.
Run on the GPU machine: python3 benchmarks/bench_expert_gemm.py [--tokens ...] [--formats ...]

`--random-routing`: route random router logits instead of a random router over random x (this
router's choices bunch on ~100 experts; the full model's spread over all of them, as random logits
do). `--probes` (wgmma configs): also time each config built with cuda/expert_gemm.cu's EG_PROBE
1 / 2 / 3 (the NVFP4 decode, the MMAs, the loads after the prologue left out; wrong results, not
checked), so the differences say what each stage costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flint_sched.benchmarks.graph_timing import num_sets, reps_for, time_graph  # noqa: E402
from flint_sched.kernels import (expert_gemm, grouped_linear, moe_down_sorted, moe_gate_up_sorted,  # noqa: E402
                                 moe_routing_workspace, route_and_sort)
from flint_sched.quant.nvfp4 import NVFP4Tensor, quantize  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER, SCALING = 2048, 256, 6, 512, 2.5
MAX_SETS = 8


def weight(fmt: str, *shape: int):
    w = torch.randn(*shape, device="cuda") / shape[-1] ** 0.5
    return quantize(w, per_leading_scale=len(shape) == 3) if fmt == "nvfp4" else w.bfloat16()


def nbytes(w) -> int:
    if isinstance(w, NVFP4Tensor):
        return w.codes.numel() + w.block_scales.numel()
    return w.numel() * 2


def expert_set(fmt: str) -> dict:
    return dict(gate=weight(fmt, EXPERTS, INTER, HIDDEN), up=weight(fmt, EXPERTS, INTER, HIDDEN),
                down=weight(fmt, EXPERTS, HIDDEN, INTER), shared_gate=weight(fmt, INTER, HIDDEN),
                shared_up=weight(fmt, INTER, HIDDEN), shared_down=weight(fmt, HIDDEN, INTER))


def routed(m: int, chunk: int | None, random_logits: bool = False):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).bfloat16()
    router = (torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).bfloat16()
    bias = 0.1 * torch.randn(EXPERTS, device="cuda", generator=g)
    ws = moe_routing_workspace(m, EXPERTS, TOP_K, "cuda", hidden_size=HIDDEN, intermediate_size=INTER)
    if random_logits:
        logits = ws.logits[:m].copy_(torch.randn(m, EXPERTS, device="cuda", generator=g))
    else:
        logits = grouped_linear(x, router, out=ws.logits[:m], out_dtype=torch.float32)
    return x, ws, route_and_sort(logits, bias, TOP_K, SCALING, ws, chunk=chunk)


def run_tiled(x, ws, r, s, config):
    p = r.sorted_token.numel()
    h = expert_gemm.expert_gate_up(x, r, s["gate"], s["up"], s["shared_gate"], s["shared_up"], out=ws.h_sorted[:p],
                                   config=config)
    return h, expert_gemm.expert_down(h, r, s["down"], s["shared_down"], out=ws.y_sorted[:p], config=config)


def run_old(x, ws, r, s):
    p = r.sorted_token.numel()
    h = moe_gate_up_sorted(x, r, s["gate"], s["up"], s["shared_gate"], s["shared_up"], out=ws.h_sorted[:p])
    return h, moe_down_sorted(h, r, s["down"], s["shared_down"], out=ws.y_sorted[:p])


def dense(w, e=None):
    if isinstance(w, NVFP4Tensor):
        if e is not None:
            w = NVFP4Tensor(w.codes[e], w.block_scales[e], w.tensor_scale[e:e + 1])
        return w.dequantize(torch.float32)
    return (w if e is None else w[e]).float()


def check(fmt: str, s: dict, config: str) -> str:
    x, ws, r = routed(1000, expert_gemm.TILE_M)
    p = r.sorted_token.numel()
    ws.h_sorted.fill_(float("nan"))
    ws.y_sorted.fill_(float("nan"))
    h, y = run_tiled(x, ws, r, s, config)
    offsets, st = r.offsets.cpu().tolist(), r.sorted_token.long()
    h_ref, y_ref = torch.zeros(p, INTER, device="cuda"), torch.zeros(p, HIDDEN, device="cuda")
    for e in range(EXPERTS + 1):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        names = ("shared_gate", "shared_up", "shared_down") if e == EXPERTS else ("gate", "up", "down")
        wg, wu, wd = (dense(s[n], None if e == EXPERTS else e) for n in names)
        xr = x[st[lo:hi]].float()
        h_ref[lo:hi] = F.silu(xr @ wg.t()) * (xr @ wu.t())
        y_ref[lo:hi] = h[lo:hi].float() @ wd.t()

    def err(a, b):
        return f"{float((a.float() - b).norm() / b.norm()):.2e} (NaN {int(a.isnan().sum())})"

    return f"check {fmt} {config}: h rel err {err(h, h_ref)}, y rel err {err(y, y_ref)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
    parser.add_argument("--configs", nargs="+", default=sorted(expert_gemm.CONFIGS))
    parser.add_argument("--no-old", action="store_true", help="skip the swap-AB kernels")
    parser.add_argument("--random-routing", action="store_true", help="route random logits (module docstring)")
    parser.add_argument("--probes", action="store_true", help="also time the EG_PROBE builds (module docstring)")
    args = parser.parse_args()
    probes = []
    if args.probes:
        for c in args.configs:
            if expert_gemm.CONFIGS[c].get("EG_WGMMA"):
                for n in (1, 2, 3):
                    expert_gemm.CONFIGS[f"{c}-probe{n}"] = dict(expert_gemm.CONFIGS[c], EG_PROBE=n)
                    probes.append(f"{c}-probe{n}")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}", flush=True)
    lines = []
    for fmt in args.formats:
        probe = expert_set(fmt)
        per_set = sum(nbytes(probe[k]) for k in ("gate", "up", "down"))
        sets = [probe] + [expert_set(fmt) for _ in range(num_sets(per_set, MAX_SETS) - 1)]
        for config in args.configs:
            if fmt in expert_gemm.formats(config):
                print(check(fmt, probe, config), flush=True)
        for m in args.tokens:
            flops = 2 * m * (TOP_K + 1) * 3 * INTER * HIDDEN
            impls = [(f"tiled {c}", expert_gemm.TILE_M, lambda x, ws, r, s, c=c: run_tiled(x, ws, r, s, c))
                     for c in args.configs + probes if fmt in expert_gemm.formats(c)]
            if not args.no_old:
                impls.append(("swap-AB (old)", None, run_old))
            for name, chunk, fn in impls:
                x, ws, r = routed(m, chunk, args.random_routing)
                us = time_graph([lambda s=s: fn(x, ws, r, s) for s in sets], reps_for(len(sets), 10), replays=5)
                line = f"| {fmt:<5} | {m:>5} | {name:<22} | {us:9.1f} | {flops / us / 1e6:7.1f} |"
                lines.append(line)
                print(line, flush=True)
        del sets, probe
        torch.cuda.empty_cache()
    print("\n| fmt   |     M | expert GEMMs   | gate/up + down us | TFLOP/s |\n|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
