"""Prefill attention microbenchmark at Flint's shapes (32 q heads, 4 KV heads, dim 128, window 513).

One request's chunk of 1K / 8K / 32K tokens from position 0 (paged pool of 16-token blocks for full
layers, the ring for sliding ones), the kernel alone, against torch's SDPA (flash backend, causal,
same shapes, no sink) as the speed reference; also the per-layer norm/RoPE/KV-write kernel and the
ring write. FLOPs: 4 * D * H per visible (query, key) pair (Q.K and P.V, 32 heads), summed over the
chunk: the usual causal count, ~550 GFLOP for a full layer's 8K chunk. Medians of CUDA-event
timings after warm-up.
Run on the GPU machine: python benchmarks/bench_prefill_attention.py [--lens 1024,8192,32768]
[--kv-cache-dtype fp8] (e4m3 pools and rings)

`--mixed CHUNK,DECODES,CONTEXT` (e.g. 512,16,8192): what decode rows cost inside a prompt step. A
chunk of CHUNK tokens ending at CONTEXT beside DECODES one-token rows at CONTEXT (each its own
request), full layer: the prefill kernel over the chunk alone, over the chunk and the decode rows
in one launch (as prompt steps run them now), and the decode rows alone through the prefill kernel
and through the decode kernel (attention.py), which a mixed step could use for them instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flint_sched.kernels.attention import attention_workspace, decode_attention_full  # noqa: E402
from flint_sched.kernels.prefill_attention import (  # noqa: E402
    KERNELS,
    Chunk,
    prefill_attention,
    prefill_metadata,
    prefill_qk_norm_rope,
    prefill_ring_write,
)
from flint_sched.quant.fp8 import KV_CACHE_DTYPES, kv_cache_dtype  # noqa: E402

H, G, D, WINDOW, BLOCK = 32, 4, 128, 513, 16
KV = {"dtype": torch.bfloat16}     # the pools' and rings' element type (--kv-cache-dtype)


def time_us(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def causal_flop(n: int, window: int | None) -> float:
    keys = sum(min(p + 1, window) if window else p + 1 for p in range(n))
    return 4.0 * D * H * keys


def bench(n: int) -> list[tuple[str, int, float, float]]:
    blocks = -(-n // BLOCK)
    meta = prefill_metadata([Chunk(0, n, 0, list(range(blocks)))], BLOCK, WINDOW, "cuda")
    qkv = torch.randn(n, (H + 2 * G) * D, device="cuda").bfloat16()
    k_pool, v_pool = (torch.randn(blocks, BLOCK, G, D, device="cuda").to(KV["dtype"]) for _ in range(2))
    k_ring, v_ring = (torch.randn(1, WINDOW, G, D, device="cuda").to(KV["dtype"]) for _ in range(2))
    sinks = torch.randn(H, device="cuda").bfloat16()
    out = torch.empty(n, H, D, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(D, dtype=torch.bfloat16, device="cuda")
    rows = []
    for kernel in KERNELS:
        label = kernel + (" fp8" if KV["dtype"] == torch.float8_e4m3fn else "")
        full = time_us(lambda: prefill_attention(qkv, k_pool, v_pool, meta, sinks, False, out=out, kernel=kernel))
        rows.append((f"prefill attention, full, {label}", n, full, causal_flop(n, None) / full / 1e6))
        sliding = time_us(lambda: prefill_attention(qkv, k_ring, v_ring, meta, sinks, True, out=out, kernel=kernel))
        rows.append((f"prefill attention, sliding, {label}", n, sliding, causal_flop(n, WINDOW) / sliding / 1e6))
    q = torch.randn(1, H, n, D, device="cuda").bfloat16()
    k, v = torch.randn(1, G, n, D, device="cuda").bfloat16(), torch.randn(1, G, n, D, device="cuda").bfloat16()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            sdpa = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            name = "SDPA flash, causal, GQA"
        except RuntimeError:
            k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
            sdpa = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            name = "SDPA flash, causal, KV expanded"
    rows.append((name, n, sdpa, causal_flop(n, None) / sdpa / 1e6))
    norm_full = time_us(lambda: prefill_qk_norm_rope(qkv, w, w, meta, 1e-5, None, k_pool, v_pool))
    rows.append(("q/k norm + paged K/V write (full)", n, norm_full, 0.0))
    norm_rope = time_us(lambda: prefill_qk_norm_rope(qkv, w, w, meta, 1e-5, 10000.0))
    rows.append(("q/k norm + RoPE (sliding)", n, norm_rope, 0.0))
    ring = time_us(lambda: prefill_ring_write(qkv, k_ring, v_ring, meta))
    rows.append(("ring write (last 513 rows)", n, ring, 0.0))
    return rows


def bench_mixed(chunk: int, decodes: int, context: int) -> list[tuple[str, int, float, float]]:
    """Full-layer attention of a mixed step's rows (see the module docstring), µs."""
    if not 1 <= chunk <= context or decodes < 1:
        raise SystemExit(f"--mixed needs 1 <= CHUNK <= CONTEXT and DECODES >= 1, got {chunk},{decodes},{context}")
    blocks = -(-(context + 1) // BLOCK)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(decodes + 1)]
    prompt = Chunk(context - chunk, chunk, 0, tables[0])
    singles = [Chunk(context, 1, r + 1, tables[r + 1]) for r in range(decodes)]
    k_pool = torch.randn((decodes + 1) * blocks, BLOCK, G, D, device="cuda").bfloat16()
    v_pool = torch.randn_like(k_pool)
    sinks = torch.randn(H, device="cuda").bfloat16()
    qkv = torch.randn(chunk + decodes, (H + 2 * G) * D, device="cuda").bfloat16()
    out = torch.empty(chunk + decodes, H, D, dtype=torch.bfloat16, device="cuda")
    cases = {"chunk alone": ([prompt], qkv[:chunk]), "chunk + decode rows, one launch": ([prompt, *singles], qkv),
             "decode rows alone": (singles, qkv[chunk:].contiguous())}
    rows = []
    for name, (chunks, x) in cases.items():
        meta = prefill_metadata(chunks, BLOCK, WINDOW, "cuda")
        us = time_us(lambda: prefill_attention(x, k_pool, v_pool, meta, sinks, False, out=out[:x.shape[0]]))
        rows.append((f"prefill kernel, {name}", x.shape[0], us, 0.0))
    q = torch.randn(decodes, H, D, device="cuda").bfloat16()
    table = torch.tensor(tables[1:], dtype=torch.int32, device="cuda")
    seq_lens = torch.full((decodes,), context + 1, dtype=torch.int32, device="cuda")
    ws = attention_workspace("cuda", decodes)
    us = time_us(lambda: decode_attention_full(q, k_pool, v_pool, table, seq_lens, sinks, ws, context + 1))
    rows.append(("decode kernel, decode rows alone", decodes, us, 0.0))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lens", default="1024,8192,32768")
    parser.add_argument("--mixed", default="", metavar="CHUNK,DECODES,CONTEXT",
                        help="also time a mixed step's full-layer attention (module docstring)")
    parser.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                        help="auto: bf16 pools and rings; fp8: e4m3 (%(default)s)")
    args = parser.parse_args()
    KV["dtype"] = kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}; chunk from position 0, block size {BLOCK}, window {WINDOW}, "
          f"KV {KV['dtype']}")
    print(f"{'kernel':<36} {'tokens':>7} {'us':>10} {'TFLOP/s':>8}")
    if args.mixed:
        for name, rows, us, _ in bench_mixed(*map(int, args.mixed.split(","))):
            print(f"{name:<36} {rows:>7} {us:>10.1f}", flush=True)
    for n in map(int, args.lens.split(",")):
        for name, tokens, us, tflops in bench(n):
            print(f"{name:<36} {tokens:>7} {us:>10.1f} {tflops:>8.1f}" if tflops else
                  f"{name:<36} {tokens:>7} {us:>10.1f} {'':>8}", flush=True)


if __name__ == "__main__":
    main()
