"""NVFP4 expert GEMMs for decode-sized steps (cuda/expert_decode.cu): the grouped MoE's gate/up and
down over rows sorted by expert, in items of `rows_per_item(config)` rows from a routing work list
built with that chunk (`route_and_sort(..., chunk=...)`). Same inputs and outputs as
moe_gate_up_sorted / moe_down_sorted (grouped_moe.py), fewer instructions per weight;
`expert_decode_moe`: both in one launch.

CONFIGS: compile-time settings (8-row groups per item, 16-row tiles per warp, whether a warp loads
its next round during this one); `pick_config` chooses by token count (CONFIG overrides it).
"""

from __future__ import annotations

import functools

import torch

from flint_sched.kernels import tickets
from flint_sched.kernels._runtime import F32, I32, Kernel, compile_kernel
from flint_sched.kernels.grouped import check_work_list
from flint_sched.kernels.linear import (Weight, cdiv, check_tensor, expert_args, moe_gate_up_args, output,
                                        weight_format)

WARPS = 4            # ED_WARPS unless a config sets it
TILE_ROWS = 16       # weight rows per tile (gate/up: 8 gate + 8 up)
K_ROUND = 512        # ED_KR: K must be a multiple
TABLE_BYTES = 1024   # the scale table before the staged x rows
MAX_SHARED_BYTES = 227 * 1024

CONFIGS = {
    "g1t1": {"ED_GROUPS": 1, "ED_TILES": 1},
    "g1t2": {"ED_GROUPS": 1, "ED_TILES": 2},
    "g1t4": {"ED_GROUPS": 1, "ED_TILES": 4},
    "g1t8": {"ED_GROUPS": 1, "ED_TILES": 8},
    "g1t4np": {"ED_GROUPS": 1, "ED_TILES": 4, "ED_PREFETCH": 0, "ED_MIN_CTAS": 6},
    "g2t4": {"ED_GROUPS": 2, "ED_TILES": 4},
    # 16-row items (an item of 8 rows or fewer runs one group), 8 warps a CTA sharing the staged x
    "g2w8t2": {"ED_GROUPS": 2, "ED_WARPS": 8, "ED_TILES": 2, "ED_MIN_CTAS": 2},
    "g2w8t4": {"ED_GROUPS": 2, "ED_WARPS": 8, "ED_TILES": 4, "ED_MIN_CTAS": 2},
    "g1w8t4": {"ED_GROUPS": 1, "ED_WARPS": 8, "ED_TILES": 4, "ED_MIN_CTAS": 2},
    # the down GEMM (K = 512: one round a tile) with 8 or 16 tiles a warp: fewer CTAs, each longer
    "g1t4d8": {"ED_GROUPS": 1, "ED_TILES": 4, "ED_TILES_DOWN": 8},
    "g2w8t4d8": {"ED_GROUPS": 2, "ED_WARPS": 8, "ED_TILES": 4, "ED_TILES_DOWN": 8, "ED_MIN_CTAS": 2},
    # staging x one chunk at a time (the rows' sources still read first; 4 at once by default)
    "g1t4s1": {"ED_GROUPS": 1, "ED_TILES": 4, "ED_STAGE_LOADS": 1},
    # two accumulators a group (ED_ACCS 2): g1t2a2, and g1t4d8 / g2w8t4 with it, gained nothing at 16-256
    # requests in the full model (RESULTS.md, session 14)
    "g1t4a2": {"ED_GROUPS": 1, "ED_TILES": 4, "ED_ACCS": 2},
    "g1t2a2": {"ED_GROUPS": 1, "ED_TILES": 2, "ED_ACCS": 2},
    # g1t2 with longer down units (at 16 tokens a g1t2 down unit is 2 rounds a warp): d4 -1.6 % at
    # 16 requests, d8 +6 % (RESULTS.md, session 17)
    "g1t2d4": {"ED_GROUPS": 1, "ED_TILES": 2, "ED_TILES_DOWN": 4},
    "g1t2d8": {"ED_GROUPS": 1, "ED_TILES": 2, "ED_TILES_DOWN": 8},
    # one launch only (expert_decode_moe): down units taking two items of an expert (ED_DOWN_PAIRS);
    # two launches run them as the config without. g2w8t4p -1 % at 192-256 requests; g1t2p +2 % at
    # 16-32, g1t4d8p +5 % at 64-128 (RESULTS.md, session 17)
    "g1t2p": {"ED_GROUPS": 1, "ED_TILES": 2, "ED_DOWN_PAIRS": 1},
    "g1t4d8p": {"ED_GROUPS": 1, "ED_TILES": 4, "ED_TILES_DOWN": 8, "ED_DOWN_PAIRS": 1},
    "g2w8t4p": {"ED_GROUPS": 2, "ED_WARPS": 8, "ED_TILES": 4, "ED_MIN_CTAS": 2, "ED_DOWN_PAIRS": 1},
    # (items of 24 rows, two CTAs a SM, or of 32 rows, one CTA of 16 warps, each expert's weights
    # decoded once for more of its rows, lost: MoE layer at 256 tokens 173.1 / 152.9 µs against
    # g2w8t4p's 136.4, full model at 256 requests 15.7 / 14.7 ms against 13.9; RESULTS.md, session 28)
    # one launch only: an item's units as one thread block cluster (ED_CLUSTER CTAs, each its gate/up
    # tile group, then the same down tile group after the cluster's barrier; x staged by the cluster
    # together; no queue). MoE layer alone (bench_grouped) at 9 / 12 / 16 / 24 tokens 44.1 / 52.4 / 53.7
    # / 70.0 µs against g1t2d4's 51.1 / 52.8 / 54.0 / 62.7 (x staged by each CTA: 50.6 / 52.5 / 53.4 /
    # 70.1); a cluster for g1t4d8 (4 CTAs: 64 tokens 84.0 / 84.0, the full model +0.2 ms) or a
    # 16-row g2w8t2d4 (128 / 256 tokens: 115.0 / 147.6 against g2w8t4p's 105.8 / 135.3) lost
    # (RESULTS.md, session 24)
    "g1t2d4c": {"ED_GROUPS": 1, "ED_TILES": 2, "ED_TILES_DOWN": 4, "ED_CLUSTER": 8},
}
# Tried from benchmarks/decode_moe_trace.py and not kept (MoE layer, bench_grouped, RESULTS.md session
# 22): x chunks staged from a line that depends on the CTA (all units read the same tokens' rows at
# once at 16 tokens), a unit's weight rows asked of L2 as it starts (down units, or every unit), and
# round q + 2 / q + 3 asked of L2 while round q computes: none faster, the L2 requests 4-20 % slower.
# Measured on the H200, Flint's MoE layer (benchmarks/bench_grouped.py --pdl --paths swap-ab decode
# --decode-configs ...), µs at 16 / 64 / 256 / 512 / 1024 tokens: swap-AB GEMMs 76 / 133 / 242 / 389
# / 726; g1t2 65 / 115 / 231 / 380 / 668; g1t4 81 / 106 / 212 / 326 / 574; g1t8 126 / 138 / 218 /
# 324 / 542; g2t4 117 / 169 / 258 / 382 / 638; g1t4 without the next round in flight 162 / 191 /
# 293 / 449 / 794 (RESULTS.md, session 9). In the full model (benchmarks/decode_configs.py, NVFP4,
# 1K context, ms a step, RESULTS.md session 12): g1t2 6.30 / 6.79 / 8.48 / 11.97 / 17.16 at 24 / 32
# / 64 / 128 / 256 requests; g1t4d8 6.54 / 6.76 / 7.70 / 11.07 / 16.35 (g1t4: 8.14 at 64, 16.98
# at 256: the down GEMM, one round a tile, gains from 8 tiles a warp); g2w8t4 6.90 / 7.26 / 8.40 /
# 11.76 / 15.94-16.08 (its 16-row items pay from ~200 requests, where the model's experts hold 7
# rows each at the median and the shared expert 256); g2t4 (16-row items, 4 warps: three CTAs a
# SM for gate/up's 72 KB of x) 11.21 at 64.
CONFIG: str | None = None   # a CONFIGS key for every call (benchmarks), or None: pick_config
# pick_config's choice: the first config whose token bound the call's tokens do not pass
# (session 17, ab_decode.py: g1t2d4 16: 4.97 / 4.98 against g1t2 5.07 / 5.04, 32: a tie; g2w8t4p 192:
# 12.44 / 12.41 against 12.58 / 12.49, 256: 14.78 / 14.83 against 15.01 / 14.96). Since session 21
# every config's prefetch loop has one copy of the round body (was two): 16 / 64 / 256 requests
# 5.40 / 5.34, 8.07 / 8.01, 15.33 / 15.41 -> 5.11 / 5.10, 7.97 / 7.95, 14.92 / 14.92 ms.
PICKS: tuple[tuple[int, str], ...] = ((16, "g1t2d4c"), (32, "g1t2d4"), (160, "g1t4d8"), (1 << 30, "g2w8t4p"))


def pick_config(num_tokens: int, hidden: int, inter: int) -> str:
    """The config for a call of num_tokens tokens (routed rows: num_tokens * top_k) of these shapes:
    measured above. A cluster config fits only shapes where an item takes as many gate/up as down
    units (Flint's 2048 / 512 do); the next pick is taken where it does not."""
    if CONFIG is not None:
        return CONFIG
    return next(config for bound, config in PICKS if num_tokens <= bound and fits(config, hidden, inter))


def cluster_size(config: str) -> int:
    """CTAs of an item's thread block cluster (ED_CLUSTER configs), else 0."""
    return CONFIGS[config].get("ED_CLUSTER", 0)


def fits(config: str, hidden: int, inter: int) -> bool:
    """Whether the config's one-launch kernel takes these shapes: a cluster config, an item's gate/up
    and down units one to one on its cluster's CTAs."""
    cluster = cluster_size(config)
    return not cluster or moe_units(config, hidden, inter) == (cluster, cluster)


def rows_per_item(config: str) -> int:
    """The routing chunk the config's items take."""
    return 8 * CONFIGS[config]["ED_GROUPS"]


TRACE_SLOTS = 8   # cuda/expert_decode_trace.cuh ED_TRACE_SLOTS: u64 a CTA of expert_decode_moe's trace


def _kernel(name: str, config: str, trace: bool = False) -> Kernel:
    return _compiled(name, config, trace, tickets.defines())


@functools.cache
def _compiled(name: str, config: str, trace: bool, extra: tuple) -> Kernel:
    return compile_kernel("expert_decode.cu", name, {**CONFIGS[config], **({"ED_TRACE": 1} if trace else {}),
                                                     **dict(extra)})


def x_row_bytes(k: int) -> int:
    """An x row in shared memory (cuda/expert_decode.cu x_row_bytes): K/8 16-byte chunks, rounded up
    to 4 (mod 8)."""
    slots = k // 8
    return (slots + (4 - slots) % 8) * 16


def shared_bytes(config: str, k: int) -> int:
    """The scale table and the item's x rows."""
    return TABLE_BYTES + rows_per_item(config) * x_row_bytes(k)


def moe_shared_bytes(config: str, hidden: int, inter: int) -> int:
    """expert_decode_moe's: the larger of a gate/up item's x rows (K = hidden) and a down unit's h
    rows (K = inter; two items' with ED_DOWN_PAIRS)."""
    down_rows = rows_per_item(config) * (2 if CONFIGS[config].get("ED_DOWN_PAIRS") else 1)
    return TABLE_BYTES + max(rows_per_item(config) * x_row_bytes(hidden), down_rows * x_row_bytes(inter))


def supported(fmt: str, hidden: int, inter: int, config: str = "g1t4") -> bool:
    """NVFP4 weights, K (hidden for gate/up, inter for down) a multiple of a load round (then I and
    hidden hold whole tiles too), the x rows within shared memory."""
    return (fmt == "nvfp4" and hidden % K_ROUND == 0 and inter % K_ROUND == 0
            and shared_bytes(config, max(hidden, inter)) <= MAX_SHARED_BYTES)


def warps(config: str) -> int:
    return CONFIGS[config].get("ED_WARPS", WARPS)


def _tile_groups(num_tiles: int, config: str, down: bool = False) -> int:
    """CTAs an item takes for num_tiles 16-row tiles (warps x tiles a warp each)."""
    tiles = CONFIGS[config]["ED_TILES"]
    return cdiv(num_tiles, warps(config) * (CONFIGS[config].get("ED_TILES_DOWN", tiles) if down else tiles))


def _grid(routing, num_tiles: int, config: str, down: bool = False) -> tuple[int, int]:
    return routing.max_items, _tile_groups(num_tiles, config, down)


def _check_routing(routing, rows_needed: int, num_experts: int, config: str) -> None:
    check_work_list(routing, rows_per_item(config), rows_needed, num_experts, f"expert_decode ({config})")


def _check_x(x: torch.Tensor, routing, num_experts: int, config: str) -> tuple[int, int]:
    """x bf16 [M, K] of the routing's M tokens, and the routing's work list; (M, K)."""
    m, k = x.shape
    check_tensor(x, "x", torch.bfloat16, (m, k), x.device)
    _check_routing(routing, routing.sorted_token.numel(), num_experts, config)
    if routing.pair_row.shape[0] != m:
        raise ValueError(f"x has {m} tokens, routing {routing.pair_row.shape[0]}")
    return m, k


def _check(fmt: str, hidden: int, inter: int, config: str, *weights: Weight) -> None:
    if any(w.block_scales.data_ptr() % 8 for w in weights):   # 8 scale bytes per lane and round
        raise ValueError("NVFP4 block scales must be 8-byte aligned for expert_decode")
    if not supported(fmt, hidden, inter, config):
        raise ValueError(f"expert_decode ({config}) needs NVFP4 weights, hidden {hidden} and intermediate {inter} "
                         f"multiples of {K_ROUND}")


def expert_decode_gate_up(x: torch.Tensor, routing, gate: Weight, up: Weight, shared_gate: Weight,
                          shared_up: Weight, out: torch.Tensor | None = None, pdl: bool = False,
                          config: str | None = None) -> torch.Tensor:
    """h_sorted [P, I]: row r = silu(x[t] @ Wg_e^T) * (x[t] @ Wu_e^T), t = sorted_token[r], e the
    expert of row r (E: shared_gate / shared_up); rows past the routed count are not written.
    config: a CONFIGS key (None: pick_config of x's rows)."""
    e, i = gate.shape[0], gate.shape[1]
    config = config or pick_config(x.shape[0], x.shape[1], i)
    _, k = _check_x(x, routing, e, config)
    _check(weight_format(gate, up, shared_gate, shared_up), k, i, config, gate, up, shared_gate, shared_up)
    args = moe_gate_up_args(gate, up, shared_gate, shared_up, i, k, e, x.device)
    h = output(out, "out", (routing.sorted_token.numel(), i), x)
    _kernel("expert_decode_gate_up_nvfp4", config).launch(
        _grid(routing, i // (TILE_ROWS // 2), config), (32 * warps(config),),
        [h, x, routing.sorted_token, *args, *routing.work_args, I32(i), I32(k), I32(e)],
        shared_bytes=shared_bytes(config, k), pdl=pdl, device=x.device.index)
    return h


def expert_decode_down(h: torch.Tensor, routing, down: Weight, shared_down: Weight, out: torch.Tensor | None = None,
                       pdl: bool = False, config: str | None = None) -> torch.Tensor:
    """y_sorted [P, N]: row r = h_sorted[r] @ Wd_e^T (e: the expert of row r, E the shared one).
    config: a CONFIGS key (None: pick_config of the routing's tokens)."""
    p, k = h.shape
    e, n = down.shape[0], down.shape[1]
    config = config or pick_config(routing.pair_row.shape[0], n, k)
    check_tensor(h, "h", torch.bfloat16, (p, k), h.device)
    _check_routing(routing, p, e, config)
    _check(weight_format(down, shared_down), n, k, config, down, shared_down)
    args = expert_args(down, shared_down, ("down", "shared_down"), n, k, e, h.device)
    y = output(out, "out", (p, n), h)
    _kernel("expert_decode_down_nvfp4", config).launch(
        _grid(routing, n // TILE_ROWS, config, down=True), (32 * warps(config),),
        [y, h, *args, *routing.work_args, I32(n), I32(k), I32(e)],
        shared_bytes=shared_bytes(config, k), pdl=pdl, device=h.device.index)
    return y


def _moe_outputs(x: torch.Tensor, routing, config: str, h_out: torch.Tensor, out: torch.Tensor | None,
                 gate: Weight, up: Weight, shared_gate: Weight, shared_up: Weight, down: Weight,
                 shared_down: Weight) -> tuple[torch.Tensor, list]:
    """What the one-launch kernels check alike (x and the routing checked already): h_out [P, I],
    down [E, K, I], the six weights NVFP4 of supported shapes; (y_sorted [P, N], the weights'
    kernel arguments: gate/up then down)."""
    e, i, k, n = gate.shape[0], gate.shape[1], x.shape[1], down.shape[1]
    p = routing.sorted_token.numel()
    check_tensor(h_out, "h_out", torch.bfloat16, (p, i), x.device)
    if n != k or tuple(down.shape) != (e, k, i):
        raise ValueError(f"down must be [{e}, {k}, {i}], got {tuple(down.shape)}")
    fmt = weight_format(gate, up, shared_gate, shared_up, down, shared_down)
    _check(fmt, k, i, config, gate, up, shared_gate, shared_up, down, shared_down)
    weight_args = [*moe_gate_up_args(gate, up, shared_gate, shared_up, i, k, e, x.device),
                   *expert_args(down, shared_down, ("down", "shared_down"), n, i, e, x.device)]
    return output(out, "out", (p, n), x), weight_args


def expert_decode_moe(x: torch.Tensor, routing, queue: torch.Tensor, gate: Weight, up: Weight,
                      shared_gate: Weight, shared_up: Weight, down: Weight, shared_down: Weight,
                      h_out: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False,
                      config: str | None = None, trace: torch.Tensor | None = None) -> torch.Tensor:
    """expert_decode_gate_up then expert_decode_down in one launch (cuda/expert_decode.cu
    expert_decode_moe_nvfp4): CTAs take gate/up units, then down units, each down unit starting
    once its item's gate/up units are done (configs with ED_CLUSTER: expert_decode_moe_cluster_nvfp4,
    an item's CTAs a cluster, each a gate/up unit and then a down unit). h_out: the h_sorted buffer
    [P, I]; queue: the routing workspace's (route_and_sort zeroes it; the cluster kernel takes none).
    Returns y_sorted [P, N].
    trace: int64 [grid CTAs, TRACE_SLOTS] (moe_grid_ctas): the ED_TRACE build, writing each CTA's
    %globaltimer (ns) at entry, unit taken, inputs ready, x staged, warp 0's rounds done and end
    (0 where a CTA did not get there), its SM and its unit (benchmarks/decode_moe_trace.py)."""
    e, i = gate.shape[0], gate.shape[1]
    config = config or pick_config(x.shape[0], x.shape[1], i)
    cluster = cluster_size(config)
    _, k = _check_x(x, routing, e, config)
    check_tensor(queue, "queue", torch.int32, (queue.numel(),), x.device, 4)
    if queue.numel() < routing.max_items + 1:
        raise ValueError(f"the queue needs {routing.max_items + 1} counters, has {queue.numel()}")
    y, weight_args = _moe_outputs(x, routing, config, h_out, out, gate, up, shared_gate, shared_up, down,
                                  shared_down)
    ctas = moe_grid_ctas(routing.max_items, config, k, i)
    moe_args = [*weight_args, *routing.work_args]
    if cluster:
        if trace is not None:
            raise ValueError(f"{config} has no trace build (its items run as clusters)")
        if not fits(config, k, i):
            raise ValueError(f"{config}: an item of hidden {k}, intermediate {i} takes {moe_units(config, k, i)} "
                             f"gate/up and down units, not {cluster} of each (its cluster)")
        _kernel("expert_decode_moe_cluster_nvfp4", config).launch(
            (ctas,), (32 * warps(config),), [y, h_out, x, routing.sorted_token, *moe_args, I32(i), I32(k), I32(e)],
            shared_bytes=moe_shared_bytes(config, k, i), pdl=pdl, device=x.device.index)
        return y
    if trace is not None:
        check_tensor(trace, "trace", torch.int64, (ctas, TRACE_SLOTS), x.device, 8)
    _kernel("expert_decode_moe_nvfp4", config, trace is not None).launch(
        (ctas,), (32 * warps(config),),
        [y, h_out, x, routing.sorted_token, *moe_args, queue, I32(i), I32(k), I32(e),
         *([] if trace is None else [trace])],
        shared_bytes=moe_shared_bytes(config, k, i), pdl=pdl, device=x.device.index)
    return y


ROUTE_MAX_TOKENS = 32    # cuda/expert_decode_cluster.cuh ED_ROUTE_MAX_TOKENS: a token mask is one word
ROUTE_MAX_TOP_K = 16     # ED_ROUTE_MAX_TOP_K
ROUTE_MAX_EXPERTS = 256  # cuda/topk.cuh ROUTER_MAX_EXPERTS as expert_decode.cu is built


def routes_in_cluster(config: str, tokens: int, num_experts: int, top_k: int, hidden: int, inter: int) -> bool:
    """Whether expert_decode_moe_routed takes this call: a cluster config that fits the shapes, and
    tokens, experts and top_k within the routed kernel's shared arrays."""
    return (cluster_size(config) > 0 and fits(config, hidden, inter) and tokens <= ROUTE_MAX_TOKENS
            and num_experts <= ROUTE_MAX_EXPERTS and top_k <= ROUTE_MAX_TOP_K)


def expert_decode_moe_routed(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                             routing, num_tokens: torch.Tensor | None, gate: Weight, up: Weight, shared_gate: Weight,
                             shared_up: Weight, down: Weight, shared_down: Weight, h_out: torch.Tensor,
                             out: torch.Tensor | None = None, pdl: bool = False,
                             config: str | None = None) -> torch.Tensor:
    """The routing and expert_decode_moe's cluster kernel in one launch (cuda/expert_decode.cu
    expert_decode_moe_routed_nvfp4, in expert_decode_cluster.cuh): each cluster takes the sigmoid top-k of the router's fp32
    logits (split-K parts [S, M, E] or [M, E], as route_and_sort) and derives its own item; the
    routing's views (grouped_moe.Routing: ids, weights, pair_row, offsets, sorted_token and the work
    list, not the queue) receive the same routing moe_route would give, items in expert order.
    Returns y_sorted [P, N]."""
    e, i = gate.shape[0], gate.shape[1]
    parts, m = (logits.shape[0], logits.shape[1]) if logits.dim() == 3 else (1, logits.shape[0])
    config = config or pick_config(m, x.shape[1], i)
    k = x.shape[1]
    if not routes_in_cluster(config, m, e, top_k, k, i):
        raise ValueError(f"expert_decode_moe_routed ({config}): {m} tokens, {e} experts, top_k {top_k}, hidden "
                         f"{k}, intermediate {i} (a cluster config, <= {ROUTE_MAX_TOKENS} tokens, <= "
                         f"{ROUTE_MAX_EXPERTS} experts, top_k <= {ROUTE_MAX_TOP_K})")
    _check_x(x, routing, e, config)
    if routing.ids.shape != (m, top_k):
        raise ValueError(f"the routing's ids must be [{m}, {top_k}], got {tuple(routing.ids.shape)}")
    y, weight_args = _moe_outputs(x, routing, config, h_out, out, gate, up, shared_gate, shared_up, down,
                                  shared_down)
    r = routing
    _kernel("expert_decode_moe_routed_nvfp4", config).launch(
        (moe_grid_ctas(r.max_items, config, k, i),), (32 * warps(config),),
        [y, h_out, x, r.sorted_token, r.ids, r.weights, r.pair_row, *r.work_args, *weight_args,
         logits, I32(parts), bias, num_tokens, I32(m), I32(top_k), F32(scaling), I32(i), I32(k), I32(e)],
        shared_bytes=moe_shared_bytes(config, k, i), pdl=pdl, device=x.device.index)
    return y


def moe_units(config: str, hidden: int, inter: int) -> tuple[int, int]:
    """expert_decode_moe's (gate/up, down) units an item: its tile groups."""
    return _tile_groups(inter // (TILE_ROWS // 2), config), _tile_groups(hidden // TILE_ROWS, config, down=True)


def moe_grid_ctas(max_items: int, config: str, hidden: int, inter: int) -> int:
    """expert_decode_moe's grid: every unit of the work list's most items (a cluster's CTAs an item
    where the config has them: each takes a gate/up and a down unit)."""
    cluster = cluster_size(config)
    return max_items * (cluster or sum(moe_units(config, hidden, inter)))
