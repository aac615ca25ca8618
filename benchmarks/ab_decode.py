"""Decode steps of the full model under variants of module constants, over one model build: each
variant sets its constants, the graphs are captured again, `bench latency`'s decode cases run;
the whole list runs `--rounds` times, interleaved, so drift shows. Run on the GPU machine:

    python3 benchmarks/ab_decode.py --batch-sizes 64,256 --contexts 1024 \
        --variant base: --variant ctas6:flint_sched.kernels.attention.CTAS_PER_SM=6

With --kernel-breakdown, each variant's first round also prints GPU time per kernel (eager steps);
with --mixed-chunks, each decode case is also timed beside a prompt chunk of that many rows; with
--prefill-lens, each variant also reads one prompt of each length (prompt tokens per second).

A variant is NAME:ASSIGNMENTS, assignments comma-separated `module.ATTR=value` (value a Python
literal, commas inside its brackets allowed); constants not named keep the value they had before the script changed any.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flint_sched.benchmarks import latency  # noqa: E402
from flint_sched.kernels.attention import attention_workspace  # noqa: E402


def top_level_split(text: str, sep: str = ",") -> list[str]:
    """text split at the separators outside brackets (a value may be a dict or a tuple)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def parse_variant(text: str) -> tuple[str, list[tuple[object, str, object]]]:
    name, _, body = text.partition(":")
    if not name:
        raise ValueError(f"variant {text!r}: NAME:module.ATTR=value,...")
    sets = []
    for assignment in filter(None, top_level_split(body)):
        target, eq, value = assignment.partition("=")
        module_name, _, attr = target.rpartition(".")
        if not eq or not module_name:
            raise ValueError(f"variant {name}: {assignment!r} is not module.ATTR=value")
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise ValueError(f"variant {name}: {module_name} has no {attr}")
        sets.append((module, attr, value_of(value)))
    return name, sets


def set_constants(assignments: str, what: str) -> list[tuple[object, str, object]]:
    """Sets `module.ATTR=value,...` (a variant's body) now, for a whole run; a bad one exits with a
    message naming `what` (the option or script)."""
    try:
        _, sets = parse_variant(f"set:{assignments}")
    except (ValueError, ImportError) as e:
        raise SystemExit(f"{what}: {e}") from None
    for module, attr, value in sets:
        setattr(module, attr, value)
    return sets


def value_of(text: str) -> object:
    """A Python literal, where `torch.NAME` may stand for a torch attribute (a dtype: `(torch.bfloat16,)`)."""
    def convert(node: ast.expr) -> object:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            return getattr(torch, node.attr)
        if isinstance(node, (ast.Tuple, ast.List)):
            items = [convert(e) for e in node.elts]
            return tuple(items) if isinstance(node, ast.Tuple) else items
        return ast.literal_eval(node)
    try:
        return convert(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, AttributeError) as e:
        raise ValueError(f"value {text!r}: {e}") from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    latency.add_arguments(p)
    p.add_argument("--variant", action="append", required=True, help="NAME:module.ATTR=value,... (repeatable)")
    p.add_argument("--rounds", type=int, default=2)
    p.set_defaults(executor="cuda", device="cuda", prefill_lens="", weight_format="nvfp4")
    args = p.parse_args()
    try:
        variants = [parse_variant(v) for v in args.variant]
        executor, _, bandwidth, num_blocks = latency.build(args)
    except ValueError as e:
        raise SystemExit(f"ab_decode: {e}") from None
    original = {(m, a): getattr(m, a) for _, sets in variants for m, a, _ in sets}
    print("| variant | batch | context | ms/step (each round) |")
    print("|---|---|---|---|")
    results: dict[tuple[str, int | str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for name, sets in variants:
            for (module, attr), value in original.items():
                setattr(module, attr, value)
            for module, attr, value in sets:
                setattr(module, attr, value)
            if hasattr(executor, "clear_graphs"):      # the CUDA executor (the torch one keeps no graphs)
                executor.clear_graphs()
                # sized from module constants (CTAS_PER_SM): made again for this variant
                ws = executor.ws
                ws.attention = attention_workspace(ws.hidden.device, ws.max_rows, executor.config.num_key_value_heads)
            for batch, context, blocks in latency.decode_cases(args, num_blocks, bool(args.mixed_chunks))[0]:
                r = latency.run_decode(executor, args, batch, context, bandwidth)
                results.setdefault((name, batch, context), []).append(r.step_ms)
                if args.kernel_breakdown and round_ == 0:
                    plan = latency.decode_plan(batch, context, blocks, fused_max_batch=executor.limits.fused_max_batch)
                    print(f"{name}, batch {batch}, context {context}:\n"
                          + latency.format_breakdown(latency._breakdown(executor, plan), r.step_ms), flush=True)
                for chunk in (min(c, context) for c in latency._ints(args.mixed_chunks)):
                    plan = latency.mixed_plan(batch, context, chunk, blocks, latency.sampling_params(args))
                    step_ms = 1e3 * latency._step_seconds(executor, args, plan)
                    results.setdefault((name, f"{batch} + {chunk} prompt rows", context), []).append(step_ms)
            for length in latency._ints(args.prefill_lens):
                if -(-length // args.block_size) <= num_blocks:
                    tokens_per_s = latency.run_prefill(executor, args, length)
                    results.setdefault((name, "a prompt (tok/s, not ms)", length), []).append(tokens_per_s or 0.0)
    for (name, batch, context), times in results.items():
        print(f"| {name} | {batch} | {context} | {' / '.join(f'{t:.2f}' for t in times)} |")
    for (module, attr), value in original.items():
        setattr(module, attr, value)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
