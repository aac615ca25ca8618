"""`flint-sched bench latency`: decode step time and prefill throughput of the executor, no HTTP.

Decode: B requests that each already hold C tokens of (random) KV run one-token steps; the plans
are built directly (the KV is filled with random values instead of a C-token prefill), and each
step is timed end to end (forward, LM head, token choice). Prefill: one prompt in chunks of
`--max-num-batched-tokens`. Cases whose KV does not fit the memory budget are skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from flint_sched.benchmarks.kernel_breakdown import format_breakdown, kernel_breakdown
from flint_sched.benchmarks.step_bytes import decode_step_bytes
from flint_sched.checkpoint.make import dummy_checkpoint, resolve_device
from flint_sched.config import preset
from flint_sched.core.plan import ScheduledRequest, StepPlan
from flint_sched.executor.cuda_executor import CudaExecutor
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.torch_executor import TorchExecutor
from flint_sched.quant.fp8 import KV_CACHE_DTYPES, kv_cache_dtype
from flint_sched.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class DecodeResult:
    batch: int
    context: int
    step_ms: float
    tokens_per_s: float
    bytes_per_step: float
    floor_ms: float
    achieved_gbps: float
    bandwidth_share: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="flint", help="preset (weights are made with --load-format dummy)")
    p.add_argument("--load-format", default="dummy", choices=("dummy",),
                   help="weights are seeded random ones made on the device (no checkpoint file)")
    p.add_argument("--weight-format", default="bf16", choices=("nvfp4", "bf16"))
    p.add_argument("--device", default="auto")
    p.add_argument("--executor", default="torch", choices=("torch", "cuda"),
                   help="cuda: our kernels (fused path for <= 6 decodes (BF16: 8), grouped above, from CUDA graphs)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,64,256")
    p.add_argument("--contexts", default="1024,32768,102400")
    p.add_argument("--prefill-lens", default="1024,8192,102400")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--mixed-chunks", default="",
                   help="prompt chunk sizes: each decode case is also timed with a chunk of that many prompt "
                        "rows beside its decodes, ending at the decodes' context (a chunked prefill's mixed step)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                   help="auto: the compute dtype; fp8: an e4m3 KV cache (quant/fp8.py)")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="memory for KV; default: free GPU memory minus 6 GiB (CPU: 4 GiB)")
    p.add_argument("--num-steps", type=int, default=20,
                   help="timed steps a decode case (their median), after WARMUP_SECONDS of untimed ones")
    p.add_argument("--max-case-seconds", type=float, default=60.0, help="skip the rest of a case past this")
    p.add_argument("--bandwidth-gbps", type=float, default=None, help="default: measured with a device copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="decode requests sample with this temperature (0: greedy, the token chosen on the GPU)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--host-profile", action="store_true",
                   help="after each prefill case, profile one chunk's host side (cProfile, by own time)")
    p.add_argument("--kernel-breakdown", action="store_true",
                   help="after each case, trace a few steps (decode) or one chunk (prefill) and print GPU "
                        "time per kernel")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure_bandwidth_gbps(device: torch.device) -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus written."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 10 * 2 * src.numel() * 2 / (time.perf_counter() - start) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_plan(batch: int, context: int, blocks_per_request: int, params: SamplingParams = GREEDY,
                fused_max_batch: int = 0) -> StepPlan:
    """B one-token decodes at position `context`; the path as the scheduler names it."""
    entries = [ScheduledRequest(f"r{b}", [b + 1], context, list(range(b * blocks_per_request, (b + 1) * blocks_per_request)),
                                b, True, params, [1], [], False) for b in range(batch)]
    return StepPlan(entries, batch, "fused" if batch <= fused_max_batch else "grouped", [], [])


def mixed_plan(batch: int, context: int, chunk: int, blocks_per_request: int, params: SamplingParams = GREEDY) -> StepPlan:
    """decode_plan's B decodes beside `chunk` rows of one prompt at positions context - chunk ..
    context - 1 (a middle chunk: nothing sampled), with its own ring slot (B) and blocks."""
    if not 1 <= chunk <= context:
        raise ValueError(f"a prompt chunk of {chunk} rows does not end at position {context}")
    decodes = decode_plan(batch, context, blocks_per_request, params).scheduled_requests
    first = batch * blocks_per_request
    table = list(range(first, first + blocks_per_request))
    prompt = ScheduledRequest("p", [7] * chunk, context - chunk, table, batch, False, GREEDY, [7], [], False)
    return StepPlan(decodes + [prompt], batch + chunk, "grouped", [], [])


def decode_cases(args, num_blocks: int, extra_seqs: int = 0) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """The decode cases of --contexts x --batch-sizes (contexts outer) as (batch, context, blocks per
    request) where the KV fits `num_blocks` beside `extra_seqs` more requests, and the (batch,
    context) pairs that do not."""
    cases, skipped = [], []
    for context in _ints(args.contexts):
        for batch in _ints(args.batch_sizes):
            blocks = math.ceil((context + 1) / args.block_size)
            if (batch + extra_seqs) * blocks > num_blocks:
                skipped.append((batch, context))
            else:
                cases.append((batch, context, blocks))
    return cases, skipped


def sampling_params(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=1)


WARMUP_SECONDS = 0.25   # untimed steps before a case's timed ones: the first after a case is built run slower


def _step_seconds(executor, args, plan: StepPlan) -> float:
    """Median wall time of the plan's step (after a first untimed one, which may capture its graphs,
    and WARMUP_SECONDS of untimed ones, at most 100), waited for each time."""
    executor.execute(plan)
    _sync(executor.device)
    warm_until = time.perf_counter() + WARMUP_SECONDS
    for _ in range(100):
        executor.execute(plan)
        _sync(executor.device)
        if time.perf_counter() > warm_until:
            break
    times, deadline = [], time.perf_counter() + args.max_case_seconds
    for _ in range(args.num_steps):
        _sync(executor.device)
        start = time.perf_counter()
        executor.execute(plan)
        _sync(executor.device)
        times.append(time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return statistics.median(times)


def run_decode(executor, args, batch: int, context: int, bandwidth: float) -> DecodeResult:
    plan = decode_plan(batch, context, math.ceil((context + 1) / args.block_size), sampling_params(args),
                       executor.limits.fused_max_batch)
    step = _step_seconds(executor, args, plan)
    nbytes = decode_step_bytes(executor.config, batch, context, args.weight_format,
                               executor.kv.full.element_size()).total
    return DecodeResult(batch, context, step * 1e3, batch / step, nbytes, nbytes / bandwidth / 1e6,
                        nbytes / step / 1e9, nbytes / step / 1e9 / bandwidth)


def _breakdown(executor, plan: StepPlan) -> list[tuple[str, float, float]]:
    """Kernel times of a few eager steps (graphs off: each kernel shows under its own name)."""
    graphs = getattr(executor, "use_graphs", None)
    if graphs is not None:
        executor.use_graphs = False
    try:
        return kernel_breakdown(lambda: executor.execute(plan))
    finally:
        if graphs is not None:
            executor.use_graphs = graphs


def _host_profile(step, pos: int, top: int = 30) -> None:
    """The host functions of one chunk (launched, not waited for), by their own time."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(step, pos)
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)


def _prefill_step(executor, args, length: int):
    """step(pos): the chunk of one `length`-token prompt that starts at pos, executed."""
    table = list(range(math.ceil(length / args.block_size)))

    def step(pos: int) -> None:
        n = min(args.max_num_batched_tokens, length - pos)
        entry = ScheduledRequest("p", [7] * n, pos, table, 0, pos + n == length, GREEDY, [7], [], False)
        executor.execute(StepPlan([entry], n, "grouped", [], []))

    return step


def run_prefill(executor, args, length: int) -> float | None:
    """Prompt tokens per second for one prompt of `length` tokens, or None past the time limit."""
    chunk = args.max_num_batched_tokens
    step = _prefill_step(executor, args, length)
    step(0)          # untimed: first-use costs (workspaces grown, kernels loaded, cuBLAS plans) of this size
    deadline = time.perf_counter() + args.max_case_seconds
    _sync(executor.device)
    start = time.perf_counter()
    for pos in range(0, length, chunk):
        step(pos)
        if time.perf_counter() > deadline:
            return None
    _sync(executor.device)
    return length / (time.perf_counter() - start)


def build(args: argparse.Namespace):
    """The executor over dummy weights with a KV pool sized for the largest case that fits; returns
    (executor, device, bandwidth GB/s, KV blocks)."""
    device = resolve_device(args.device)              # --device cuda without a GPU: ValueError at once
    if args.executor == "cuda":
        check_cuda_executor(device)
    config = preset(args.model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = args.bandwidth_gbps or measure_bandwidth_gbps(device)
    total, _ = config.parameter_counts()
    print(f"making {args.model}'s dummy {args.weight_format} weights ({total / 1e9:.1f}B parameters) on {device}...",
          flush=True)
    ckpt = dummy_checkpoint(config, args.weight_format, args.seed, device)
    batches, contexts, prefills = _ints(args.batch_sizes), _ints(args.contexts), _ints(args.prefill_lens)
    if not batches and not prefills:
        raise SystemExit("nothing to measure: give --batch-sizes (with --contexts) or --prefill-lens")
    max_seqs = max(batches, default=1) + bool(args.mixed_chunks)     # the mixed steps' prompt: one more slot
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)
    placeholder = KVCache(config, 1, args.block_size, 1, kv_dtype, device)
    if args.executor == "cuda":
        max_len = max(contexts + prefills) + 1
        executor = CudaExecutor(config, ckpt.weights, placeholder, ckpt.tokenizer.eos_token_ids, max_len, device,
                                args.seed)
    else:
        executor = TorchExecutor(config, ckpt.weights, placeholder, ckpt.tokenizer.eos_token_ids, dtype, device,
                                 args.seed)
    del ckpt                                   # the executor holds what it needs
    largest = max([(b + bool(args.mixed_chunks)) * math.ceil((c + 1) / args.block_size) for b in batches for c in contexts]
                  + [math.ceil(n / args.block_size) for n in prefills])
    budget = _budget(args, device)
    fit = int((budget - max_seqs * KVCache.bytes_per_slot(config, args.block_size, kv_dtype))
              // KVCache.bytes_per_block(config, args.block_size, kv_dtype))
    if fit < 1:
        raise SystemExit(f"no room for a KV cache: {budget / 2**30:.1f} GiB of the memory budget is left beside "
                         f"{args.model}'s {args.weight_format} weights (the GPU's free memory less 6 GiB, or "
                         f"--kv-budget-gib); try the nvfp4 weights or a GPU with more memory")
    num_blocks = min(largest, fit)
    kv = KVCache(config, num_blocks, args.block_size, max_seqs, kv_dtype, device)
    for pool in (kv.full, kv.ring):            # random keys (e4m3 has no normal_: made in 512 MB slices)
        if kv_dtype == dtype:
            pool.normal_()
            continue
        for part in pool.view(-1).split(1 << 28):
            part.copy_(torch.randn(part.numel(), dtype=dtype, device=device))
    executor.kv = kv                           # the sized cache replaces the placeholder
    return executor, device, bandwidth, num_blocks


def check_cuda_executor(device: torch.device) -> None:
    """--executor cuda needs a GPU and cuda-python: say so before minutes of making weights."""
    from flint_sched.engine.builder import kernel_runtime_available
    if device.type != "cuda":
        raise ValueError(f"--executor cuda needs a CUDA GPU, and the device is {device} (use --executor torch)")
    available, why = kernel_runtime_available()
    if not available:
        raise ValueError(f"--executor cuda needs cuda-python ({why}): pip install 'flint-sched[gpu]'")


def _gbps(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.0f} GB/s"


def run(args: argparse.Namespace) -> int:
    executor, device, bandwidth, num_blocks = build(args)
    prefills = _ints(args.prefill_lens)
    sampling = ("greedy" if args.temperature == 0 else
                f"sampled (temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k})")
    print(f"device {device}, {args.executor} executor, {args.weight_format} weights, KV pool {num_blocks} blocks of {args.block_size}, "
          f"bandwidth {_gbps(bandwidth)}{' (measured on GPUs only: no floors)' if math.isnan(bandwidth) else ''}, "
          f"{sampling} decode", flush=True)
    results, mixed = [], []
    cases, skipped = decode_cases(args, num_blocks, extra_seqs=bool(args.mixed_chunks))
    for batch, context, blocks in cases:
        r = run_decode(executor, args, batch, context, bandwidth)
        results.append(r)
        floor = "" if math.isnan(r.floor_ms) else (f" floor {r.floor_ms:7.3f} ms  {r.achieved_gbps:8.1f} GB/s "
                                                    f"({100 * r.bandwidth_share:5.1f} %)")
        print(f"decode B={batch:<4} C={context:<7} {r.step_ms:9.2f} ms/step {r.tokens_per_s:10.1f} tok/s{floor}",
              flush=True)
        if args.kernel_breakdown and device.type == "cuda":
            plan = decode_plan(batch, context, blocks, fused_max_batch=executor.limits.fused_max_batch)
            print(format_breakdown(_breakdown(executor, plan), r.step_ms), flush=True)
        for chunk in (min(c, context) for c in _ints(args.mixed_chunks)):
            plan = mixed_plan(batch, context, chunk, blocks, sampling_params(args))
            step_ms = 1e3 * _step_seconds(executor, args, plan)
            mixed.append({"batch": batch, "context": context, "chunk": chunk, "step_ms": step_ms})
            print(f"mixed  B={batch:<4} C={context:<7} + {chunk} prompt rows {step_ms:9.2f} ms/step "
                  f"({step_ms / r.step_ms:.1f}x the decode step)", flush=True)
            if args.kernel_breakdown and device.type == "cuda":
                print(format_breakdown(_breakdown(executor, plan), step_ms), flush=True)
    prefill = {}
    for length in prefills:
        fits = math.ceil(length / args.block_size) <= num_blocks
        prefill[length] = run_prefill(executor, args, length) if fits else None
        print(f"prefill {length:>7} tokens: " + (f"{prefill[length]:.0f} tok/s" if prefill[length] else
                                                 "skipped (KV or time limit)"), flush=True)
        if prefill[length] and (args.host_profile or (args.kernel_breakdown and device.type == "cuda")):
            step, chunk = _prefill_step(executor, args, length), min(length, args.max_num_batched_tokens)
            if args.host_profile:                  # the prompt's last chunk, as the breakdown
                _host_profile(step, length - chunk)
            if args.kernel_breakdown and device.type == "cuda":
                print(format_breakdown(kernel_breakdown(lambda: step(length - chunk), num_steps=1),
                                       1e3 * chunk / prefill[length]), flush=True)
    if skipped:
        print("skipped (KV does not fit): " + ", ".join(f"B={b} C={c}" for b, c in skipped))
    if args.output_json:
        settings = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
        report = {"args": settings, "bandwidth_gbps": bandwidth, "decode": [asdict(r) for r in results],
                  "mixed": mixed, "prefill_tokens_per_s": prefill, "skipped": skipped}
        with open(args.output_json, "w") as f:
            json.dump(_finite(report), f, indent=2)
    return 0


def _finite(value):
    """NaN (no bandwidth on a CPU) becomes null, so the file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _budget(args, device: torch.device) -> float:
    if args.kv_budget_gib is not None:
        return args.kv_budget_gib * 2**30
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] - 6 * 2**30
    return 4 * 2**30


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
