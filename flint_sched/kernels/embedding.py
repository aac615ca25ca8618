"""The token embedding lookup (cuda/embedding.cu), a step's first kernel: torch.index_select took
~11 µs for 16 rows (its small-index kernel walks the indices one after another), and a decode
step's placeholder tokens and block-table scatter were three more small torch kernels before it.
"""

from __future__ import annotations

import functools

import torch

from flint_sched.kernels._runtime import I32, Kernel, compile_kernel
from flint_sched.kernels.linear import check_tensor

THREADS = 256   # cuda/embedding.cu EMBED_THREADS


@functools.cache
def _kernel() -> Kernel:
    return compile_kernel("embedding.cu", "embed_tokens")


def embed_tokens(table: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor, sources: torch.Tensor | None = None,
                 sampled: torch.Tensor | None = None, table_scatter: tuple[torch.Tensor, ...] | None = None,
                 pdl: bool = False) -> torch.Tensor:
    """out[r] = table[token r] for r < out.shape[0], token r = sampled[sources[r]] where sources[r] >= 0
    (int32 [rows]; sampled: int32), else tokens[r] (int32 or int64); a token outside the table gives
    a zero row. table_scatter = (index, value, flat): flat[index[r]] = value[r] for the same rows
    (int32; a decode step's new block-table entries)."""
    rows = out.shape[0]
    v, h = table.shape if table.dim() == 2 else (0, 0)
    if table.dtype != torch.bfloat16 or table.dim() != 2 or h % 8 or not table.is_cuda:
        raise ValueError("table must be a CUDA bf16 [vocab, hidden] tensor with hidden % 8 == 0")
    check_tensor(table, "table", torch.bfloat16, (v, h), table.device)
    check_tensor(out, "out", torch.bfloat16, (rows, h), table.device)
    if tokens.dtype not in (torch.int32, torch.int64) or tokens.dim() != 1 or tokens.numel() < rows:
        raise ValueError(f"tokens must be int32 or int64 [>= {rows}]")
    check_tensor(tokens, "tokens", tokens.dtype, tuple(tokens.shape), table.device, tokens.element_size())
    if (sources is None) != (sampled is None):
        raise ValueError("sources and sampled come together")
    for name, t in (("sources", sources), ("sampled", sampled), *zip(("table index", "table value", "table"),
                                                                      table_scatter or ())):
        if t is not None:
            check_tensor(t, name, torch.int32, tuple(t.shape), table.device, 4)
    if sources is not None and sources.numel() < rows:
        raise ValueError(f"sources must hold >= {rows} rows")
    index, value, flat = table_scatter if table_scatter is not None else (None, None, None)
    if index is not None and (index.numel() < rows or value.numel() < rows):
        raise ValueError(f"the table scatter must hold >= {rows} rows")
    if rows:
        _kernel().launch((rows,), (THREADS,), [out, table, tokens, I32(int(tokens.dtype == torch.int64)), sources,
                                               sampled, index, value, flat, I32(v), I32(h)],
                         pdl=pdl, device=table.device.index)
    return out
