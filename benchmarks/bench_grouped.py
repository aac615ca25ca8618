"""Grouped-path benchmarks on the GPU: Flint's MoE layer and dense GEMMs at 16-8192 tokens.

MoE layer (E=256, top-6 + shared, hidden 2048, I 512): moe_grouped (router logits, routing, gate/up,
down, finalize: five launches) replayed in a CUDA graph over rotating weight sets larger than L2.
Bytes = weights of the distinct experts touched (+ shared + router) + activations in and out;
FLOPs = 2 * (routed + shared rows) * 3 * I * H + router. Peers: torch._grouped_mm (BF16, same
routing, sorted rows prepared outside the timing) and cuBLAS (torch.matmul) for the dense shapes.
--paths swap-ab decode tiled: the MoE layer on the swap-AB expert GEMMs (grouped_gemm.cu), the decode
ones (expert_decode.cu, NVFP4) and the tiled ones (expert_gemm.cu). --decode-probes: also each
--decode-configs entry built with expert_decode.cu's ED_PROBE 1 (no NVFP4 decode) and 2 (no weight
loads after a warp's first two rounds): wrong results, the time each part costs by difference.
Run on the GPU machine: python3 benchmarks/bench_grouped.py [--pdl] [--tokens ...] [--paths ...]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flint_sched.benchmarks.graph_timing import num_sets, reps_for, time_graph  # noqa: E402
from flint_sched.kernels import (expert_decode, expert_gemm, grouped, grouped_linear, grouped_moe, moe_grouped,  # noqa: E402
                                 moe_routing_workspace)
from flint_sched.quant.nvfp4 import NVFP4Tensor, quantize  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER, SCALING = 2048, 256, 6, 512, 2.5
DENSE = [("q/k/v 2048->5120", 5120, 2048), ("o_proj 4096->2048", 2048, 4096), ("LM head 2048->151552", 151552, 2048)]
MAX_SETS = 8


@dataclass
class Row:
    name: str
    impl: str
    fmt: str
    tokens: int
    us: float
    bytes: int
    flops: int

    def line(self) -> str:
        tbs, tflops = self.bytes / self.us / 1e6, self.flops / self.us / 1e6
        return (f"| {self.name:<22} | {self.impl:<16} | {self.fmt:<5} | {self.tokens:>5} | {self.us:9.1f} | "
                f"{self.bytes / 1e6:9.1f} | {tbs:5.2f} | {tflops:7.1f} |")


def nbytes(w) -> int:
    if isinstance(w, NVFP4Tensor):
        return w.codes.numel() + w.block_scales.numel() + 4 * w.tensor_scale.numel()
    return w.numel() * w.element_size()


def weight(fmt: str, *shape: int):
    w = torch.randn(*shape, device="cuda") / shape[-1] ** 0.5
    return quantize(w, per_leading_scale=len(shape) == 3) if fmt == "nvfp4" else w.bfloat16()


def moe_set(fmt: str) -> dict:
    return dict(router=weight("bf16", EXPERTS, HIDDEN), bias=0.1 * torch.randn(EXPERTS, device="cuda"),
                gate=weight(fmt, EXPERTS, INTER, HIDDEN), up=weight(fmt, EXPERTS, INTER, HIDDEN),
                down=weight(fmt, EXPERTS, HIDDEN, INTER), shared_gate=weight(fmt, INTER, HIDDEN),
                shared_up=weight(fmt, INTER, HIDDEN), shared_down=weight(fmt, HIDDEN, INTER))


PEERS = True


@contextmanager
def forced_tiles(tiles: int):
    """The MoE GEMMs with `tiles` 16-row tiles per CTA (0: as the launcher picks)."""
    real = grouped_moe.moe_tiles_per_cta
    if tiles:
        grouped_moe.moe_tiles_per_cta = lambda: tiles
    try:
        yield
    finally:
        grouped_moe.moe_tiles_per_cta = real


PATHS = {"auto": None, "swap-ab": "swap-ab", "decode": "decode", "tiled": "tiled"}


def bench_moe(fmt: str, sets: list[dict], m: int, pdl: bool, impl: str = "moe_grouped", gemms: str | None = None,
              peers: bool = True) -> list[Row]:
    # the same x for every config and path of one size: the same routing, the same experts read
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, HIDDEN, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(m, HIDDEN, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(x)
    ws = moe_routing_workspace(m, EXPERTS, TOP_K, "cuda", hidden_size=HIDDEN, intermediate_size=INTER)

    def run(s):
        return moe_grouped(x, s["router"], s["bias"], TOP_K, SCALING, s["gate"], s["up"], s["down"],
                           s["shared_gate"], s["shared_up"], s["shared_down"], residual, ws, out=out, pdl=pdl,
                           gemms=gemms)

    run(sets[0])
    ids = ws.ids[:m].clone()
    distinct = len(torch.unique(ids))
    s = sets[0]
    per_expert = (nbytes(s["gate"]) + nbytes(s["up"]) + nbytes(s["down"])) // EXPERTS
    pairs = m * (TOP_K + 1)
    moved = ((distinct + 1) * per_expert + nbytes(s["router"]) + 3 * x.numel() * 2
             + pairs * (INTER + HIDDEN) * 2 * 2 + m * EXPERTS * 4 * 2)
    flops = 2 * pairs * 3 * INTER * HIDDEN + 2 * m * EXPERTS * HIDDEN
    us = time_graph([lambda s=s: run(s) for s in sets], reps_for(len(sets), 10 if m >= 1024 else 40), replays=5)
    rows = [Row(f"MoE layer ({distinct} exp)", impl, fmt, m, us, moved, flops)]
    if fmt == "bf16" and PEERS and peers:
        rows += bench_grouped_mm(x, ids, m, moved, flops)
    return rows


def bench_grouped_mm(x: torch.Tensor, ids: torch.Tensor, m: int, moved: int, flops: int) -> list[Row]:
    """torch._grouped_mm with the same routing: rows pre-sorted by expert (257 groups, the shared
    expert last); gate/up as one [2I] matrix, silu*mul, down, then the weighted combine."""
    if not hasattr(torch, "_grouped_mm"):
        return []
    try:
        groups = EXPERTS + 1
        expert = torch.cat([ids.long(), torch.full((m, 1), EXPERTS, device="cuda")], 1).flatten()
        order = torch.argsort(expert, stable=True)
        token = order // (TOP_K + 1)
        offs = torch.cumsum(torch.bincount(expert, minlength=groups), 0).int()
        combine = torch.rand(m * (TOP_K + 1), 1, device="cuda")
        w13 = (torch.randn(groups, 2 * INTER, HIDDEN, device="cuda") / HIDDEN**0.5).bfloat16().transpose(1, 2)
        w2 = (torch.randn(groups, HIDDEN, INTER, device="cuda") / INTER**0.5).bfloat16().transpose(1, 2)
        xs = x[token]
        y = torch.zeros(m, HIDDEN, device="cuda", dtype=torch.float32)

        def run():
            gu = torch._grouped_mm(xs, w13, offs=offs)
            h = F.silu(gu[:, :INTER]) * gu[:, INTER:]
            yd = torch._grouped_mm(h, w2, offs=offs)
            y.index_add_(0, token, yd.float() * combine)

        us = time_graph([run], reps_for(1, 10 if m >= 1024 else 40), replays=5)
        return [Row("MoE experts, no router", "torch._grouped_mm", "bf16", m, us, moved, flops)]
    except Exception as exc:  # noqa: BLE001 - a peer that does not run here is reported, not fatal
        print(f"torch._grouped_mm at {m} tokens failed: {type(exc).__name__}: {exc}", flush=True)
        return []


def bench_dense(name: str, n: int, k: int, m: int, formats: list[str]) -> list[Row]:
    x = torch.randn(m, k, device="cuda").bfloat16()
    rows = []
    for fmt in formats:
        probe = weight(fmt, n, k)
        sets = [probe] + [weight(fmt, n, k) for _ in range(num_sets(nbytes(probe), MAX_SETS) - 1)]
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        moved, flops = nbytes(probe) + (x.numel() + y.numel()) * 2, 2 * m * n * k
        us = time_graph([lambda w=w: grouped_linear(x, w, out=y, cublas=False) for w in sets], reps_for(len(sets)),
                        replays=5)
        rows.append(Row(name, "grouped_linear", fmt, m, us, moved, flops))
        if fmt == "bf16":
            us = time_graph([lambda w=w: torch.matmul(x, w.t(), out=y) for w in sets], reps_for(len(sets)),
                            replays=5)
            rows.append(Row(name, "cuBLAS", fmt, m, us, moved, flops))
        del sets
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 8192])
    parser.add_argument("--dense-tokens", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
    parser.add_argument("--pdl", action="store_true")
    parser.add_argument("--moe-tiles", type=int, nargs="+", default=[0],
                        help="16-row weight tiles per CTA of the MoE GEMMs to compare (1, 4; 0: the launcher's choice)")
    parser.add_argument("--moe-small-chunk", type=int, nargs="+", default=[0],
                        help="rows per item of the decode-sized MoE GEMMs to compare (8, 16; 0: grouped.MOE_SMALL_CHUNK)")
    parser.add_argument("--no-peers", action="store_true", help="skip torch._grouped_mm")
    parser.add_argument("--paths", nargs="+", default=["auto"], choices=sorted(PATHS),
                        help="MoE expert GEMMs: the launcher's choice, or one of grouped_moe.GEMMS")
    parser.add_argument("--tiled-configs", nargs="+", default=[], choices=sorted(expert_gemm.CONFIGS),
                        help="tiled configs to compare (default: expert_gemm.DEFAULT_CONFIG)")
    parser.add_argument("--decode-configs", nargs="+", default=[], choices=sorted(expert_decode.CONFIGS),
                        help="decode configs to compare (default: expert_decode.pick_config)")
    parser.add_argument("--decode-probes", action="store_true",
                        help="also time the ED_PROBE builds of each --decode-configs entry (module docstring)")
    parser.add_argument("--define", action="append", default=[], metavar="SETS",
                        help="compare compile-time settings of the grouped GEMMs, e.g. "
                             "'NVFP4_UNROLL=8,GG_MIN_CTAS=2' (repeatable; the defaults are always run)")
    args = parser.parse_args()
    if args.decode_probes:
        if not args.decode_configs:
            parser.error("--decode-probes needs --decode-configs")
        for config in list(args.decode_configs):
            for n in (1, 2):
                expert_decode.CONFIGS[f"{config}-probe{n}"] = dict(expert_decode.CONFIGS[config], ED_PROBE=n)
                args.decode_configs.append(f"{config}-probe{n}")
    global PEERS
    PEERS = not args.no_peers
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, pdl={args.pdl}", flush=True)
    rows: list[Row] = []
    header = (f"| {'case':<22} | {'impl':<16} | {'fmt':<5} | {'M':>5} | {'us':>9} | {'MB moved':>9} | "
              f"{'TB/s':>5} | {'TFLOP/s':>7} |")

    def add(new: list[Row]) -> None:
        for r in new:
            rows.append(r)
            print(r.line(), flush=True)

    print(header)
    for fmt in args.formats:
        probe = moe_set(fmt)
        per_set = sum(nbytes(probe[k]) for k in ("gate", "up", "down"))
        sets = [probe] + [moe_set(fmt) for _ in range(num_sets(per_set, MAX_SETS) - 1)]
        for m in args.tokens:
            first = True
            for path in args.paths:
                configs = (args.tiled_configs if path == "tiled" and args.tiled_configs else
                           args.decode_configs if path == "decode" and args.decode_configs else [""])
                for config in configs:
                    if config and path == "tiled" and fmt not in expert_gemm.formats(config):
                        continue
                    default = dict(expert_gemm.DEFAULT_CONFIG)
                    if config and path == "tiled":
                        expert_gemm.DEFAULT_CONFIG[fmt] = config
                    if config and path == "decode":
                        expert_decode.CONFIG = config
                    for tiles, small, tuning in itertools.product(args.moe_tiles, args.moe_small_chunk,
                                                                  [""] + args.define):
                        grouped.TUNING.clear()
                        grouped.TUNING.update({k: int(v) for k, v in (d.split("=") for d in tuning.split(",") if d)})
                        default_small = grouped.MOE_SMALL_CHUNK
                        grouped.MOE_SMALL_CHUNK = small or default_small
                        name = " ".join(filter(None, ["moe_grouped" if path == "auto" else path, config,
                                                      f"t{tiles}" if tiles else "", f"c{small}" if small else "",
                                                      tuning]))
                        with forced_tiles(tiles):
                            add(bench_moe(fmt, sets, m, args.pdl, name, PATHS[path], peers=first))
                        first = False
                        grouped.MOE_SMALL_CHUNK = default_small
                    grouped.TUNING.clear()
                    expert_gemm.DEFAULT_CONFIG.update(default)
                    expert_decode.CONFIG = None
        del sets, probe
        torch.cuda.empty_cache()
    for name, n, k in DENSE:
        for m in args.dense_tokens:
            add(bench_dense(name, n, k, m, args.formats))
    print()
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.strip("|").split("|")) + "|")
    for r in rows:
        print(r.line())


if __name__ == "__main__":
    main()
