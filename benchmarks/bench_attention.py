"""Decode-attention microbenchmarks at Flint's shapes (32 q heads, 4 KV heads, dim 128), batch 1 and 8 by default.

Each case is captured in a CUDA graph that replays the kernel over rotating KV pools totalling
> 4x the 60 MB L2 where the working set allows (the 513-row rings of all sets at batch 1 are
~256 MB; the 100K pools are 200 MB each), so KV comes from HBM as in a real step. µs per launch
include the graph's inter-kernel gap (shorter with --pdl). GB/s counts the K and V bytes read.
Run on the GPU machine: python benchmarks/bench_attention.py [--pdl] [--batches 64,256 --contexts 1024
--num-splits 0,1,2,3] (0: the splits `decode_splits` picks; others forced, to see whether the choice is right)
[--kv-cache-dtype fp8] (e4m3 pools) [--loads bulk,cp_async] (attention.CP_ASYNC_DTYPES none / all, each case)
[--set flint_sched.kernels.attention.CTAS_PER_SM=4,...] (module constants first, ab_decode.py's syntax).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from flint_sched.benchmarks.ab_decode import set_constants  # noqa: E402
from flint_sched.benchmarks.graph_timing import num_sets, reps_for, time_graph  # noqa: E402
from flint_sched.kernels import attention  # noqa: E402
from flint_sched.kernels.attention import (
    attention_workspace,
    decode_attention_full,
    decode_attention_sliding,
    decode_splits,
    qk_norm_rope_kv_full,
    qk_norm_rope_kv_sliding,
)
from flint_sched.quant.fp8 import KV_CACHE_DTYPES, kv_cache_dtype  # noqa: E402

H, G, D, WINDOW, BLOCK = 32, 4, 128, 513, 16
MAX_SETS = 256
PDL = {"pdl": False}
KV = {"dtype": torch.bfloat16}                 # the pools' element type (--kv-cache-dtype)


def kv_bytes_per_token() -> int:
    """K and V of one layer."""
    return 2 * G * D * KV["dtype"].itemsize


def _num_sets(bytes_per_set: int) -> int:
    return num_sets(bytes_per_set, MAX_SETS)



@dataclass
class Result:
    kernel: str
    batch: int
    context: int
    splits: int
    us: float
    bytes: int

    @property
    def gbps(self) -> float:
        return self.bytes / (self.us * 1e-6) / 1e9





def bench_full(batch: int, context: int, num_splits: int | None = None) -> Result:
    blocks_per = -(-context // BLOCK)
    sets = _num_sets(batch * context * kv_bytes_per_token())
    pools = []
    for _ in range(sets):
        k = torch.randn(batch * blocks_per, BLOCK, G, D, device="cuda").to(KV["dtype"])
        tables = torch.randperm(batch * blocks_per, device="cuda").int().view(batch, blocks_per)
        pools.append((k, torch.randn(k.shape, device="cuda").to(KV["dtype"]), tables))
    q = torch.randn(batch, H, D, device="cuda").bfloat16()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    sinks = torch.zeros(H, device="cuda").bfloat16()
    out = torch.empty_like(q)
    splits = num_splits or decode_splits(batch, context)
    ws = attention_workspace("cuda", max_splits=splits)
    launches = [lambda k=k, v=v, t=t: decode_attention_full(q, k, v, t, seq_lens, sinks, ws, context, out=out,
                                                            num_splits=splits, **PDL)
                for k, v, t in pools]
    us = time_graph(launches, reps_for(sets))
    return Result("attention full (paged, bs 16)", batch, context, splits, us, batch * context * kv_bytes_per_token())


def bench_sliding(batch: int, position: int = 5000, num_splits: int | None = None) -> Result:
    sets = _num_sets(batch * WINDOW * kv_bytes_per_token())
    rings = [torch.randn(batch, WINDOW, G, D, device="cuda").to(KV["dtype"]) for _ in range(2 * sets)]
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda").bfloat16()
    seq_lens = torch.full((batch,), position + 1, dtype=torch.int32, device="cuda")
    sinks = torch.zeros(H, device="cuda").bfloat16()
    out = torch.empty_like(q)
    splits = num_splits or decode_splits(batch, WINDOW)
    ws = attention_workspace("cuda", max_splits=splits)
    launches = [lambda k=k, v=v: decode_attention_sliding(q, k, v, slots, seq_lens, sinks, ws, out=out,
                                                          num_splits=splits, **PDL)
                for k, v in zip(rings[::2], rings[1::2])]
    us = time_graph(launches, reps_for(sets))
    return Result("attention sliding (ring 513)", batch, WINDOW, splits, us, batch * WINDOW * kv_bytes_per_token())


def bench_norm_rope_kv(batch: int, sliding: bool) -> Result:
    qkv = torch.randn(batch, (H + 2 * G) * D, device="cuda").bfloat16()
    w = torch.ones(D, device="cuda").bfloat16()
    positions = torch.full((batch,), 4097, dtype=torch.int32, device="cuda")
    q_out = torch.empty(batch, H, D, device="cuda").bfloat16()
    if sliding:
        k = torch.zeros(batch, WINDOW, G, D, device="cuda").bfloat16()
        v, slots = torch.zeros_like(k), torch.arange(batch, dtype=torch.int32, device="cuda")
        launch = lambda: qk_norm_rope_kv_sliding(qkv, w, w, positions, k, v, slots, 1e-5, 10000.0,
                                                 q_out=q_out, **PDL)
    else:
        k = torch.zeros(batch * 300, BLOCK, G, D, device="cuda").bfloat16()
        v = torch.zeros_like(k)
        tables = torch.arange(batch * 300, dtype=torch.int32, device="cuda").view(batch, 300)
        launch = lambda: qk_norm_rope_kv_full(qkv, w, w, positions, k, v, tables, 1e-5, q_out=q_out, **PDL)
    us = time_graph([launch], 200)
    moved = qkv.numel() * 2 + q_out.numel() * 2 + 2 * batch * G * D * 2
    return Result(f"qk norm+rope+kv write ({'sliding' if sliding else 'full'})", batch, 1, 1, us, moved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launch for every kernel")
    parser.add_argument("--batches", default="1,8", help="requests a launch (%(default)s)")
    parser.add_argument("--contexts", default="1024,32768,100000", help="full layers' keys a request (%(default)s)")
    parser.add_argument("--num-splits", default="0", help="splits a (request, KV head): 0 = decode_splits' choice, "
                        "or a comma list to force each (%(default)s)")
    parser.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                        help="auto: bf16 pools; fp8: e4m3 (%(default)s)")
    parser.add_argument("--loads", default="",
                        help="comma list of the attention kernel's tile loads to time: bulk (one bulk copy a row), "
                             "cp_async (attention.CP_ASYNC_DTYPES); default: the dtype's own")
    parser.add_argument("--set", default="", help="module constants to set first, comma-separated "
                        "module.ATTR=value (ab_decode.py's variant syntax), e.g. "
                        "flint_sched.kernels.attention.CTAS_PER_SM=4")
    args = parser.parse_args()
    set_constants(args.set, "--set")
    PDL["pdl"] = args.pdl
    KV["dtype"] = kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16)
    loads = args.loads.split(",") if args.loads else [
        "cp_async" if KV["dtype"] in attention.CP_ASYNC_DTYPES else "bulk"]
    if not set(loads) <= {"bulk", "cp_async"}:
        raise SystemExit(f"--loads takes bulk and cp_async, got {args.loads}")
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        if KV["dtype"] == torch.bfloat16:
            results.append(("", bench_norm_rope_kv(batch, sliding=True)))
            results.append(("", bench_norm_rope_kv(batch, sliding=False)))
        for splits in (int(s) for s in args.num_splits.split(",")):
            for load in loads:
                attention.CP_ASYNC_DTYPES = attention.KV_DTYPES if load == "cp_async" else ()
                results.append((load, bench_sliding(batch, num_splits=splits)))
                for context in (int(c) for c in args.contexts.split(",")):
                    results.append((load, bench_full(batch, context, num_splits=splits)))
                    torch.cuda.empty_cache()
    print(f"KV {KV['dtype']}")
    print(f"{'kernel':36} {'loads':>8} {'batch':>5} {'context':>8} {'splits':>6} {'CTAs':>5} {'µs':>8} {'GB/s':>7}")
    for load, r in results:
        ctas = r.batch * G * r.splits if r.kernel.startswith("attention") else r.batch * 5
        print(f"{r.kernel:36} {load:>8} {r.batch:5d} {r.context:8d} {r.splits:6d} {ctas:5d} {r.us:8.2f} {r.gbps:7.0f}")


if __name__ == "__main__":
    main()

