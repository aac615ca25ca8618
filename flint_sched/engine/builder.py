"""From an EngineConfig to a running engine's parts: checkpoint, KV cache sized to memory, executor."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from flint_sched.checkpoint import generation_config, hub
from flint_sched.checkpoint.common import Checkpoint
from flint_sched.checkpoint.loader import load_checkpoint, peek_config
from flint_sched.checkpoint.make import default_checkpoint_location, resolve_device
from flint_sched.config import PRESETS
from flint_sched.config import FlintConfig
from flint_sched.core.scheduler import Scheduler
from flint_sched.core.scheduler_config import SchedulerConfig
from flint_sched.engine.async_engine import AsyncEngine
from flint_sched.engine.config import EngineConfig
from flint_sched.executor.grammar_masks import GrammarMasks
from flint_sched.executor.kv_cache import KVCache
from flint_sched.executor.torch_executor import TorchExecutor
from flint_sched.quant.fp8 import kv_cache_dtype
from flint_sched.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)
ACTIVATION_RESERVE_BYTES = 4 << 30   # GPU memory kept back for activations and graphs


@dataclass
class EngineParts:
    checkpoint: Checkpoint
    scheduler_config: SchedulerConfig
    executor: object          # TorchExecutor or CudaExecutor: execute(StepPlan) -> StepResult
    device: torch.device
    origins: dict[str, str] = field(default_factory=dict)   # model / config / tokenizer -> where it came from
    grammar_compiler: GrammarCompiler | None = None          # structured outputs, shared by engine and executor
    async_scheduling: bool = False    # schedule and launch step N+1 before step N's tokens are read back
    launch_margin_s: float = 0.0      # late launch-ahead (engine/async_engine.py); 0: off
    stream_interval: int = 1          # a stream's outputs every this many tokens (engine/async_engine.py)
    # the checkpoint's generation_config.json sampling fields (checkpoint/generation_config.py)
    sampling_defaults: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Sources:
    """Where the model, config and tokenizer are read from, hub names already downloaded."""

    model: str | None
    hf_config_path: str | None
    tokenizer: str | None
    origins: dict[str, str]


def resolve_sources(config: EngineConfig) -> Sources:
    """Hub names (owner/repo, owner/repo:file) become local paths; presets and paths stay as given."""
    model, cfg, tok = (str(v) if v is not None else None for v in (config.model, config.hf_config_path,
                                                                   config.tokenizer))
    origins: dict[str, str] = {}
    if config.load_format != "dummy" and (found := hub.resolve_model(model, config.revision, config.download_dir)):
        model, origins["model"] = found.path, found.origin
    elif (model or "flint-tiny") in PRESETS:
        name = model or "flint-tiny"
        if config.load_format == "dummy":
            origins["model"] = f"preset {name}: random weights made on the device (--load-format dummy)"
        else:
            path = default_checkpoint_location(name, seed=config.seed)
            verb = "loaded from the cache" if path.exists() else "generated on first use into"
            origins["model"] = f"preset {name}: RANDOM weights (seed {config.seed}), {verb} {path}"
    else:
        origins["model"] = f"local {model}"
    if found := hub.resolve_config(cfg, config.revision, config.download_dir):
        cfg, origins["config"] = found.path, found.origin
    if found := hub.resolve_tokenizer(tok, config.revision, config.download_dir):
        tok, origins["tokenizer"] = found.path, found.origin
    return Sources(model, cfg, tok, origins)


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


def num_ring_snapshots(config: EngineConfig) -> int:
    """Ring slots kept for prefix-cache snapshots (0 with caching off): by default one per running
    request, so each of max_num_seqs conversations keeps its latest turn's snapshot."""
    if not config.enable_prefix_caching:
        return 0
    return config.max_num_seqs if config.num_ring_snapshots is None else config.num_ring_snapshots


def _num_blocks(config: EngineConfig, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype,
                reserved: int = 0) -> int:
    """KV blocks that fit the memory left; `reserved`: bytes the executor will still allocate."""
    per_block = KVCache.bytes_per_block(ckpt.config, config.block_size, dtype)
    num_slots = config.max_num_seqs + num_ring_snapshots(config)
    rings = num_slots * KVCache.bytes_per_slot(ckpt.config, config.block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total - ACTIVATION_RESERVE_BYTES - rings - reserved
    else:
        budget = config.cpu_kv_cache_bytes
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(f"no memory is left for the KV cache (budget {budget / 2**30:.2f} GiB after weights "
                         f"and {num_slots} ring slots): lower --max-num-seqs or raise "
                         "--gpu-memory-utilization")
    return num_blocks


def build_parts(config: EngineConfig, progress: bool = True, checkpoint: Checkpoint | None = None) -> EngineParts:
    """Load the checkpoint (unless one is given), size the KV cache, make the executor."""
    device = resolve_device(config.device)
    config = config.with_limits_for(device.type)
    dtype = _dtype(config, device)
    check_executor_possible(config, device, dtype)
    origins: dict[str, str] = {}
    sampling_defaults: dict = {}
    if checkpoint is None:
        sources = resolve_sources(config)
        origins = sources.origins
        found = generation_config.find(config.generation_config, sources.model, sources.hf_config_path)
        sampling_defaults = generation_config.sampling_defaults(found)
        check_weights_fit(peek_config(sources.model, config.load_format, sources.hf_config_path), device, dtype)
        checkpoint = load_checkpoint(sources.model, config.load_format, device, sources.hf_config_path,
                                     sources.tokenizer, config.weight_format, config.seed, progress)
    ckpt = checkpoint
    use_cuda = _use_cuda_executor(config, ckpt, device, dtype)
    reserved = 0
    if use_cuda:                       # the executor's bf16 copies of NVFP4 dense weights
        from flint_sched.executor.dense_copies import copies_bytes
        reserved = copies_bytes(ckpt.weights)
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
    num_blocks = config.num_kv_blocks or _num_blocks(config, ckpt, device, kv_dtype, reserved)
    max_model_len = min(config.max_model_len or ckpt.config.max_position_embeddings,
                        ckpt.config.max_position_embeddings, num_blocks * config.block_size)
    num_snapshots = num_ring_snapshots(config)
    kv = KVCache(ckpt.config, num_blocks, config.block_size, config.max_num_seqs + num_snapshots, kv_dtype, device)
    if use_cuda:
        from flint_sched.executor.cuda_executor import CudaExecutor
        executor = CudaExecutor(ckpt.config, ckpt.weights, kv, ckpt.tokenizer.eos_token_ids, max_model_len,
                                device, config.seed)
        if config.enforce_eager:
            executor.use_graphs = False
        _warm_up(executor, config.max_num_batched_tokens, config.max_num_seqs, progress)
    else:
        executor = TorchExecutor(ckpt.config, ckpt.weights, kv, ckpt.tokenizer.eos_token_ids, dtype, device,
                                 config.seed)
    compiler = GrammarCompiler(ckpt.tokenizer)
    executor.grammars = GrammarMasks(compiler)
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        block_size=config.block_size,
        sliding_window=ckpt.config.sliding_window,
        fused_max_seqs=executor.limits.fused_max_batch,
        enable_prefix_caching=config.enable_prefix_caching,
        num_ring_snapshots=num_snapshots,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        prefix_cache_key=(f"{config.model or 'flint-tiny'}@{config.revision}:{dtype}:{kv.dtype}"
                          f":seed{config.seed}"),
    )
    # Async scheduling pays where the host's per-step work would leave the GPU idle: the CUDA
    # executor (on by default). The torch executor computes its step in launch, so it gains nothing.
    use_async = config.async_scheduling if config.async_scheduling is not None else not isinstance(executor, TorchExecutor)
    return EngineParts(ckpt, scheduler_config, executor, device, origins, compiler, use_async,
                       config.launch_margin_ms / 1e3, config.stream_interval, sampling_defaults)


def _warm_up(executor, max_prompt_tokens: int, max_num_seqs: int, progress: bool) -> None:
    """Compile the kernels and capture the first graphs now, not during the first requests. A
    failure here is only logged: the steps that need those kernels report it themselves."""
    start = time.perf_counter()
    try:
        executor.warm_up(max_prompt_tokens, max_num_seqs)
    except Exception:
        logger.warning("the CUDA executor's warm-up failed; kernels compile on first use", exc_info=True)
        return
    if progress:
        print(f"flint-sched: kernels compiled and first CUDA graphs captured in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)


def check_executor_possible(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse `executor="cuda"` before anything loads when it cannot run here; say how to fix it."""
    if config.executor != "cuda":
        return
    if device.type != "cuda":
        raise ValueError(f"--executor cuda needs a CUDA GPU, and the device is {device} "
                         "(use --executor torch, or run on a GPU machine)")
    if dtype != torch.bfloat16:
        raise ValueError(f"--executor cuda runs bfloat16 only, not {config.dtype}")
    available, why = kernel_runtime_available()
    if not available:
        raise ValueError(f"--executor cuda needs NVRTC and the CUDA driver API (cuda-python), which cannot be "
                         f"loaded ({why}): pip install 'flint-sched[gpu]'")


def kernel_runtime_available() -> tuple[bool, str]:
    """(True, version) when cuda-python's NVRTC loads, else (False, why)."""
    from flint_sched.kernels._runtime import nvrtc_available
    return nvrtc_available()


def _use_cuda_executor(config: EngineConfig, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> bool:
    if config.executor == "torch":
        return False
    possible = device.type == "cuda" and dtype == torch.bfloat16
    if possible:                       # the CUDA executor's modules are imported on GPU machines only
        from flint_sched.executor.cuda_executor import supports
        possible = supports(ckpt.config)
    if possible and config.executor == "auto" and not kernel_runtime_available()[0]:
        print("flint-sched: cuda-python is not installed, so the torch executor runs on the GPU "
              "(pip install 'flint-sched[gpu]' for our CUDA kernels)", file=sys.stderr)
        return False
    if config.executor == "cuda" and not possible:
        raise ValueError("the CUDA executor needs a GPU, bfloat16, head_dim 128 and 8 query heads per KV head")
    return possible


def build_engine(parts: EngineParts, scheduler: Scheduler | None = None) -> AsyncEngine:
    """An engine over already built parts, with a fresh scheduler unless one is given (the LLM class
    keeps one, and its prefix cache, across generate calls); call start() inside a loop."""
    return AsyncEngine(scheduler if scheduler is not None else Scheduler(parts.scheduler_config), parts.executor,
                       parts.checkpoint.tokenizer, parts.checkpoint.config.vocab_size,
                       async_scheduling=parts.async_scheduling, grammar_compiler=parts.grammar_compiler,
                       launch_margin_s=parts.launch_margin_s, stream_interval=parts.stream_interval)
