"""What each kernel class costs a CUDA-executor decode step: the step time with that class left out.

With programmatic dependent launch the kernels of a step overlap, so the per-kernel durations of
`bench latency --kernel-breakdown` do not add up to the step. Here the step is re-captured with one
class of launches removed (its outputs keep whatever they held: the result is not a forward pass,
only a timing) and the difference to the full step is that class's share of the critical path.
"none" removes every kernel but the embedding lookup: the host, the input copy and the graph launch.
First, from a trace of the full step, each kernel's charge: how far it moves the step's end
(kernel_breakdown.critical_path), which needs no re-capture but sees only what the trace sees.

`--classes` picks the classes to leave out; `--timeline 20,21` prints those layers' kernels on a
time line (start, end, overlap with the kernel before), which shows what PDL overlaps and what waits.

Run on the GPU machine:
    python3 -m flint_sched.benchmarks.critical_path --weight-format nvfp4 --batch-sizes 1,8 --contexts 1024
    python3 -m flint_sched.benchmarks.critical_path --executor cuda --batch-sizes 16 --no-ablation --timeline 20
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import types
from contextlib import contextmanager

import torch

from flint_sched.benchmarks import latency
from flint_sched.benchmarks.ab_decode import set_constants
from flint_sched.benchmarks.kernel_breakdown import critical_path, format_breakdown, layer_timeline
from flint_sched.executor import graphs as step_graphs
from flint_sched.executor import kernel_ops as ko
from flint_sched.kernels import attention, grouped_moe
from flint_sched.quant.nvfp4 import NVFP4Tensor

# rmsnorm, router, moe_gate_up and moe_down are the fused path's launches (batches of at most 8);
# moe_grouped (router logits, routing, expert GEMMs and finalize) and expert_gemms (the decode
# expert GEMMs alone), router_logits (its router GEMM) and moe_finalize (the weighted sum with the
# next layer's norm) the grouped path's; the rest both paths'.
CLASSES = ("rmsnorm", "qkv", "qk_norm_rope_kv", "attention", "o_proj", "router", "moe_gate_up", "moe_down",
           "dense_mlp", "lm_head+argmax", "moe_grouped", "expert_gemms", "router_logits", "moe_finalize")


def _key(w) -> int:
    return (w.codes if isinstance(w, NVFP4Tensor) else w).data_ptr()


def _linear_class(executor) -> dict[int, str]:
    kinds = {}
    for name, w in executor.w.items():
        if name.endswith("o_proj.weight"):
            kinds[_key(w)] = "o_proj"
        elif name.endswith("mlp.down_proj.weight"):
            kinds[_key(w)] = "dense_mlp"
        elif name == "lm_head.weight":
            kinds[_key(w)] = "lm_head+argmax"
    for fused, _ in executor.weights.qkv.values():
        kinds[_key(fused)] = "qkv"
    return kinds


@contextmanager
def without(executor, removed: set[str]):
    """Patch executor/kernel_ops.py (and grouped_moe's decode GEMMs) so that launches of the removed
    classes do nothing."""
    kinds = _linear_class(executor)
    real = {name: getattr(ko, name) for name in ("rms_norm", "linear", "gate_up_silu", "route", "moe_gate_up",
                                                 "moe_down", "greedy", "attn", "moe_grouped")}
    real_gemms = grouped_moe._decode_gemms
    real_moe = {name: getattr(grouped_moe, name) for name in ("linear", "grouped_linear", "moe_finalize")}

    def keep(kind, fn, result):
        return fn if kind not in removed else (lambda *a, **k: result(*a, **k))

    def linear(x, w, **k):
        return k["out"] if kinds[_key(w)] in removed else real["linear"](x, w, **k)

    attn = types.SimpleNamespace(**{n: getattr(real["attn"], n) for n in dir(real["attn"]) if not n.startswith("_")})
    for n in ("qk_norm_rope_kv_sliding", "qk_norm_rope_kv_full"):
        setattr(attn, n, keep("qk_norm_rope_kv", getattr(attn, n), lambda *a, **k: k["q_out"]))
    for n in ("decode_attention_sliding", "decode_attention_full"):
        setattr(attn, n, keep("attention", getattr(attn, n), lambda *a, **k: k["out"]))
    patched = {
        "rms_norm": keep("rmsnorm", real["rms_norm"], lambda *a, **k: k["out"]),
        "linear": linear,
        "gate_up_silu": keep("dense_mlp", real["gate_up_silu"], lambda *a, **k: k["out"]),
        "route": keep("router", real["route"], lambda x, gate, bias, top_k, *a, **k: (
            torch.zeros(x.shape[0], top_k, dtype=torch.int32, device=x.device),
            torch.zeros(x.shape[0], top_k, dtype=torch.float32, device=x.device))),
        "moe_gate_up": keep("moe_gate_up", real["moe_gate_up"], lambda *a, **k: k["out"]),
        "moe_down": keep("moe_down", real["moe_down"], lambda *a, **k: k["out"]),
        "greedy": keep("lm_head+argmax", real["greedy"], lambda *a, **k: k["out"]),
        "attn": attn,
        "moe_grouped": keep("moe_grouped", real["moe_grouped"], lambda *a, **k: k["out"])}
    for name, fn in patched.items():
        setattr(ko, name, fn)
    # (x, routing, queue, config, six weights, h_out, y_out, pdl) -> y_out, nothing launched
    grouped_moe._decode_gemms = keep("expert_gemms", real_gemms, lambda *a: a[11])
    for name in ("linear", "grouped_linear"):   # moe_grouped's router logits
        setattr(grouped_moe, name, keep("router_logits", real_moe[name], lambda *a, **k: k["out"]))
    grouped_moe.moe_finalize = keep("moe_finalize", real_moe["moe_finalize"],
                                    lambda y, routing, residual, **k: residual if k["out"] is None else k["out"])
    executor.clear_graphs()
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(ko, name, fn)
        grouped_moe._decode_gemms = real_gemms
        for name, fn in real_moe.items():
            setattr(grouped_moe, name, fn)
        executor.clear_graphs()


def segments_text(executor) -> str:
    return " ".join(f"{first}-{last - 1}" for first, last in executor.graphs.segments)


def host_times(executor, plan, steps: int = 50) -> str:
    """Median µs of the step's host parts: input fill, graph launch call, wait for the GPU, the
    GPU's own time between events recorded around the launch, and the whole step."""
    b = len(plan.scheduled_requests)
    executor.execute(plan)                       # captures the graphs of this batch if needed
    graphs = executor.graphs.graphs[executor.graphs.last_key]
    rows = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        executor.inputs.fill(plan.scheduled_requests)
        t1 = time.perf_counter()
        start.record()
        for graph in graphs:
            graph.replay()
        end.record()
        t2 = time.perf_counter()
        executor.ws.next_tokens[:b].tolist()
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, start.elapsed_time(end) / 1e3, t3 - t0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        for graph in graphs:
            graph.replay()
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - t0) / steps
    names = ("fill", "launch", "wait", "GPU (events)", "step")
    return (", ".join(f"{n} {1e6 * statistics.median(r[i] for r in rows):.1f} µs" for i, n in enumerate(names))
            + f"; replays back to back {1e6 * back_to_back:.1f} µs each")


def layer_marker() -> str:
    """The kernel launched once a layer that starts a time line: the Q/K norm's, wherever it runs."""
    return "decode_attention_qk" if ko.FUSE_QK_ATTENTION else "qk_norm_rope_kv"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    latency.add_arguments(parser)
    parser.set_defaults(executor="cuda", batch_sizes="1,8", contexts="1024", prefill_lens="", num_steps=60)
    parser.add_argument("--no-ablation", action="store_true", help="only the traced critical path")
    parser.add_argument("--classes", default=",".join(CLASSES),
                        help=f"comma-separated classes to leave out one at a time (default: all: "
                             f"{', '.join(CLASSES)})")
    parser.add_argument("--timeline", default="", metavar="LAYERS",
                        help="print these layers' kernels on a time line (each from its Q/K norm launch to the next)")
    parser.add_argument("--first-graph-layers", default="",
                        help="also time the step with these first-graph sizes (executor.graph_segments; 0: one graph)")
    parser.add_argument("--min-split-keys", default="",
                        help="also time the step with each of these attention MIN_SPLIT_KEYS (e.g. 64,128,256)")
    parser.add_argument("--set", default="", metavar="ASSIGNMENTS",
                        help="module constants set first, as an ab_decode.py variant's body "
                             "(e.g. flint_sched.executor.kernel_ops.FOLD_NORMS=True)")
    args = parser.parse_args()
    if args.set:
        set_constants(args.set, "--set")
    classes = [c for c in args.classes.split(",") if c]
    if unknown := set(classes) - set(CLASSES):
        parser.error(f"unknown classes {sorted(unknown)}; choose from {', '.join(CLASSES)}")
    executor, _, bandwidth, _ = latency.build(args)
    # Without the router, the MoE kernels read the experts the last full step chose.
    print(f"{args.weight_format}, bandwidth {bandwidth:.0f} GB/s; ms per step, and what removing each class saves")
    for context in latency._ints(args.contexts):
        for batch in latency._ints(args.batch_sizes):
            full = latency.run_decode(executor, args, batch, context, bandwidth).step_ms
            print(f"B={batch} C={context}: full step {full:.3f} ms", flush=True)
            plan = latency.decode_plan(batch, context, math.ceil((context + 1) / args.block_size),
                                       fused_max_batch=executor.limits.fused_max_batch)
            print("  charged to each kernel: how far it moves the step's end (graph replay, traced)")
            print(format_breakdown(critical_path(lambda plan=plan: executor.execute(plan)), full, top=20), flush=True)
            print("  host: " + host_times(executor, plan), flush=True)
            for layer in latency._ints(args.timeline):
                print(layer_timeline(lambda plan=plan: executor.execute(plan), layer_marker(), layer), flush=True)
            for layers in latency._ints(args.first_graph_layers):
                default = executor.graphs.segments
                executor.graphs.segments = step_graphs.graph_segments(executor.config.num_hidden_layers, layers)
                executor.clear_graphs()
                step = latency.run_decode(executor, args, batch, context, bandwidth).step_ms
                print(f"  graphs {segments_text(executor)}: {step:7.3f} ms; host: {host_times(executor, plan)}",
                      flush=True)
                executor.graphs.segments = default
                executor.clear_graphs()
            for keys in latency._ints(args.min_split_keys):
                default, attention.MIN_SPLIT_KEYS = attention.MIN_SPLIT_KEYS, keys
                executor.clear_graphs()
                step = latency.run_decode(executor, args, batch, context, bandwidth).step_ms
                attention.MIN_SPLIT_KEYS = default
                executor.clear_graphs()
                print(f"  attention MIN_SPLIT_KEYS {keys:4d}: {step:7.3f} ms", flush=True)
            if args.no_ablation:
                continue
            for kind in (*classes, "none"):
                with without(executor, set(CLASSES) if kind == "none" else {kind}):
                    step = latency.run_decode(executor, args, batch, context, bandwidth).step_ms
                print(f"  without {kind:<16} {step:7.3f} ms  saves {full - step:6.3f} ms "
                      f"({100 * (full - step) / full:4.1f} %)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
