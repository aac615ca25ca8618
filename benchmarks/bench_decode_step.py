"""Where the persistent decode step's time goes (kernel_ops.PERSISTENT, cuda/decode_step.cu), by
operation, from the kernel's own global-timer stamps (kernels/decode_step.py TRACE): the full model
over dummy weights, eager fused decode steps (one launch a graph segment's layers), each layer's
operations charged with

    hop   from the end of the operation before to the moment its last task saw it done
    work  from then to its last task done

averaged over the layers that have the operation, per batch size; then the step's own time with
the launches (graphs, PERSISTENT off) and with the persistent step (graphs, on), as bench latency
measures it. Run on the GPU machine:

    python3 benchmarks/bench_decode_step.py --weight-format nvfp4 --batch-sizes 1,8 --contexts 1024 \
        --variants 8,8-fold-fuse,4,4-fold-fuse

A variant names the CTA's warps (decode_step.WARPS), then `-fold` (FOLD_NORMS), `-fuse`
(FUSE_QK), `-early` (EARLY_WEIGHTS) and `-sN` (decode_step.SMS: the CTAs on N SMs only, a probe of
how much of an operation's work is its tiles run one after another); all over one model build.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flint_sched.benchmarks import latency  # noqa: E402
from flint_sched.executor import kernel_ops  # noqa: E402
from flint_sched.kernels import decode_step  # noqa: E402


def charges(steps) -> tuple[dict[str, tuple[float, float, int]], float]:
    """op -> (mean hop µs, mean work µs, layers) over the traced DecodeSteps (graph segments), and
    the segments' total span (µs from each one's first stamp to its last task done)."""
    hops: dict[str, list[float]] = {}
    works: dict[str, list[float]] = {}
    span = 0.0
    for step in steps:
        phases = step.phase_times()
        previous_end = 0.0
        for p in phases:
            hops.setdefault(p["op"], []).append(max(0.0, p["ready"] - previous_end))
            works.setdefault(p["op"], []).append(p["end"] - p["ready"])
            previous_end = p["end"]
        span += phases[-1]["end"]
    return {op: (statistics.mean(hops[op]), statistics.mean(works[op]), len(hops[op])) for op in hops}, span


def parse_variant(text: str) -> tuple[int, bool, bool, bool, int | None]:
    """WARPS[-fold][-fuse][-early][-sN] -> (warps, fold_norms, fuse_qk, early_weights, SMs or None)."""
    warps, *flags = text.split("-")
    sms = [f for f in flags if f[:1] == "s" and f[1:].isdigit() and int(f[1:]) > 0]
    if warps not in ("4", "8") or not set(flags) - set(sms) <= {"fold", "fuse", "early"} or len(sms) > 1:
        raise SystemExit(f"bench_decode_step: variant {text!r} is not WARPS[-fold][-fuse][-early][-sN], WARPS 4 or 8")
    return int(warps), "fold" in flags, "fuse" in flags, "early" in flags, int(sms[0][1:]) if sms else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    latency.add_arguments(p)
    p.add_argument("--variants", default="8", help="comma-separated: WARPS[-fold][-fuse][-early][-sN] (see above)")
    p.set_defaults(executor="cuda", device="cuda", prefill_lens="", weight_format="nvfp4", batch_sizes="1,8",
                   contexts="1024", num_steps=20)
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variants.split(",") if v]
    executor, _, bandwidth, num_blocks = latency.build(args)
    for batch, context, blocks in latency.decode_cases(args, num_blocks)[0]:
        if batch > executor.limits.fused_max_batch:
            print(f"batch {batch}: past the fused path ({executor.limits.fused_max_batch}), skipped")
            continue
        plan = latency.decode_plan(batch, context, blocks, fused_max_batch=executor.limits.fused_max_batch)
        kernel_ops.PERSISTENT = False
        executor.clear_graphs()
        r = latency.run_decode(executor, args, batch, context, bandwidth)
        print(f"\nbatch {batch}, context {context}: launches {r.step_ms:.3f} ms a step (graphs)")
        for name, (warps, fold, fuse, early, sms) in zip(args.variants.split(","), variants, strict=True):
            decode_step.WARPS, decode_step.FOLD_NORMS, decode_step.FUSE_QK = warps, fold, fuse
            decode_step.EARLY_WEIGHTS, decode_step.SMS = early, sms
            kernel_ops.PERSISTENT, decode_step.TRACE = True, True
            executor.use_graphs = False
            executor.ws.decode_steps.clear()
            for _ in range(3):                       # the last one's stamps are read
                executor.execute(plan)
            steps = [step for step in executor.ws.decode_steps.values() if step]
            if not steps:
                raise SystemExit("the persistent step does not take this model (decode_step.supported)")
            table, span = charges(steps)
            decode_step.TRACE = False
            executor.use_graphs = True
            executor.ws.decode_steps.clear()
            executor.clear_graphs()
            r = latency.run_decode(executor, args, batch, context, bandwidth)
            print(f"\nbatch {batch}, context {context}, persistent {name}: {r.step_ms:.3f} ms a step (graphs); "
                  f"the layers {span:.0f} µs (eager, traced)")
            print("| operation | layers | hop µs | work µs | hop + work, all layers µs |")
            print("|---|---|---|---|---|")
            for op, (hop, work, n) in table.items():
                print(f"| {op} | {n} | {hop:.2f} | {work:.2f} | {n * (hop + work):.0f} |")
    kernel_ops.PERSISTENT, decode_step.SMS = False, None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
