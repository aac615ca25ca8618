"""Registers, stack frame and spills of the CUDA kernels' builds, as ptxas reports them through NVRTC.

Needs no GPU: what a build costs in registers and whether it spills can be read on the CPU machine
before a device run (spills in the one-launch decode MoE showed up here first, session 20).

    python3 -m flint_sched.benchmarks.kernel_resources                 # every source, its compile-test builds
    python3 -m flint_sched.benchmarks.kernel_resources --source decode_attention.cu --defines KV_FP8=1,ATTN_CP_ASYNC=1
    python3 -m flint_sched.benchmarks.kernel_resources --decode-configs g2w8t4p g2w8t4   # expert_decode.CONFIGS
"""

from __future__ import annotations

import argparse

from flint_sched.kernels import VARIANTS, _runtime, expert_decode


def parse_defines(text: str) -> dict[str, object]:
    """'A=1,B' -> {'A': '1', 'B': None}."""
    defines: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        defines[name.strip()] = value.strip() if eq else None
    return defines


def builds(sources: list[str], defines: list[str], decode_configs: list[str]) -> list[tuple[str, str, dict]]:
    """(source, label, defines) of each build to report."""
    out = [("expert_decode.cu", config, dict(expert_decode.CONFIGS[config])) for config in decode_configs]
    for source in sources:
        sets = [parse_defines(d) for d in defines] or list(VARIANTS.get(source, ({},)))
        out += [(source, ",".join(f"{k}={v}" if v is not None else k for k, v in d.items()) or "-", d) for d in sets]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", default=[], help="a .cu file of cuda/ (repeatable; default: all, "
                        "unless --decode-configs is given)")
    parser.add_argument("--defines", action="append", default=[], metavar="A=1,B=2",
                        help="a build's defines (repeatable; default: the source's compile-test builds)")
    parser.add_argument("--decode-configs", nargs="+", default=[], choices=sorted(expert_decode.CONFIGS),
                        help="also expert_decode.cu built with these configs")
    args = parser.parse_args()
    available, why = _runtime.nvrtc_available()
    if not available:
        raise SystemExit(f"NVRTC cannot be imported: {why}")
    sources = args.source or ([] if args.decode_configs else sorted(p.name for p in _runtime.source_dir().glob("*.cu")))
    print(f"| {'source':<28} | {'build':<40} | {'entry point':<36} | regs | stack | spill st / ld |")
    print(f"|{'-' * 30}|{'-' * 42}|{'-' * 38}|------|-------|---------------|")
    for source, label, defines in builds(sources, args.defines, args.decode_configs):
        for entry, use in sorted(_runtime.resource_usage(source, defines).items()):
            spill = f"{use.spill_store_bytes} / {use.spill_load_bytes}"
            mark = " !" if use.spill_store_bytes or use.spill_load_bytes else ""
            print(f"| {source:<28} | {label[:40]:<40} | {entry[:36]:<36} | {use.registers:>4} | {use.stack_bytes:>5} "
                  f"| {spill + mark:>13} |", flush=True)


if __name__ == "__main__":
    main()
