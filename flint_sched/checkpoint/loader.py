"""One entry point for every way to get weights: a GGUF file, an HF directory, a preset, or dummy."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch

from flint_sched.checkpoint.common import Checkpoint, CheckpointError
from flint_sched.checkpoint.gguf_io import read_gguf
from flint_sched.checkpoint.hf_io import read_hf
from flint_sched.checkpoint.make import default_checkpoint_path, dummy_checkpoint, resolve_device
from flint_sched.checkpoint.gguf_config import config_from_gguf_fields, gguf_fields
from flint_sched.config import PRESETS, FlintConfig, load_hf_config, preset
from flint_sched.tokenizer import FlintTokenizer

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


def load_checkpoint(model: str | Path | None = None, load_format: str = "auto",
                    device: str | torch.device | None = None,
                    hf_config_path: str | Path | None = None, tokenizer: str | Path | None = None,
                    weight_format: str = "nvfp4", seed: int = 0, progress: bool = True) -> Checkpoint:
    """Load `model`: a .gguf file, a Hugging Face directory, or a preset name.

    A preset loads its generated checkpoint from the cache (made on first use); with
    `load_format="dummy"` the weights are made on the device instead (`weight_format` nvfp4 or bf16),
    and `model` may also be a config.json.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    dev = resolve_device(device)
    model = str(model) if model is not None else "flint-tiny"
    if load_format == "dummy":
        config = load_hf_config(hf_config_path or model) if model not in PRESETS else preset(model)
        tok = FlintTokenizer.from_file(tokenizer) if tokenizer else None
        return dummy_checkpoint(config, weight_format, seed, dev, tok)
    path = default_checkpoint_path(model, seed=seed, progress=progress) if model in PRESETS else Path(model)
    is_gguf = path.suffix == ".gguf" or (path.is_file() and _has_gguf_magic(path))
    if load_format == "gguf" or (load_format == "auto" and is_gguf):
        return read_gguf(path, dev, hf_config_path, tokenizer, progress)
    if path.is_dir():
        return read_hf(path, dev, hf_config_path, tokenizer, progress)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory, and not a preset ({', '.join(PRESETS)})")
    raise CheckpointError(f"{path}: neither a GGUF file nor a Hugging Face checkpoint directory")


def peek_config(model: str | Path | None, load_format: str = "auto",
                hf_config_path: str | Path | None = None) -> FlintConfig:
    """The config `load_checkpoint` would use, read without loading (or generating) any weights."""
    model = str(model) if model is not None else "flint-tiny"
    if hf_config_path is not None:
        return load_hf_config(hf_config_path)
    if model in PRESETS:
        return preset(model)
    path = Path(model)
    if load_format == "dummy" or path.name == "config.json":
        return load_hf_config(path)
    if path.is_file() and (path.suffix == ".gguf" or _has_gguf_magic(path)):
        try:
            return config_from_gguf_fields(gguf_fields(gguf.GGUFReader(path)))
        except Exception as e:  # the gguf package raises many kinds on a damaged file
            raise CheckpointError(f"{path}: cannot read its metadata ({type(e).__name__}: {e})") from None
    if path.is_dir():
        return load_hf_config(path)
    raise CheckpointError(f"{path}: no such file or directory, and not a preset ({', '.join(PRESETS)})")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
