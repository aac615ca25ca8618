"""The NVFP4 checkpoint: one GGUF v3 file, written and read tensor by tensor.

Linear weights are GGML type 40 with an F32 `.scale` sidecar ([1], or [E] for stacked experts);
embeddings, LM head, router, norms and sinks are BF16; the correction bias is F32.
Reading memory-maps the file and moves one tensor at a time to the device, where quantized
weights are repacked (losslessly) into the kernel layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from flint_sched.checkpoint.common import (Checkpoint, CheckpointError, check_finite, check_shape,
                                           progress_bar)
from flint_sched.checkpoint.gguf_config import ARCH, config_from_gguf_fields, gguf_fields, write_gguf_config
from flint_sched.config import ConfigError, FlintConfig, load_hf_config
from flint_sched.model.weights import TensorSpec, check_nvfp4_shapes, gguf_scale_name, tensor_specs
from flint_sched.quant.nvfp4 import gguf_row_bytes, quantize, repack_from_gguf, repack_to_gguf
from flint_sched.tokenizer import FlintTokenizer, write_gguf_tokenizer

QT = gguf.GGMLQuantizationType


def _scale_count(spec: TensorSpec) -> int:
    return spec.shape[0] if spec.stacked_experts else 1


def _bf16_bytes(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


class _TruncatedTensor(Exception):
    pass


class _BoundedReader(gguf.GGUFReader):
    """NOTE: checks each tensor's extent before the gguf package maps it, so that a truncated file
    is reported with the tensor's name rather than a reshape error."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name, _, dims, raw_dtype, offset = field.parts
            block_size, type_size = gguf.GGML_QUANT_SIZES[QT(int(raw_dtype[0]))]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block_size
            if end > len(self.data):
                raise _TruncatedTensor(bytes(name).decode(errors="replace"))
        super()._build_tensors(start_offs, fields)


def write_gguf(path: str | Path, config: FlintConfig, tokenizer: FlintTokenizer,
               make_tensor: Callable[[TensorSpec], torch.Tensor], progress: bool = True) -> None:
    """Write a GGUF file; `make_tensor(spec)` gives each weight's fp32 values, one at a time."""
    check_nvfp4_shapes(config)
    specs = tensor_specs(config)
    writer = gguf.GGUFWriter(None, ARCH)
    writer.add_name(f"{ARCH} (generated)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_NVFP4)
    write_gguf_config(writer, config)
    write_gguf_tokenizer(writer, tokenizer)
    total = 0
    for spec in specs:
        if spec.quantized:
            byte_shape = (*spec.shape[:-1], gguf_row_bytes(spec.shape[-1]))
            nbytes = int(np.prod(byte_shape))
            writer.add_tensor_info(spec.gguf_name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=QT.NVFP4)
            n = _scale_count(spec)
            writer.add_tensor_info(gguf_scale_name(spec.gguf_name), (n,), np.dtype(np.float32), 4 * n)
            total += nbytes + 4 * n
        elif spec.fp32:
            nbytes = 4 * int(np.prod(spec.shape))
            writer.add_tensor_info(spec.gguf_name, spec.shape, np.dtype(np.float32), nbytes)
            total += nbytes
        else:
            nbytes = 2 * int(np.prod(spec.shape))
            writer.add_tensor_info(spec.gguf_name, spec.shape, np.dtype(np.uint16), nbytes, raw_dtype=QT.BF16)
            total += nbytes
    writer.write_header_to_file(Path(path))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with progress_bar(total, f"writing {Path(path).name}", progress) as bar:
        for spec in specs:
            values = make_tensor(spec)
            if spec.quantized:
                q = quantize(values, per_leading_scale=spec.stacked_experts)
                writer.write_tensor_data(repack_to_gguf(q).cpu().numpy())
                writer.write_tensor_data(q.tensor_scale.cpu().numpy().astype(np.float32))
                bar.update(q.codes.numel() * 9 // 8 + 4 * q.tensor_scale.numel())
            elif spec.fp32:
                writer.write_tensor_data(values.float().cpu().numpy())
                bar.update(values.numel() * 4)
            else:
                writer.write_tensor_data(_bf16_bytes(values))
                bar.update(values.numel() * 2)
            del values
    writer.close()


def read_gguf(path: str | Path, device: torch.device | str = "cpu",
              hf_config_path: str | Path | None = None, tokenizer_path: str | Path | None = None,
              progress: bool = True) -> Checkpoint:
    """Load a GGUF checkpoint; config and tokenizer come from its metadata unless overridden."""
    path = Path(path)
    where = str(path)
    try:
        reader = _BoundedReader(path)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: no such file") from None
    except _TruncatedTensor as e:
        raise CheckpointError(f"{where}: tensor {e} runs past the end of the file (truncated?)") from None
    except Exception as e:  # the gguf package raises many kinds on a damaged file
        raise CheckpointError(f"{where}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    config = _read_config(reader, where, hf_config_path)
    tokenizer = _read_tokenizer(reader, where, tokenizer_path)
    check_nvfp4_shapes(config)
    tensors = {t.name: t for t in reader.tensors}
    specs = tensor_specs(config)
    weights = {}
    total = sum(tensors[s.gguf_name].n_bytes for s in specs if s.gguf_name in tensors)
    with progress_bar(total, f"loading {path.name}", progress) as bar:
        for spec in specs:
            t = _find(tensors, spec.gguf_name, where)
            if spec.quantized:
                scale_t = _find(tensors, gguf_scale_name(spec.gguf_name), where)
                weights[spec.name] = _read_nvfp4(spec, t, scale_t, path, device, where)
            else:
                weights[spec.name] = _read_plain(spec, t, path, device, where)
            bar.update(t.n_bytes)
    return Checkpoint(config, tokenizer, weights, "nvfp4", where)


def _read_config(reader: gguf.GGUFReader, where: str, hf_config_path: str | Path | None) -> FlintConfig:
    if hf_config_path is not None:
        return load_hf_config(hf_config_path)
    try:
        return config_from_gguf_fields(gguf_fields(reader))
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def _read_tokenizer(reader: gguf.GGUFReader, where: str, tokenizer_path: str | Path | None) -> FlintTokenizer:
    if tokenizer_path is not None:
        return FlintTokenizer.from_file(tokenizer_path)
    try:
        return FlintTokenizer.from_gguf(reader)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{where}: cannot read the tokenizer from its metadata ({e})") from None


def _find(tensors: dict, name: str, where: str):
    try:
        return tensors[name]
    except KeyError:
        raise CheckpointError(f"{where}: tensor {name} is missing") from None


def _read_bytes(path: Path, t) -> np.ndarray:
    """A tensor's bytes read from the file (not through the map, so memory holds only this one)."""
    return np.fromfile(path, dtype=np.uint8, count=t.n_bytes, offset=t.data_offset)


def _read_nvfp4(spec: TensorSpec, t, scale_t, path: Path, device, where: str):
    label = f"{spec.name} ({t.name})"
    if t.tensor_type != QT.NVFP4:
        raise CheckpointError(f"{where}: tensor {label} is {t.tensor_type.name}, expected NVFP4")
    check_shape(spec, tuple(reversed(t.shape.tolist())), where)
    n = _scale_count(spec)
    if scale_t.tensor_type != QT.F32 or scale_t.n_elements != n:
        raise CheckpointError(f"{where}: tensor {scale_t.name} must be F32 with {n} element(s), "
                              f"got {scale_t.tensor_type.name} with {scale_t.n_elements}")
    scale = torch.from_numpy(_read_bytes(path, scale_t).view(np.float32).copy()).to(device)
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise CheckpointError(f"{where}: tensor {scale_t.name} holds a scale that is not finite and > 0")
    byte_shape = (*spec.shape[:-1], gguf_row_bytes(spec.shape[-1]))
    blocks = torch.from_numpy(_read_bytes(path, t).reshape(byte_shape)).to(device)
    return repack_from_gguf(blocks, scale)


def _read_plain(spec: TensorSpec, t, path: Path, device, where: str) -> torch.Tensor:
    expected = QT.F32 if spec.fp32 else QT.BF16
    if t.tensor_type != expected:
        raise CheckpointError(f"{where}: tensor {spec.name} ({t.name}) is {t.tensor_type.name}, "
                              f"expected {expected.name}")
    check_shape(spec, tuple(reversed(t.shape.tolist())), where)
    raw = _read_bytes(path, t)
    if spec.fp32:
        out = torch.from_numpy(raw.view(np.float32).reshape(spec.shape))
    else:
        out = torch.from_numpy(raw.view(np.int16).reshape(spec.shape)).view(torch.bfloat16)
    out = out.to(device)
    check_finite(spec.name, out, where)
    return out
