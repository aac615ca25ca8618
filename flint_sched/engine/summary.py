"""The start-up summary: one block saying what was loaded, from where, onto what, with what capacity."""

from __future__ import annotations

from flint_sched.engine.builder import EngineParts


def checkpoint_format(parts: EngineParts) -> str:
    ckpt = parts.checkpoint
    if ckpt.source == "dummy":
        return f"dummy ({ckpt.weight_format.upper()} weights made on the device, no file)"
    if str(ckpt.source).endswith(".gguf"):
        return f"GGUF ({ckpt.weight_format.upper()} weights)"
    return f"Hugging Face safetensors ({ckpt.weight_format.upper()} weights)"


def executor_description(parts: EngineParts) -> str:
    executor = parts.executor
    name = type(executor).__name__
    if name == "CudaExecutor":
        graphs = "from CUDA graphs" if getattr(executor, "use_graphs", True) else "eager (--enforce-eager)"
        fused = parts.scheduler_config.fused_max_seqs
        return (f"cuda: our NVRTC kernels; decode batches <= {fused} on the fused path, larger on the grouped "
                f"path, {graphs}; prompts on the grouped GEMMs")
    if name == "TorchExecutor":
        return "torch: plain PyTorch ops (the portable path; no custom kernels)"
    return name


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def summary_lines(parts: EngineParts, extra: dict[str, str] | None = None) -> list[str]:
    """`key: value` lines: model and origin, format, device, executor, KV capacity, limits, and `extra`."""
    ckpt, sched = parts.checkpoint, parts.scheduler_config
    config = ckpt.config
    total, active = config.parameter_counts()
    origins = parts.origins
    kv_tokens = sched.num_blocks * sched.block_size
    kv = getattr(parts.executor, "kv", None)      # test executors may have none
    kv_dtype = f"; {str(kv.dtype).removeprefix('torch.')}" if kv is not None else ""
    lines = {
        "model": f"{config.num_hidden_layers} layers, {_count(total)} parameters ({_count(active)} active per token)",
        "from": origins.get("model", str(ckpt.source)),
        "checkpoint": f"{ckpt.source}",
        "format": checkpoint_format(parts),
        "config": origins.get("config", "the checkpoint's own"),
        "tokenizer": origins.get("tokenizer", "the checkpoint's own"),
        "device": str(parts.device),
        "executor": executor_description(parts),
        "KV cache": (f"{kv_tokens:,} tokens of full-attention KV ({sched.num_blocks:,} blocks of {sched.block_size}); "
                     f"{sched.max_num_seqs} concurrent sliding windows of {config.sliding_window} tokens "
                     f"(at most that many requests at once){kv_dtype}"),
        "max model len": f"{sched.max_model_len:,} tokens",
        "weights": f"{ckpt.nbytes / 2**30:.2f} GiB",
    }
    if "RANDOM" in lines["from"] or ckpt.source == "dummy":
        lines["note"] = "random weights: the model runs, but its answers are gibberish"
    lines.update(extra or {})
    width = max(map(len, lines))
    return [f"  {key:<{width}}  {value}" for key, value in lines.items()]


def format_summary(parts: EngineParts, extra: dict[str, str] | None = None, title: str = "flint-sched") -> str:
    return "\n".join([f"{title}:", *summary_lines(parts, extra)])
