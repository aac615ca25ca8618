"""EngineConfig: how to build an engine (model source, limits, memory), frozen and validated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from flint_sched.quant.fp8 import KV_CACHE_DTYPES


# (max_num_seqs, max_num_batched_tokens) when not given. On a GPU: 256 requests, the largest decode
# graph; a budget of 8,192 tokens per step, since prompts read in bigger chunks go faster (H200, NVFP4,
# one prompt: 10,500 tokens/s in 1K chunks, 44,200 in 8K chunks; benchmarks/RESULTS.md, session 5)
# at the cost of longer steps for the decodes that share them. On the CPU the torch path's own sizes.
GPU_DEFAULTS = (256, 8192)
CPU_DEFAULTS = (64, 2048)


@dataclass(frozen=True)
class EngineConfig:
    model: str | Path | None = None          # .gguf, HF directory, preset; None: flint-tiny
    load_format: str = "auto"
    weight_format: str = "nvfp4"             # for load_format="dummy"
    hf_config_path: str | Path | None = None
    tokenizer: str | Path | None = None
    device: str = "auto"
    dtype: str = "auto"                      # auto: float32 on CPU, bfloat16 on GPU
    kv_cache_dtype: str = "auto"             # auto: the compute dtype; fp8 / fp8_e4m3: e4m3 (quant/fp8.py)
    max_num_seqs: int | None = None          # None: GPU_DEFAULTS / CPU_DEFAULTS by device
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None         # None: the model's, capped by the KV pool
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 256 << 20
    num_kv_blocks: int | None = None         # overrides the memory-based sizing (tests)
    seed: int = 0
    executor: str = "auto"                   # auto: cuda kernels on a GPU when the shapes allow, else torch
    revision: str | None = None              # of Hugging Face Hub names (model, config, tokenizer)
    # vLLM's --generation-config: auto (the checkpoint's generation_config.json), vllm (none), a folder
    generation_config: str = "auto"
    download_dir: str | None = None          # the Hugging Face cache to use; None: huggingface_hub's
    enforce_eager: bool = False              # CUDA executor: no CUDA graphs
    enable_prefix_caching: bool = True       # as vLLM v1: on unless turned off
    num_ring_snapshots: int | None = None    # prefix-cache ring snapshots; None: max_num_seqs
    async_scheduling: bool | None = None     # None: on with the CUDA executor (engine/async_engine.py)
    launch_margin_ms: float = 0.0            # async scheduling: late launch-ahead (engine/async_engine.py); 0: off
    long_prefill_token_threshold: int = 0    # > 0: prompt tokens a request may take per step (vLLM's flag)
    stream_interval: int = 1                 # a stream's outputs every this many tokens (SGLang's / vLLM's flag)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "cpu_kv_cache_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_ring_snapshots is not None and self.num_ring_snapshots < 1:
            raise ValueError(f"num_ring_snapshots must be >= 1, got {self.num_ring_snapshots}")
        if not self.launch_margin_ms >= 0:
            raise ValueError(f"launch_margin_ms must be >= 0, got {self.launch_margin_ms}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.executor not in ("auto", "torch", "cuda"):
            raise ValueError(f"executor must be auto, torch or cuda, got {self.executor!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    def with_limits_for(self, device_type: str) -> EngineConfig:
        """This config with max_num_seqs / max_num_batched_tokens filled in for the device."""
        seqs, tokens = GPU_DEFAULTS if device_type == "cuda" else CPU_DEFAULTS
        return dataclasses.replace(self, max_num_seqs=self.max_num_seqs or seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens or tokens)

