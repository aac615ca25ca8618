"""Token choice from logits (cuda/argmax.cu), logits [B, V] in, ids [B] out, no host sync: greedy
(exact torch.argmax semantics: ties and NaN go to the lowest index, NaN counts as the maximum),
and temperature sampling by the Gumbel-max trick in the same one pass over the logits.

The workspace holds per-CTA candidates and a ticket that the kernel resets (graph-replayable).
"""

from __future__ import annotations

import functools

import torch

from flint_sched.kernels import tickets
from flint_sched.kernels._runtime import I32, I64, Kernel, compile_kernel
from flint_sched.kernels.hardware import sm_count
from flint_sched.kernels.linear import check_tensor

THREADS = 256
# CTAs over all rows: four per SM. Kernel alone, Flint's vocabulary, µs greedy / sample at 16, 64 and
# 256 rows, 2 -> 4 a SM: 6.7 / 13.7 -> 6.4 / 11.4, 19.5 / 39.6 -> 15.5 / 36.6, 49.0 / 120.5 -> 43.7 /
# 117.8 (H200, RESULTS.md session 28; 8 and 16 a SM no better)
WAVES = 4
MIN_CHUNK = 2048           # logits per CTA at least (one pass of 256 threads x 8 bf16)


@functools.cache
def _kernel(name: str, defines: tuple = ()) -> Kernel:
    return compile_kernel("argmax.cu", name, dict(defines))


def argmax_splits(batch: int, vocab: int) -> tuple[int, int]:
    """(CTAs per row, logits per CTA, a multiple of 8)."""
    splits = max(1, min(-(-WAVES * sm_count() // batch), -(-vocab // MIN_CHUNK)))
    chunk = -(-vocab // splits)
    chunk = -(-chunk // 8) * 8
    return -(-vocab // chunk), chunk


def argmax_workspace(max_batch: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    """int64 scratch: one candidate per CTA, then the ticket (last element, zero). Sized for the most
    CTAs a row can take (vocab / MIN_CHUNK; Flint's 256 rows: 152 KB), so any WAVES fits it
    (benchmarks/ab_decode.py variants change WAVES after it is made)."""
    return torch.zeros(max_batch * -(-vocab // MIN_CHUNK) + 1, dtype=torch.int64, device=device)


def pick_workspace(max_batch: int, device: torch.device | str) -> torch.Tensor:
    """int64 zeros: the LM head's folded argmax (linear's argmax_out), the best candidate of each
    row, then the ticket (last element). Each launch leaves it zeroed for the next one; it must not
    share memory with argmax_workspace, whose candidates stay behind."""
    return torch.zeros(max_batch + 1, dtype=torch.int64, device=device)


def greedy(logits: torch.Tensor, out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.int32,
           workspace: torch.Tensor | None = None, pdl: bool = False,
           active: torch.Tensor | None = None) -> torch.Tensor:
    """ids [B] = argmax over the last dim of logits [B, V] (bf16 or fp32, unit stride along V).
    active: int32 [1] on the device; where it holds 0 when the kernel runs, the kernel writes nothing
    (a graph's step whose rows all sample leaves `out` as it was)."""
    if active is not None:
        check_tensor(active, "active", torch.int32, (1,), logits.device, 4)
    return _scan("argmax", logits, out, out_dtype, workspace, pdl, [active])


def rng_state(device: torch.device | str) -> torch.Tensor:
    """`sample`'s noise state: int64 [seed, launches so far], the seed drawn from torch's generator of
    the device (so torch.cuda.manual_seed makes the draws reproducible)."""
    seed = torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)
    return torch.cat([seed, torch.zeros(1, dtype=torch.int64, device=device)])


def sample(logits: torch.Tensor, temperature: torch.Tensor, rng: torch.Tensor, out: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.int64, workspace: torch.Tensor | None = None,
           pdl: bool = False) -> torch.Tensor:
    """ids [B]: a draw of row b from softmax(logits[b] / temperature[b]) (fp32 temperature [B] > 0),
    as argmax_v logits[b, v] / temperature[b] + Gumbel noise, in one pass over the logits. The noise
    is Philox keyed by rng[0] (rng_state) at counter rng[1], which the kernel advances: each launch,
    and each replay of a CUDA graph holding one, draws anew."""
    _check_logits(logits)
    check_tensor(temperature, "temperature", torch.float32, (logits.shape[0],), logits.device, 4)
    check_tensor(rng, "rng", torch.int64, (2,), logits.device, 8)
    return _scan("sample", logits, out, out_dtype, workspace, pdl, [temperature, rng])


def _check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_cuda:
        raise ValueError("logits must be a CUDA tensor [B, V]")
    if logits.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"logits must be bf16 or fp32, got {logits.dtype}")
    if logits.numel() == 0 or logits.stride(1) != 1:
        raise ValueError("logits must be non-empty with unit stride along the vocabulary")


def _scan(kind: str, logits, out, out_dtype, workspace, pdl, extra) -> torch.Tensor:
    _check_logits(logits)
    b, v = logits.shape
    if out is None:
        out = torch.empty(b, dtype=out_dtype, device=logits.device)
    if out.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"out must be int32 or int64, got {out.dtype}")
    check_tensor(out, "out", out.dtype, (b,), logits.device, out.element_size())
    splits, chunk = argmax_splits(b, v)
    need = b * splits + 1
    if workspace is None:
        workspace = torch.zeros(need, dtype=torch.int64, device=logits.device)
    if workspace.dtype != torch.int64 or workspace.numel() < need or workspace.device != logits.device:
        raise ValueError(f"argmax workspace must be int64 with >= {need} elements on {logits.device}")
    esize = logits.element_size()
    vec_ok = logits.data_ptr() % 16 == 0 and (logits.stride(0) * esize) % 16 == 0
    name = f"{kind}_bf16" if logits.dtype == torch.bfloat16 else f"{kind}_f32"
    _kernel(name, tickets.defines()).launch(
        (splits, b), (THREADS,),
        [out, I32(out.dtype == torch.int64), logits, I64(logits.stride(0)), I32(v), I32(chunk), I32(vec_ok),
         workspace, workspace[workspace.numel() - 1:], *extra],
        pdl=pdl, device=logits.device.index)
    return out
