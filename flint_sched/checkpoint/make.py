"""Generated checkpoints: seeded random weights written as NVFP4 GGUF or BF16 Hugging Face layout,
or made directly on the device (`dummy`), and the embedded default model kept in the cache.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from flint_sched.checkpoint.common import Checkpoint
from flint_sched.checkpoint.gguf_io import write_gguf
from flint_sched.checkpoint.hf_io import write_hf
from flint_sched.checkpoint.random_init import random_tensor
from flint_sched.config import FlintConfig, preset
from flint_sched.envs import cache_dir
from flint_sched.model.weights import check_nvfp4_shapes, tensor_specs
from flint_sched.quant.nvfp4 import quantize
from flint_sched.tokenizer import FlintTokenizer, build_tokenizer

FORMATS = ("gguf-nvfp4", "hf-bf16")
WEIGHT_FORMATS = ("nvfp4", "bf16")
DEFAULT_MODEL = "flint-tiny"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """auto: the GPU when torch sees one, else the CPU; asking for cuda without a GPU fails at once."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {str(device)!r}; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"--device {device}: no CUDA GPU is visible (torch {torch.__version__} is {build}); "
                         "use --device cpu, or install a CUDA build of torch on a GPU machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported; use cpu, cuda or auto")
    return dev


def make_checkpoint(config: FlintConfig, fmt: str, seed: int, out: str | Path,
                    device: str | torch.device | None = None, progress: bool = True,
                    tokenizer: FlintTokenizer | None = None) -> Path:
    """Write a seeded random checkpoint; returns the GGUF file or the HF directory."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose one of {', '.join(FORMATS)}")
    dev = resolve_device(device)
    tokenizer = tokenizer or build_tokenizer(config.vocab_size, seed)
    out = Path(out)

    def make_tensor(spec):
        return random_tensor(spec, config, seed, dev)

    if fmt == "gguf-nvfp4":
        if out.is_dir():
            out = out / "model.gguf"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(out, config, tokenizer, make_tensor, progress)
    else:
        write_hf(out, config, tokenizer, make_tensor, progress)
    return out


def dummy_checkpoint(config: FlintConfig, weight_format: str = "nvfp4", seed: int = 0,
                     device: str | torch.device | None = None,
                     tokenizer: FlintTokenizer | None = None) -> Checkpoint:
    """Random weights made on the device in their final form, with no file (for benchmarks)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if weight_format == "nvfp4":
        check_nvfp4_shapes(config)
    dev = resolve_device(device)
    weights = {}
    for spec in tensor_specs(config):
        values = random_tensor(spec, config, seed, dev)
        if weight_format == "nvfp4" and spec.quantized:
            weights[spec.name] = quantize(values, per_leading_scale=spec.stacked_experts)
        else:
            weights[spec.name] = values if spec.fp32 else values.to(torch.bfloat16)
        del values
    tokenizer = tokenizer or build_tokenizer(config.vocab_size, seed)
    return Checkpoint(config, tokenizer, weights, weight_format, "dummy")


def default_checkpoint_location(name: str = DEFAULT_MODEL, fmt: str = "hf-bf16", seed: int = 0) -> Path:
    """Where default_checkpoint_path keeps a preset's generated checkpoint (it may not exist yet)."""
    digest = hashlib.sha256(repr(preset(name)).encode()).hexdigest()[:8]
    suffix = ".gguf" if fmt == "gguf-nvfp4" else ""
    return cache_dir() / f"{name}-{digest}-seed{seed}-{fmt}{suffix}"


def default_checkpoint_path(name: str = DEFAULT_MODEL, fmt: str = "hf-bf16", seed: int = 0,
                            progress: bool = True) -> Path:
    """The generated checkpoint of a preset in the cache, made once (atomically) on first use. The
    name carries a digest of the preset's config, so a changed preset is made anew."""
    path = default_checkpoint_location(name, fmt, seed)
    if path.exists():
        return path
    config = preset(name)
    tmp = path.with_name(path.name + ".partial")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    made = make_checkpoint(config, fmt, seed, tmp, device="cpu", progress=progress)
    made.rename(path)
    return path
