"""The BF16 checkpoint in Hugging Face layout: config.json, tokenizer files, safetensors shards.

Routed experts are stored one tensor per expert (`mlp.experts.{e}.gate_proj.weight`) and stacked
into [E, out, in] on load. Writing plans the shards from the tensor sizes first, then makes and
saves one shard at a time; loading reads one tensor at a time straight to the device.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from flint_sched.checkpoint.common import (Checkpoint, CheckpointError, check_finite, check_shape,
                                           progress_bar)
from flint_sched.config import FlintConfig, load_hf_config
from flint_sched.model.weights import TensorSpec, hf_expert_name, tensor_specs
from flint_sched.tokenizer import FlintTokenizer

INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 4 << 30


def _stored_dtype(spec: TensorSpec) -> torch.dtype:
    return torch.float32 if spec.fp32 else torch.bfloat16


def _hf_names(spec: TensorSpec) -> list[str]:
    if spec.stacked_experts:
        return [hf_expert_name(spec.name, e) for e in range(spec.shape[0])]
    return [spec.name]


def _plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _stored_dtype(spec).itemsize * int(torch.Size(spec.shape).numel())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_hf(directory: str | Path, config: FlintConfig, tokenizer: FlintTokenizer,
             make_tensor: Callable[[TensorSpec], torch.Tensor], progress: bool = True,
             shard_bytes: int = SHARD_BYTES) -> None:
    """Write config.json, tokenizer files and BF16 safetensors shards with an index."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_ids}) + "\n")
    tokenizer.save(out)
    specs = tensor_specs(config)
    shards = _plan_shards(specs, shard_bytes)
    total = sum(_stored_dtype(s).itemsize * torch.Size(s.shape).numel() for s in specs)
    weight_map = {}
    with progress_bar(total, f"writing {out.name}", progress) as bar:
        for n, shard in enumerate(shards):
            name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for spec in shard:
                values = make_tensor(spec).to(_stored_dtype(spec)).cpu()
                parts = values.unbind(0) if spec.stacked_experts else [values]
                for hf_name, part in zip(_hf_names(spec), parts, strict=True):
                    tensors[hf_name] = part.contiguous()
                    weight_map[hf_name] = name
                bar.update(values.numel() * values.element_size())
            save_file(tensors, out / name, metadata={"format": "pt"})
            del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / INDEX_FILE
    if index.exists():
        try:
            return json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    weight_map = {}
    for f in files:
        with _open(f) as handle:
            weight_map.update({k: f.name for k in handle.keys()})
    return weight_map


def _open(path: Path):
    try:
        return safe_open(path, framework="pt")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file (named in the index)") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def read_hf(directory: str | Path, device: torch.device | str = "cpu",
            hf_config_path: str | Path | None = None, tokenizer_path: str | Path | None = None,
            progress: bool = True) -> Checkpoint:
    directory = Path(directory)
    config = load_hf_config(hf_config_path or directory)
    tokenizer = FlintTokenizer.from_file(tokenizer_path or directory)
    weight_map = _weight_map(directory)
    specs = tensor_specs(config)
    total = sum(_stored_dtype(s).itemsize * torch.Size(s.shape).numel() for s in specs)
    weights = {}
    with ExitStack() as stack, progress_bar(total, f"loading {directory.name}", progress) as bar:
        handles: dict[str, object] = {}

        def get(hf_name: str) -> tuple[torch.Tensor, str]:
            file = weight_map.get(hf_name)
            if file is None:
                raise CheckpointError(f"{directory}: tensor {hf_name} is missing")
            if file not in handles:
                handles[file] = stack.enter_context(_open(directory / file))
            where = str(directory / file)
            try:
                return handles[file].get_tensor(hf_name), where
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"{where}: cannot read tensor {hf_name} ({e})") from None

        for spec in specs:
            weights[spec.name] = _read_spec(spec, get, device)
            bar.update(_stored_dtype(spec).itemsize * torch.Size(spec.shape).numel())
    return Checkpoint(config, tokenizer, weights, "bf16", str(directory))


def _read_spec(spec: TensorSpec, get: Callable[[str], tuple[torch.Tensor, str]], device) -> torch.Tensor:
    dtype = _stored_dtype(spec)
    if not spec.stacked_experts:
        t, where = get(spec.name)
        check_shape(spec, tuple(t.shape), where)
        out = t.to(device, dtype)
        check_finite(spec.name, out, where)
        return out
    out = torch.empty(spec.shape, dtype=dtype, device=device)
    for e, hf_name in enumerate(_hf_names(spec)):
        t, where = get(hf_name)
        if tuple(t.shape) != spec.shape[1:]:
            raise CheckpointError(f"{where}: tensor {hf_name} has shape {tuple(t.shape)}, "
                                  f"expected {spec.shape[1:]}")
        out[e].copy_(t)
    check_finite(spec.name, out, where)
    return out

