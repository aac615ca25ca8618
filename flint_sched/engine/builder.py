"""From an EngineConfig to a running engine's parts: checkpoint, KV cache sized to memory, executor."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flint_sched.checkpoint.common import Checkpoint
from flint_sched.checkpoint.loader import load_checkpoint, peek_config
from flint_sched.checkpoint.make import resolve_device
from flint_sched.config import FlintConfig
from flint_sched.core.scheduler import Scheduler
from flint_sched.core.scheduler_config import SchedulerConfig
from flint_sched.engine.async_engine import AsyncEngine
from flint_sched.engine.config import EngineConfig
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.torch_executor import TorchExecutor

ACTIVATION_RESERVE_BYTES = 4 << 30   # GPU memory kept back for activations and graphs


@dataclass
class EngineParts:
    checkpoint: Checkpoint
    scheduler_config: SchedulerConfig
    executor: object          # TorchExecutor or CudaExecutor: execute(StepPlan) -> StepResult
    device: torch.device


def _dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


def check_weights_fit(model: FlintConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before loading anything, a model whose weights cannot fit the device's memory.

    The CPU path holds every weight dense in the compute dtype; a GPU holds at least the packed
    NVFP4 weights (about 0.56 bytes each).
    """
    total, _ = model.parameter_counts()
    if device.type == "cuda":
        need, have, where = total * 0.5625, torch.cuda.get_device_properties(device).total_memory, "GPU"
    else:
        need = total * torch.empty((), dtype=dtype).element_size()
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host"
    if need > 0.9 * have:
        raise ValueError(f"this model's weights need about {need / 1e9:.0f} GB, the {where} has "
                         f"{have / 1e9:.0f} GB: run it on a GPU (--device cuda), or serve flint-tiny")


def _num_blocks(config: EngineConfig, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> int:
    per_block = KVCache.bytes_per_block(ckpt.config, config.block_size, dtype)
    rings = config.max_num_seqs * KVCache.bytes_per_slot(ckpt.config, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total - ACTIVATION_RESERVE_BYTES - rings
    else:
        budget = config.cpu_kv_cache_bytes
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(f"no memory is left for the KV cache (budget {budget / 2**30:.2f} GiB after weights "
                         f"and {config.max_num_seqs} ring slots): lower --max-num-seqs or raise "
                         "--gpu-memory-utilization")
    return num_blocks


def build_parts(config: EngineConfig, progress: bool = True, checkpoint: Checkpoint | None = None) -> EngineParts:
    """Load the checkpoint (unless one is given), size the KV cache, make the executor."""
    device = resolve_device(config.device)
    if checkpoint is None:
        check_weights_fit(peek_config(config.model, config.load_format, config.hf_config_path), device,
                          _dtype(config, device))
    ckpt = checkpoint or load_checkpoint(config.model, config.load_format, device, config.hf_config_path,
                                         config.tokenizer, config.weight_format, config.seed, progress)
    dtype = _dtype(config, device)
    num_blocks = config.num_kv_blocks or _num_blocks(config, ckpt, device, dtype)
    max_model_len = min(config.max_model_len or ckpt.config.max_position_embeddings,
                        ckpt.config.max_position_embeddings, num_blocks * config.block_size)
    kv = KVCache(ckpt.config, num_blocks, config.block_size, config.max_num_seqs, dtype, device)
    if _use_cuda_executor(config, ckpt, device, dtype):
        from flint_sched.executor.cuda_executor import CudaExecutor
        executor = CudaExecutor(ckpt.config, ckpt.weights, kv, ckpt.tokenizer.eos_token_ids, max_model_len,
                                device, config.seed)
    else:
        executor = TorchExecutor(ckpt.config, ckpt.weights, kv, ckpt.tokenizer.eos_token_ids, dtype, device,
                                 config.seed)
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        block_size=config.block_size,
        sliding_window=ckpt.config.sliding_window,
        fused_max_seqs=executor.limits.fused_max_batch,
    )
    return EngineParts(ckpt, scheduler_config, executor, device)


def _use_cuda_executor(config: EngineConfig, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> bool:
    if config.executor == "torch":
        return False
    possible = device.type == "cuda" and dtype == torch.bfloat16
    if possible:                       # the CUDA executor's modules are imported on GPU machines only
        from flint_sched.executor.cuda_executor import supports
        possible = supports(ckpt.config)
    if config.executor == "cuda" and not possible:
        raise ValueError("the CUDA executor needs a GPU, bfloat16, head_dim 128 and 8 query heads per KV head")
    return possible


def build_engine(parts: EngineParts) -> AsyncEngine:
    """A fresh engine (scheduler and loop) over already built parts; call start() inside a loop."""
    return AsyncEngine(Scheduler(parts.scheduler_config), parts.executor, parts.checkpoint.tokenizer,
                       parts.checkpoint.config.vocab_size)
