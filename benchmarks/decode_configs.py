"""Decode steps of the full model on each config of the decode expert GEMMs (cuda/expert_decode.cu),
over one model build: `bench latency`'s decode cases, the graphs captured again per config.

The kernel benchmark (bench_grouped.py) routes with its own random router, which touches fewer
experts than the model's at the same token count; this one times what serving runs.
Run on the GPU machine:

    python3 benchmarks/decode_configs.py --weight-format nvfp4 --batch-sizes 9,16,32,64,256 \
        --contexts 1024 --configs g1t1,g1t2,g1t4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flint_sched.benchmarks import latency  # noqa: E402
from flint_sched.kernels import expert_decode  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    latency.add_arguments(p)
    p.add_argument("--configs", default=",".join(expert_decode.CONFIGS),
                   help="expert_decode.CONFIGS keys, comma-separated (default: all)")
    p.set_defaults(executor="cuda", device="cuda", prefill_lens="", weight_format="nvfp4")
    args = p.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in expert_decode.CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {sorted(expert_decode.CONFIGS)}")
    try:
        executor, _, bandwidth, num_blocks = latency.build(args)
    except ValueError as e:                 # no GPU here, or the executor cannot run
        raise SystemExit(f"decode_configs: {e}") from None
    print("| config | batch | context | ms/step | tok/s |")
    print("|---|---|---|---|---|")
    for config in configs:
        expert_decode.CONFIG = config
        executor.clear_graphs()      # captured again, on this config's kernels
        for batch, context, _ in latency.decode_cases(args, num_blocks)[0]:
            r = latency.run_decode(executor, args, batch, context, bandwidth)
            print(f"| {config} | {batch} | {context} | {r.step_ms:.2f} | {r.tokens_per_s:.0f} |", flush=True)
    expert_decode.CONFIG = None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
