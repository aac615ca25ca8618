"""Write and load the full-size NVFP4 GGUF, timing each and recording peak host memory.

    python benchmarks/bench_checkpoint.py write /path/flint.gguf   # generate + quantize on the GPU
    python benchmarks/bench_checkpoint.py load  /path/flint.gguf   # load + repack to the GPU, then a
                                                                  # bf16 reference forward of a prompt
Each step runs in its own process so that its peak resident memory is its own.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from flint_sched.checkpoint.gguf_io import read_gguf
from flint_sched.checkpoint.make import make_checkpoint
from flint_sched.config import preset
from flint_sched.model.reference import FlintReference


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write(path: str, preset_name: str, seed: int) -> None:
    start = time.perf_counter()
    make_checkpoint(preset(preset_name), "gguf-nvfp4", seed, path, device="cuda")
    seconds = time.perf_counter() - start
    size = os.path.getsize(path) / 1e9
    print(f"write: {size:.2f} GB in {seconds:.1f} s ({size / seconds:.2f} GB/s), "
          f"peak RSS {peak_rss_gib():.2f} GiB")


def load(path: str, prompt: str) -> None:
    start = time.perf_counter()
    ckpt = read_gguf(path, "cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    size = os.path.getsize(path) / 1e9
    print(f"load: {size:.2f} GB in {seconds:.1f} s ({size / seconds:.2f} GB/s), peak RSS "
          f"{peak_rss_gib():.2f} GiB, GPU weights {ckpt.nbytes / 1e9:.2f} GB, "
          f"GPU peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
    ids = ckpt.tokenizer.encode(prompt)
    start = time.perf_counter()
    logits = FlintReference(ckpt.config, ckpt.weights, dtype=torch.bfloat16).forward(ids)
    torch.cuda.synchronize()
    top = logits[-1].topk(5)
    print(f"reference bf16 forward of {len(ids)} tokens: {time.perf_counter() - start:.1f} s, "
          f"finite={bool(torch.isfinite(logits).all())}, logits std {logits.std():.3f}, "
          f"top-5 ids {top.indices.tolist()}")
    assert torch.isfinite(logits).all()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("step", choices=("write", "load"))
    p.add_argument("path")
    p.add_argument("--preset", default="flint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    args = p.parse_args()
    if args.step == "write":
        write(args.path, args.preset, args.seed)
    else:
        load(args.path, args.prompt)


if __name__ == "__main__":
    main()
