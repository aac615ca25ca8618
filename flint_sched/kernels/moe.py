"""Small-batch MoE for T <= 8 tokens (cuda/router.cu, cuda/moe.cu): router, gate/up, down.

Expert ids stay on the GPU from the router to the expert kernels (no host sync). Experts are
stacked [E, out, in] (bf16, or NVFP4Tensor with one tensor scale per expert); the shared expert
is separate. h [T, A + 1, I] bf16 holds slot a's activation in h[:, a] and the shared expert's in
h[:, A]. The router's workspace carries a ticket the kernel resets, so it can be reused and
captured in a CUDA graph; pass one from `router_workspace` when capturing.

With `pdl=True`, `moe_down` reads the expert ids and routing weights before waiting on its
predecessor (and starts loading those experts' weights): launch it right after `moe_gate_up`,
whose CTAs trigger it only after waiting for the kernel that wrote the ids (the router).
"""

from __future__ import annotations

import functools

import torch

from flint_sched.kernels import tickets
from flint_sched.kernels._runtime import F32, I32, Kernel, compile_kernel
from flint_sched.kernels.linear import (MAX_TOKENS, Weight, cdiv, check_activations, check_tensor, output,
                                        weight_args, weight_format, x_batch)
from flint_sched.kernels.norm import MAX_HIDDEN

MAX_PAIRS = 64            # T * A (cuda/moe.cu MOE_MAX_PAIRS)
MAX_EXPERTS = 1024        # router: 32 experts per lane
MAX_ROUTER_SPLITS = 8
ROUTER_THREADS = 256
CLUSTER_CTAS = 8                   # cuda/router.cu RC_CTAS: the cluster router's one cluster
CLUSTER_MAX_SHARED = 200 * 1024    # its dynamic shared memory at most (the H200 allows 227 KiB)
# route(cluster=None) takes the cluster router wherever it fits; False: the ticket router always
# (an A/B switch for benchmarks/ab_decode.py: the cluster launch left the GPU idle around it when it
# also sorted, at 9-16 rows, RESULTS.md session 14; here it won at batch 1 and 8 in session 3).
CLUSTER_ROUTER = True
# The cluster router's scores reach the CTAs that select by st.async, counted on their own mbarriers,
# instead of DSMEM stores and a second cluster barrier, whose release costs every CTA a MEMBAR.GPU
# (cuda/router.cu RC_ST_ASYNC): the same scores; with tickets.ACQ_REL ~1 % off a decode step at 1-16
# requests (RESULTS.md, session 35).
ROUTER_ST_ASYNC = True
# Warps of a moe_down CTA (cuda/moe.cu MOE_DOWN_WARPS; one CTA per 16 outputs). 16 warps take
# ~48 K registers, so a down CTA can only start on an SM once gate/up's CTAs leave it; 8 or 4 would
# fit beside them, but lose: NVFP4 at 1K, ms a step at 1 / 4 / 6 requests, 16 warps 2.01 / 3.02 /
# 3.71, 8 warps 2.01 / 3.16 / 3.95, 4 warps 2.14 / 3.64 / 4.60 (H200, RESULTS.md session 32).
DOWN_WARPS = 16
# NVFP4 gate/up with its weights staged in shared memory (cuda/moe.cu moe_gate_up_staged_nvfp4):
# each CTA's 16 rows bulk-copied after the ids, all of its x loaded while they land. The same bits
# as the plain kernel; NVFP4 at 1K, ms a step at 1 / 2 / 4 requests: 2.03 / 2.43 / 3.00 against
# 2.11-2.14 / 2.49-2.59 / 3.15-3.25 (H100, RESULTS.md session 37).
STAGED_GATE_UP = True


@functools.cache
def _kernel(source: str, name: str, defines: tuple = ()) -> Kernel:
    return compile_kernel(source, name, dict(defines))


def gate_up_warps(fmt: str, tokens: int) -> int:
    """Warps per MoE gate/up CTA. NVFP4: 4 (K = 2048: 4 k-steps of 128 each, one round of loads).
    BF16: 8 (8 k-steps of 32 each, one round) below 4 tokens; 4 from 4 tokens on, where the grid
    spans several waves anyway and 4 CTAs per SM hide more latency than a single round does
    (H200, Flint BF16 at 1K, one process: batch 1 2.67 ms/step with 8, 2.76 with 4; batch 8 6.47-6.56
    with 8, 6.23 with 4; benchmarks/RESULTS.md)."""
    return 8 if fmt == "bf16" and tokens < 4 else 4


def _moe_kernel(name: str, fmt: str, warps: int) -> Kernel:
    """moe_gate_up_* or moe_down_* of cuda/moe.cu, both from one compiled variant per (format,
    gate/up warps, down warps) (MOE_GATE_UP_WARPS shapes gate/up only, MOE_DOWN_WARPS down only,
    X_BATCH both)."""
    return _kernel("moe.cu", f"{name}_{fmt}", (("MOE_GATE_UP_WARPS", warps), ("MOE_DOWN_WARPS", DOWN_WARPS),
                                               ("X_BATCH", x_batch(fmt))))


def router_workspace(num_experts: int, device: torch.device | str, max_tokens: int = MAX_TOKENS) -> torch.Tensor:
    """fp32 scratch for partial logits plus the ticket (last element, zero)."""
    return torch.zeros(MAX_ROUTER_SPLITS * max_tokens * num_experts + 1, dtype=torch.float32, device=device)


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
          ids: torch.Tensor | None = None, weights: torch.Tensor | None = None,
          workspace: torch.Tensor | None = None, pdl: bool = False,
          cluster: bool | None = None, norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
          normed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int32 [T, A], weights fp32 [T, A]) as `route()` in model/reference.py.

    cluster: use the one-cluster kernel (gate in shared memory, no workspace); None: whenever it
    fits (`cluster_router_bytes`) and CLUSTER_ROUTER is set, as for Flint's 256 x 2048 gate.
    norm_weight: x is unnormalized; the router reads rms_norm(x, norm_weight, norm_eps) and writes
    it to `normed` (bf16 [T, H]), bit for bit as kernels/norm.py `rms_norm`. The cluster kernel only.
    """
    check_activations(x)
    t, k = x.shape
    e = gate.shape[0]
    if not 1 <= top_k <= min(e, 32):
        raise ValueError(f"top_k must be in 1..min(num_experts, 32), got {top_k}")
    if e > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts, got {e}")
    if k % 8:
        raise ValueError(f"hidden size must be a multiple of 8, got {k}")
    check_tensor(gate, "gate", torch.bfloat16, (e, k), x.device)
    check_tensor(bias, "bias", torch.float32, (e,), x.device, 4)
    ids = _out(ids, "ids", torch.int32, (t, top_k), x)
    weights = _out(weights, "weights", torch.float32, (t, top_k), x)
    shared = cluster_router_bytes(e, k, t)
    if cluster is None:
        cluster = (CLUSTER_ROUTER or norm_weight is not None) and shared is not None
    if cluster:
        if shared is None or (norm_weight is not None and k > MAX_HIDDEN):
            raise ValueError(f"the cluster router needs <= {8 * 32} experts, hidden % 16 == 0 (<= {MAX_HIDDEN} "
                             f"to normalize) and its gate in {CLUSTER_MAX_SHARED} bytes of shared memory; "
                             f"got {e} x {k}")
        name, args = "router_topk_cluster", [ids, weights, x, gate, bias, I32(t), I32(e), I32(k), I32(top_k),
                                             F32(scaling)]
        if norm_weight is not None:
            check_tensor(norm_weight, "norm_weight", torch.bfloat16, (k,), x.device)
            normed = _out(normed, "normed", torch.bfloat16, (t, k), x)
            if normed.data_ptr() == x.data_ptr():
                raise ValueError("normed must not be x: every CTA reads all of x while the others write")
            name, args = "router_topk_cluster_norm", args + [norm_weight, normed, F32(norm_eps)]
        _kernel("router.cu", name, (("ROUTER_MAX_EXPERTS", 256), ("RC_ST_ASYNC", int(ROUTER_ST_ASYNC)))).launch(
            (CLUSTER_CTAS,), (ROUTER_THREADS,), args, shared_bytes=shared, pdl=pdl, device=x.device.index)
        return ids, weights
    if norm_weight is not None:
        raise ValueError("only the cluster router normalizes its input: it needs cluster=None or True and "
                         f"<= {8 * 32} experts whose gate fits its shared memory; got {e} x {k}")
    if workspace is None:
        workspace = router_workspace(e, x.device, t)
    tiles, splits = cdiv(e, 16), router_splits(e, k)
    need = splits * t * e + 1
    if workspace.dtype != torch.float32 or workspace.numel() < need or workspace.device != x.device:
        raise ValueError(f"router workspace must be fp32 with >= {need} elements on {x.device}")
    partial, ticket = workspace[: need - 1], workspace[workspace.numel() - 1:]
    max_experts = 256 if e <= 256 else MAX_EXPERTS
    _kernel("router.cu", "router_topk", (("ROUTER_MAX_EXPERTS", max_experts), *tickets.defines())).launch(
        (tiles, splits), (ROUTER_THREADS,),
        [ids, weights, x, gate, bias, partial, ticket, I32(t), I32(e), I32(k), I32(top_k), F32(scaling)],
        shared_bytes=t * e * 4, pdl=pdl, device=x.device.index)
    return ids, weights


def router_splits(num_experts: int, hidden: int) -> int:
    """K splits of the ticket router's 16-row tiles: about 128 CTAs, >= 1 k-step of 32 a warp."""
    return max(1, min(MAX_ROUTER_SPLITS, 128 // cdiv(num_experts, 16), cdiv(hidden, 32) // 8))


def router_normalizes(num_experts: int, hidden: int, tokens: int) -> bool:
    """Whether `route(..., norm_weight=)` takes these shapes (the cluster router, when it is on)."""
    return CLUSTER_ROUTER and hidden <= MAX_HIDDEN and cluster_router_bytes(num_experts, hidden, tokens) is not None


def cluster_router_bytes(num_experts: int, hidden: int, tokens: int) -> int | None:
    """Dynamic shared memory of the cluster router (cuda/router.cu router_topk_cluster), or None
    where it does not apply: each of its CTAs holds ceil(E / 8) <= 32 gate rows padded to 16."""
    per_cta = cdiv(num_experts, CLUSTER_CTAS)
    if per_cta > 32 or hidden % 16:
        return None
    pitch = 2 * hidden + 16
    size = (cdiv(per_cta, 16) * 16 + tokens) * pitch + (tokens + 1) * num_experts * 4
    return size if size <= CLUSTER_MAX_SHARED else None


def moe_gate_up(x: torch.Tensor, ids: torch.Tensor, gate: Weight, up: Weight,
                shared_gate: Weight | None = None, shared_up: Weight | None = None,
                out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """h [T, A + 1, I]: silu(x @ Wg_e^T) * (x @ Wu_e^T) for each chosen expert and the shared one."""
    check_activations(x)
    t, k = x.shape
    num_experts, i = gate.shape[0], gate.shape[1]
    a = _check_ids(ids, t, x.device)
    fmt = weight_format(gate, up, shared_gate, shared_up)
    stack = (num_experts, i, k)
    args = (weight_args(gate, "gate", stack, x.device, num_experts)
            + weight_args(up, "up", stack, x.device, num_experts))
    shared_args, has_shared = _shared_expert_args(fmt, x.device, ("shared_gate", shared_gate, (i, k)),
                                                  ("shared_up", shared_up, (i, k)))
    args += shared_args
    h = output(out, "out", (t, a + 1, i), x)
    warps = gate_up_warps(fmt, t)
    staged = STAGED_GATE_UP and fmt == "nvfp4" and i % 8 == 0 and k % 128 == 0
    _moe_kernel("moe_gate_up_staged" if staged else "moe_gate_up", fmt, warps).launch(
        (cdiv(i, 8), t * a + int(has_shared)), (32 * warps,),
        [h, x, ids, *args, I32(t), I32(a), I32(i), I32(k), I32(num_experts)], shared_bytes=9 * k if staged else 0,
        pdl=pdl, device=x.device.index)
    return h


def moe_down(h: torch.Tensor, ids: torch.Tensor, routing_weights: torch.Tensor, down: Weight,
             shared_down: Weight | None = None, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """y [T, H] = residual + sum_a w[:, a] * (h[:, a] @ Wd_e^T) + h[:, A] @ Wd_shared^T."""
    if h.dim() != 3:
        raise ValueError("h must be [T, A + 1, I]")
    t, slots, i = h.shape
    a = _check_ids(ids, t, h.device)
    if slots != a + 1:
        raise ValueError(f"h has {slots} slots, expected top_k + 1 = {a + 1}")
    check_tensor(h, "h", torch.bfloat16, (t, slots, i), h.device)
    check_tensor(routing_weights, "routing_weights", torch.float32, (t, a), h.device, 4)
    num_experts, n = down.shape[0], down.shape[1]
    fmt = weight_format(down, shared_down)
    args = weight_args(down, "down", (num_experts, n, i), h.device, num_experts)
    shared_args, has_shared = _shared_expert_args(fmt, h.device, ("shared_down", shared_down, (n, i)))
    args += shared_args
    if residual is not None:
        check_tensor(residual, "residual", torch.bfloat16, (t, n), h.device, 2)
    y = output(out, "out", (t, n), h)
    _moe_kernel("moe_down", fmt, gate_up_warps(fmt, t)).launch(
        (cdiv(n, 16),), (32 * DOWN_WARPS,),
        [y, h, ids, routing_weights, *args, I32(int(has_shared)), residual, I32(t), I32(a), I32(n), I32(i),
         I32(num_experts)], pdl=pdl, device=h.device.index)
    return y


SPLIT_CTAS = 8        # cuda/moe_split.cu MS_CTAS: a cluster of moe_split (16 intermediate rows a CTA)
SPLIT_CHUNK = 16 * SPLIT_CTAS
SPLIT_MAX_HIDDEN = SPLIT_CHUNK * 2 * 8   # MS_DOWN_TILES 16-row down tiles for each of MS_WARPS


def moe_split_fits(fmt: str, hidden: int, intermediate: int, tokens: int) -> bool:
    """Whether `moe_split` takes these shapes."""
    return (fmt == "nvfp4" and 1 <= tokens <= MAX_TOKENS and intermediate % SPLIT_CHUNK == 0
            and hidden % SPLIT_CHUNK == 0 and hidden <= SPLIT_MAX_HIDDEN)


def moe_split(x: torch.Tensor, ids: torch.Tensor, routing_weights: torch.Tensor, gate: Weight, up: Weight,
              down: Weight, shared_gate: Weight | None = None, shared_up: Weight | None = None,
              shared_down: Weight | None = None, acc: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """acc [T, H] += what `moe_down(moe_gate_up(...), ...)` computes, in one launch (cuda/moe_split.cu
    moe_split_nvfp4: each cluster of 8 CTAs does gate/up of one expert's 128 intermediate rows and
    their share of down, added into acc by atomics). acc is fixed point, int64 of value x 2^32, so the
    sum's bits do not depend on the atomics' order; it must hold zeros (or what to add to), and
    kernels/norm.py `add_rms_norm_fixed` reads it and zeroes it. NVFP4 weights, shapes as
    `moe_split_fits`."""
    check_activations(x)
    t, k = x.shape
    a = _check_ids(ids, t, x.device)
    num_experts, i = gate.shape[0], gate.shape[1]
    n = down.shape[1]
    fmt = weight_format(gate, up, down, shared_gate, shared_up, shared_down)
    if not moe_split_fits(fmt, k, i, t) or n != k:
        raise ValueError(f"moe_split takes NVFP4 experts, hidden and intermediate sizes multiples of {SPLIT_CHUNK} "
                         f"(hidden <= {SPLIT_MAX_HIDDEN}) and 1..{MAX_TOKENS} tokens; got {fmt}, hidden {k}, "
                         f"intermediate {i}, down to {n}, {t} tokens")
    check_tensor(routing_weights, "routing_weights", torch.float32, (t, a), x.device, 4)
    args = (weight_args(gate, "gate", (num_experts, i, k), x.device, num_experts)
            + weight_args(up, "up", (num_experts, i, k), x.device, num_experts)
            + weight_args(down, "down", (num_experts, n, i), x.device, num_experts))
    shared_args, has_shared = _shared_expert_args(fmt, x.device, ("shared_gate", shared_gate, (i, k)),
                                                  ("shared_up", shared_up, (i, k)),
                                                  ("shared_down", shared_down, (n, i)))
    args += shared_args
    if acc is None:
        acc = torch.zeros(t, n, dtype=torch.int64, device=x.device)
    check_tensor(acc, "acc", torch.int64, (t, n), x.device, 16)
    _kernel("moe_split.cu", "moe_split_nvfp4").launch(
        (i // 16, t * a + int(has_shared)), (256,),
        [acc, x, ids, routing_weights, *args, I32(t), I32(a), I32(i), I32(k), I32(n), I32(num_experts)],
        shared_bytes=18 * k + 2 * 8 * SPLIT_CHUNK, pdl=pdl, device=x.device.index)
    return acc


def moe(x: torch.Tensor, router_gate: torch.Tensor, router_bias: torch.Tensor, top_k: int, scaling: float,
        gate: Weight, up: Weight, down: Weight, shared_gate: Weight | None = None,
        shared_up: Weight | None = None, shared_down: Weight | None = None,
        residual: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Router + gate/up + down: the MoE block of one layer (three launches), plus `residual`."""
    ids, weights = route(x, router_gate, router_bias, top_k, scaling, workspace=workspace)
    h = moe_gate_up(x, ids, gate, up, shared_gate, shared_up)
    return moe_down(h, ids, weights, down, shared_down, residual)


_ALL_OF = {2: "both", 3: "all three"}


def _shared_expert_args(fmt: str, device: torch.device,
                        *weights: tuple[str, Weight | None, tuple[int, int]]) -> tuple[list, bool]:
    """The shared expert's weight arguments (each (name, weight, shape)), checked, and whether there is
    one: all of them given, or none (null pointers in their places: 3 an NVFP4 weight, 1 a bf16 one)."""
    given = [w is not None for _, w, _ in weights]
    if not any(given):
        return [None] * (len(weights) * (3 if fmt == "nvfp4" else 1)), False
    if not all(given):
        names = ", ".join(name for name, _, _ in weights)
        raise ValueError(f"give {_ALL_OF[len(weights)]} shared expert weights ({names}), or none")
    return [arg for name, w, shape in weights for arg in weight_args(w, name, shape, device)], True


def _check_ids(ids: torch.Tensor, num_tokens: int, device: torch.device) -> int:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != num_tokens:
        raise ValueError(f"ids must be int32 [{num_tokens}, top_k]")
    check_tensor(ids, "ids", torch.int32, tuple(ids.shape), device, 4)
    if ids.numel() > MAX_PAIRS:
        raise ValueError(f"tokens x top_k must be <= {MAX_PAIRS}, got {ids.numel()}")
    return ids.shape[1]


def _out(t: torch.Tensor | None, name: str, dtype: torch.dtype, shape: tuple[int, ...],
         like: torch.Tensor) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    check_tensor(t, name, dtype, shape, like.device, 4)
    return t
