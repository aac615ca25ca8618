"""Decode-kernel microbenchmarks at Flint's real shapes, batch 1 and 8, BF16 and NVFP4.

Each case is captured in a CUDA graph that replays the kernel many times over rotating weight sets
(or expert-id sets) totalling > 4x the 60 MB L2, so weights come from HBM as in a real step; the
time per launch includes the graph's inter-kernel gap (shorter with --pdl: programmatic dependent
launch). Bytes = weights of the rows / experts read + activations in and out.
Run on the GPU machine: python benchmarks/bench_kernels.py [--pdl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flint_sched.benchmarks.graph_timing import num_sets, reps_for, time_graph  # noqa: E402
from flint_sched.kernels import (argmax_workspace, fused_add_rms_norm, gate_up_silu, greedy, linear,  # noqa: E402
                                 moe_down, moe_gate_up, route, router_workspace)
from flint_sched.quant.nvfp4 import NVFP4Tensor, quantize  # noqa: E402

HIDDEN, Q_SIZE, QKV, DENSE_INTER, VOCAB = 2048, 4096, 5120, 10240, 151552
EXPERTS, TOP_K, MOE_INTER = 256, 6, 512
MAX_SETS = 48
PDL = {"pdl": False}          # launch option for every kernel, set from the command line


def _num_sets(bytes_per_set: int) -> int:
    return num_sets(bytes_per_set, MAX_SETS)



@dataclass
class Result:
    kernel: str
    fmt: str
    batch: int
    us: float
    bytes: int

    @property
    def gbps(self) -> float:
        return self.bytes / (self.us * 1e-6) / 1e9


def nbytes(w) -> int:
    if isinstance(w, NVFP4Tensor):
        return w.codes.numel() + w.block_scales.numel()
    return w.numel() * w.element_size()


def make_weight(fmt: str, *shape: int, per_expert: bool = False):
    w = torch.randn(*shape, device="cuda") / shape[-1] ** 0.5
    return quantize(w, per_leading_scale=per_expert) if fmt == "nvfp4" else w.bfloat16()





def bench_linear(name: str, fmt: str, b: int, n: int, k: int, residual: bool = False) -> Result:
    probe = make_weight(fmt, n, k)
    sets = [probe] + [make_weight(fmt, n, k) for _ in range(_num_sets(nbytes(probe)) - 1)]
    x = torch.randn(b, k, device="cuda").bfloat16()
    res = torch.randn(b, n, device="cuda").bfloat16() if residual else None
    y = torch.empty(b, n, device="cuda", dtype=torch.bfloat16)
    launches = [lambda w=w: linear(x, w, residual=res, out=y, **PDL) for w in sets]
    us = time_graph(launches, reps_for(len(sets)))
    moved = nbytes(probe) + x.numel() * 2 + y.numel() * 2 * (2 if residual else 1)
    return Result(name, fmt, b, us, moved)


def bench_gate_up(fmt: str, b: int) -> Result:
    def pair():
        return make_weight(fmt, DENSE_INTER, HIDDEN), make_weight(fmt, DENSE_INTER, HIDDEN)

    probe = pair()
    sets = [probe] + [pair() for _ in range(_num_sets(2 * nbytes(probe[0])) - 1)]
    x = torch.randn(b, HIDDEN, device="cuda").bfloat16()
    h = torch.empty(b, DENSE_INTER, device="cuda", dtype=torch.bfloat16)
    launches = [lambda g=g, u=u: gate_up_silu(x, g, u, out=h, **PDL) for g, u in sets]
    us = time_graph(launches, reps_for(len(sets)))
    return Result("dense gate/up+silu 2048->2x10240", fmt, b, us, 2 * nbytes(probe[0]) + x.numel() * 2 + h.numel() * 2)


def bench_norm(b: int) -> Result:
    x = torch.randn(b, HIDDEN, device="cuda").bfloat16()
    r = torch.randn(b, HIDDEN, device="cuda").bfloat16()
    w = torch.ones(HIDDEN, device="cuda").bfloat16()
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    us = time_graph([lambda: fused_add_rms_norm(x, r, w, 1e-5, out=out, residual_out=res_out, **PDL)], 200)
    return Result("add+rmsnorm 2048 (L2-resident)", "bf16", b, us, 5 * x.numel() * 2 + HIDDEN * 2)


def bench_router(b: int) -> Result:
    gates = [make_weight("bf16", EXPERTS, HIDDEN) for _ in range(_num_sets(EXPERTS * HIDDEN * 2))]
    bias = 0.1 * torch.randn(EXPERTS, device="cuda")
    x = torch.randn(b, HIDDEN, device="cuda").bfloat16()
    ids = torch.empty(b, TOP_K, dtype=torch.int32, device="cuda")
    weights = torch.empty(b, TOP_K, device="cuda")
    ws = router_workspace(EXPERTS, "cuda")
    launches = [lambda g=g: route(x, g, bias, TOP_K, 2.5, ids=ids, weights=weights, workspace=ws, **PDL) for g in gates]
    us = time_graph(launches, reps_for(len(gates)))
    return Result("router 2048->256 top-6", "bf16", b, us, EXPERTS * HIDDEN * 2 + x.numel() * 2)


def random_ids(b: int, count: int) -> list[torch.Tensor]:
    return [torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(b)]).int().cuda() for _ in range(count)]


def bench_moe(fmt: str, b: int, stacks: dict) -> list[Result]:
    id_sets = random_ids(b, 32)
    distinct = statistics.mean(len(set(ids.flatten().tolist())) for ids in id_sets)
    x = torch.randn(b, HIDDEN, device="cuda").bfloat16()
    weights = torch.rand(b, TOP_K, device="cuda")
    h = torch.empty(b, TOP_K + 1, MOE_INTER, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(b, HIDDEN, device="cuda", dtype=torch.bfloat16)
    s = stacks
    per_expert_gate_up = 2 * nbytes(s["gate"]) // EXPERTS
    per_expert_down = nbytes(s["down"]) // EXPERTS
    gate_up = [lambda ids=ids: moe_gate_up(x, ids, s["gate"], s["up"], s["shared_gate"], s["shared_up"], out=h,
                                                   **PDL)
               for ids in id_sets]
    down = [lambda ids=ids: moe_down(h, ids, weights, s["down"], s["shared_down"], residual=x, out=y, **PDL)
            for ids in id_sets]
    us_gate_up = time_graph(gate_up, reps_for(len(id_sets)))
    us_down = time_graph(down, reps_for(len(id_sets)))
    acts = x.numel() * 2 + h.numel() * 2
    return [Result(f"moe gate/up+silu ({distinct:.1f} experts + shared)", fmt, b, us_gate_up,
                   int((distinct + 1) * per_expert_gate_up) + acts),
            Result(f"moe down+sum+residual ({distinct:.1f} + shared)", fmt, b, us_down,
                   int((distinct + 1) * per_expert_down) + acts + 2 * y.numel() * 2)]


def expert_stacks(fmt: str) -> dict:
    return dict(gate=make_weight(fmt, EXPERTS, MOE_INTER, HIDDEN, per_expert=True),
                up=make_weight(fmt, EXPERTS, MOE_INTER, HIDDEN, per_expert=True),
                down=make_weight(fmt, EXPERTS, HIDDEN, MOE_INTER, per_expert=True),
                shared_gate=make_weight(fmt, MOE_INTER, HIDDEN), shared_up=make_weight(fmt, MOE_INTER, HIDDEN),
                shared_down=make_weight(fmt, HIDDEN, MOE_INTER))


def bench_argmax(dtype: torch.dtype, b: int) -> Result:
    x = torch.randn(b, VOCAB, device="cuda").to(dtype)
    out = torch.empty(b, dtype=torch.int32, device="cuda")
    ws = argmax_workspace(b, VOCAB, "cuda")
    us = time_graph([lambda: greedy(x, out=out, workspace=ws, **PDL)], 200)
    return Result(f"argmax over {VOCAB} (L2-resident)", "bf16" if dtype == torch.bfloat16 else "fp32", b, us,
                  x.numel() * x.element_size())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
    parser.add_argument("--pdl", action="store_true", help="launch with programmatic dependent launch")
    args = parser.parse_args()
    PDL["pdl"] = args.pdl
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, pdl={args.pdl}", flush=True)
    results: list[Result] = []

    def add(*new: Result) -> None:
        for r in new:
            results.append(r)
            print(f"{r.kernel:<46} {r.fmt:<5} B={r.batch}  {r.us:8.2f} us  {r.gbps:6.0f} GB/s", flush=True)

    for b in args.batches:
        add(bench_norm(b), bench_router(b), bench_argmax(torch.bfloat16, b), bench_argmax(torch.float32, b))
        add(bench_linear(f"LM head {HIDDEN}->{VOCAB}", "bf16", b, VOCAB, HIDDEN))
        for fmt in args.formats:
            add(bench_linear(f"qkv {HIDDEN}->{QKV}", fmt, b, QKV, HIDDEN))
            add(bench_linear(f"o_proj+residual {Q_SIZE}->{HIDDEN}", fmt, b, HIDDEN, Q_SIZE, residual=True))
            add(bench_gate_up(fmt, b))
            add(bench_linear(f"dense down+residual {DENSE_INTER}->{HIDDEN}", fmt, b, HIDDEN, DENSE_INTER,
                             residual=True))
            torch.cuda.empty_cache()
    for fmt in args.formats:
        stacks = expert_stacks(fmt)
        for b in args.batches:
            add(*bench_moe(fmt, b, stacks))
        del stacks
        torch.cuda.empty_cache()
    print()
    print(f"| {'kernel':<46} | {'fmt':<5} | {'B':>2} | {'us':>8} | {'MB moved':>9} | {'GB/s':>7} |")
    print(f"|{'-' * 48}|{'-' * 7}|{'-' * 4}|{'-' * 10}|{'-' * 11}|{'-' * 9}|")
    for r in sorted(results, key=lambda r: (r.kernel, r.fmt, r.batch)):
        print(f"| {r.kernel:<46} | {r.fmt:<5} | {r.batch:>2} | {r.us:8.2f} | {r.bytes / 1e6:9.2f} | {r.gbps:7.0f} |")


if __name__ == "__main__":
    main()

