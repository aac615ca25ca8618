"""A decode step's layers in one launch (cuda/decode_step.cu): the persistent decode of issue 17.

The fused path (<= 8 rows) launches ~9 kernels a layer; here one kernel of one CTA per SM runs the
same kernel bodies as tasks: each CTA walks its own list, and a task waits on a counter in global
memory (the operation before it finished) instead of a kernel boundary. `plan_tasks` lays the
operations of a layer range out over the CTAs; `DecodeStep` holds the lists, the pointer tables
and the step's intermediate buffers, static, so one CUDA graph replays the launch.

    layer i:  norm_in, qkv, qk_norm, attention, o_proj, norm_post, then router, gate_up, down (MoE)
              or dense_gate_up, dense_down (dense layers); every operation waits for the one before

Rows are hidden[0] of the fused path, updated in place; the LM head stays the graph path's.
With FOLD_NORMS the norm operations go: the tasks that read a normed row make it themselves; with
FUSE_QK the Q/K norm operation goes: the attention tasks normalize their query heads and write the
new K/V row themselves.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np
import torch

from flint_sched.config import FlintConfig
from flint_sched.kernels import attention as attn
from flint_sched.kernels._runtime import I32, Kernel, compile_kernel
from flint_sched.kernels._compiler import source_dir
from flint_sched.kernels.hardware import sm_count
from flint_sched.kernels.linear import MAX_TOKENS, weight_format
from flint_sched.kernels.moe import router_splits
from flint_sched.kernels.norm import MAX_VEC_PER_THREAD
from flint_sched.quant.nvfp4 import NVFP4Tensor

# Warps a CTA (cuda/decode_step.cu STEP_WARPS; every body built on them): 8, one CTA a SM (decode
# attention, a 4-warp body, leaves half idle), or 4, two CTAs a SM (each GEMV warp with a full
# round of NVFP4 loads, twice the task lists). Prepared without a GPU: measure both.
WARPS = 8
TASK_INTS = 8                    # StepTask: op, layer, begin, end, wait, target, signal, pad
GATE_UP_ROWS = 8                 # intermediate rows a gate/up tile (gate and up: 16 tile rows)
# The tasks of q/k/v, the router and gate/up normalize their rows themselves (rmsnorm.cu's body in
# each, the same bits) instead of waiting on a norm operation: two dependent hops a layer fewer.
# Prepared without a GPU (session 30): measure both (gpu_suite.sh decode-step).
FOLD_NORMS = False
# The router selection's bound in the build (cuda/topk.cuh's default; the graph path builds 1024 too)
ROUTER_MAX_EXPERTS = 256
# The attention tasks do the Q/K norms, RoPE and the K/V write (qk_norm_rope_kv.cu's arithmetic, the
# same bits) instead of waiting on a qk_norm operation: one dependent hop a layer fewer; a build of
# its own (STEP_FUSE_QK). Prepared without a GPU (session 30): measure both.
FUSE_QK = False
# A task's wait where its body calls pdl_wait, after its first weight loads (as at a kernel boundary
# with PDL), instead of before the body: not for expert down and gate/up, nor for a task that first
# normalizes its rows or writes K/V (cuda/decode_step.cu defers_wait). Session 31: the launched
# kernels' first weights arrive during the wait, the persistent step's only after it. Same bits.
# Measured (H100, NVFP4, 1K, RESULTS.md session 36): the step 4.06 -> 3.85 ms at batch 1, 6.79 ->
# 6.68 at batch 4, against 2.19 / 3.22 launched. Off, as the step is.
EARLY_WEIGHTS = False
# Steps built while set stamp every task (DecodeStep.phase_times; benchmarks/bench_decode_step.py).
TRACE = False
# The SMs a step's CTAs occupy (None: all). A probe (bench_decode_step.py's -sN): with half the SMs,
# an operation whose tiles run one after another on a CTA takes twice its time.
SMS = None

# The enums of cuda/decode_step.cu, in order (tests/test_decode_step.py reads them from the source).
OPS = ("NORM_IN", "QKV", "QK_NORM", "ATTENTION", "O_PROJ", "NORM_POST", "ROUTER", "GATE_UP", "DOWN",
       "DENSE_GATE_UP", "DENSE_DOWN")
STEP_PTRS = ("H", "X", "QKV", "Q", "ATTN", "ROUTER_PARTIAL", "ROUTER_TICKET", "IDS", "ROUTE_WEIGHTS", "MOE_H",
             "DENSE_H", "POSITIONS", "SEQ_LENS", "RING_SLOTS", "BLOCK_TABLES", "ATTN_TICKETS", "ATTN_PARTIALS",
             "ROPE_INV_FREQ", "LAYERS")
STEP_INTS = ("ROWS", "HIDDEN", "HEADS", "KV_HEADS", "MOE_I", "DENSE_I", "EXPERTS", "TOP_K", "ROUTER_SPLITS",
             "SPLITS_SLIDING", "SPLITS_FULL", "ONE_SPLIT_SLIDING", "ONE_SPLIT_FULL", "TABLE_STRIDE", "BLOCK_SIZE",
             "RING_ROWS", "WINDOW", "SINKS_BF16", "HAS_SHARED", "EPS", "SCALING", "SCALE_LOG2", "FOLD_NORMS",
             "EARLY_WEIGHTS")
_WEIGHTS = ("QKV", "O", "GATE", "UP", "DOWN", "SHARED_GATE", "SHARED_UP", "SHARED_DOWN")
LAYER_PTRS = ("IN_NORM", "POST_NORM", "QKV", "QKV_1", "QKV_2", "Q_NORM", "K_NORM", "SINKS", "K_POOL", "V_POOL",
              "O", "O_1", "O_2", "ROUTER", "ROUTER_BIAS", "GATE", "GATE_1", "GATE_2", "UP", "UP_1", "UP_2",
              "DOWN", "DOWN_1", "DOWN_2", "SHARED_GATE", "SHARED_GATE_1", "SHARED_GATE_2", "SHARED_UP",
              "SHARED_UP_1", "SHARED_UP_2", "SHARED_DOWN", "SHARED_DOWN_1", "SHARED_DOWN_2", "QKV_SPLIT1",
              "QKV_SPLIT2", "SLIDING")
OP = {name: i for i, name in enumerate(OPS)}
SP = {name: i for i, name in enumerate(STEP_PTRS)}
SI = {name: i for i, name in enumerate(STEP_INTS)}
LP = {name: i for i, name in enumerate(LAYER_PTRS)}


def cuda_enum(name: str) -> tuple[str, ...]:
    """The member names of `enum name` in cuda/decode_step.cu, prefix and _COUNT dropped."""
    text = (source_dir() / "decode_step.cu").read_text()
    body = re.search(r"enum %s \{(.*?)\};" % name, text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    members = [m.strip() for m in body.split(",") if m.strip()]
    return tuple(m.split("_", 1)[1] for m in members if not m.endswith("_COUNT"))


# ---- the plan -------------------------------------------------------------------------------------


def layer_ops(config: FlintConfig, layer: int, fold_norms: bool = False, fuse_qk: bool = False) -> tuple[str, ...]:
    """The operations of one layer, in order (fold_norms: without the norms; fuse_qk: without the
    Q/K norm; see FOLD_NORMS, FUSE_QK)."""
    mlp = ("ROUTER", "GATE_UP", "DOWN") if config.is_moe(layer) else ("DENSE_GATE_UP", "DENSE_DOWN")
    ops = ("NORM_IN", "QKV", "QK_NORM", "ATTENTION", "O_PROJ", "NORM_POST") + mlp
    return tuple(op for op in ops if not (fold_norms and op.startswith("NORM") or fuse_qk and op == "QK_NORM"))


@dataclass(frozen=True)
class Plan:
    """Task lists: tasks int32 [n, TASK_INTS] (each CTA's contiguous, from task_start[c]),
    task_start int32 [grid + 1], and the counters the tasks use (one per operation of the range)."""
    tasks: np.ndarray
    task_start: np.ndarray
    num_counters: int

    @property
    def grid(self) -> int:
        return len(self.task_start) - 1


def plan_tasks(phases: list[tuple[int, int, int]], grid: int) -> Plan:
    """Lay out phases (op, layer, tiles), in order, over `grid` CTAs. Phase p's tiles go to CTAs as
    contiguous ranges (one task a CTA; with fewer tiles than CTAs one tile a task, on CTAs after
    the previous small phase's, so that consecutive small phases land on different SMs). Every task
    of phase p waits for counter p - 1 to reach the task count of phase p - 1 and bumps counter p."""
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    per_cta: list[list[list[int]]] = [[] for _ in range(grid)]
    previous, offset = 0, 0
    for p, (op, layer, tiles) in enumerate(phases):
        if tiles < 1:
            raise ValueError(f"phase {p} ({OPS[op]}, layer {layer}) has no tiles")
        wait, target = (p - 1, previous) if p else (-1, 0)
        if tiles >= grid:
            bounds = [c * tiles // grid for c in range(grid + 1)]
            for c in range(grid):
                per_cta[c].append([op, layer, bounds[c], bounds[c + 1], wait, target, p, 0])
            previous = grid
        else:
            for i in range(tiles):
                per_cta[(offset + i) % grid].append([op, layer, i, i + 1, wait, target, p, 0])
            offset = (offset + tiles) % grid
            previous = tiles
    start = np.zeros(grid + 1, dtype=np.int32)
    start[1:] = np.cumsum([len(t) for t in per_cta])
    rows = [task for cta in per_cta for task in cta]
    tasks = np.array(rows, dtype=np.int32).reshape(len(rows), TASK_INTS)
    return Plan(tasks, start, len(phases))


def attention_splits(rows: int, max_keys: int, kv_heads: int, grid: int) -> int:
    """Splits per (row, KV head) of the persistent step: one task per CTA when the keys allow
    (>= MIN_SPLIT_KEYS a split), as the graph path fills its wave."""
    by_keys = max(1, -(-max_keys // attn.MIN_SPLIT_KEYS))
    return min(max(1, grid // (rows * kv_heads)), by_keys, attn.MAX_SPLITS)


def step_phases(config: FlintConfig, rows: int, first: int, last: int, splits: dict[bool, int],
                fold_norms: bool = False, warps: int = 8, fuse_qk: bool = False) -> list:
    """(op, layer, tiles) of layers [first, last); splits[sliding]: attention splits a (row, KV head);
    warps: the CTA's (the Q/K norms take a head a warp)."""
    c = config
    heads, g = c.num_attention_heads, c.num_key_value_heads
    tiles = {
        "NORM_IN": rows, "NORM_POST": rows,
        "QKV": -(-(heads + 2 * g) * attn.HEAD_DIM // 16),
        "QK_NORM": rows * -(-(heads + 2 * g) // warps),
        "O_PROJ": -(-c.hidden_size // 16), "DOWN": -(-c.hidden_size // 16), "DENSE_DOWN": -(-c.hidden_size // 16),
        "ROUTER": -(-c.n_routed_experts // 16) * router_splits(c.n_routed_experts, c.hidden_size),
        "GATE_UP": -(-c.moe_intermediate_size // GATE_UP_ROWS) * (rows * c.num_experts_per_tok
                                                                  + int(bool(c.n_shared_experts))),
        "DENSE_GATE_UP": -(-c.intermediate_size // GATE_UP_ROWS),
    }
    phases = []
    for i in range(first, last):
        for name in layer_ops(c, i, fold_norms, fuse_qk):
            n = rows * g * splits[c.is_sliding(i)] if name == "ATTENTION" else tiles[name]
            phases.append((OP[name], i, n))
    return phases


# ---- the launch -------------------------------------------------------------------------------------


@functools.cache
def _kernel(fmt: str, defines: tuple) -> Kernel:
    return compile_kernel("decode_step.cu", f"decode_step_{fmt}", dict(defines))


def kernel_defines(kv_dtype: torch.dtype, warps: int = 8, fuse_qk: bool = False) -> tuple:
    """Compile-time settings: the CTA's warps, the fused Q/K norms (FUSE_QK), the attention's by KV
    dtype (as kernels/attention.py builds its kernel); the GEMVs load each activation next to its mma
    (X_BATCH 0: with 1, the BF16 build spilled at the 255 registers a thread of one 8-warp CTA a SM)."""
    if warps not in (4, 8):
        raise ValueError(f"the persistent step runs CTAs of 4 or 8 warps, not {warps}")
    fp8 = kv_dtype == torch.float8_e4m3fn
    defines = [("STEP_WARPS", warps), ("X_BATCH", 0), ("ATTN_MIN_SPLIT_KEYS", attn.MIN_SPLIT_KEYS)]
    if fuse_qk:
        defines.append(("STEP_FUSE_QK", 1))
    if fp8:
        defines += [("KV_FP8", 1), ("ATTN_STAGES", attn.FP8_STAGES)]
    if kv_dtype in attn.CP_ASYNC_DTYPES:
        defines.append(("ATTN_CP_ASYNC", 1))
    return tuple(defines)


def _weight_ptrs(w) -> list[int]:
    if isinstance(w, NVFP4Tensor):
        return [w.codes.data_ptr(), w.block_scales.data_ptr(), w.tensor_scale.data_ptr()]
    return [w.data_ptr(), 0, 0]


def supported(config: FlintConfig, w: dict, qkv: dict, rows: int, warps: int | None = None) -> str | None:
    """Why the persistent step cannot run this model at `rows` rows, or None: every GEMV weight of
    one format (the kernel is built per format), <= 8 rows (one mma column group), the small MoE's
    pair limit, the attention kernels' head shape, the build's router and norm bounds (CTAs of
    `warps` warps, default WARPS)."""
    warps = WARPS if warps is None else warps
    if not 1 <= rows <= MAX_TOKENS:
        return f"rows {rows} outside 1..{MAX_TOKENS}"
    c = config
    if c.head_dim != attn.HEAD_DIM or c.num_attention_heads != attn.GROUP * c.num_key_value_heads:
        return "head_dim 128 and 8 query heads per KV head only"
    if rows * c.num_experts_per_tok > 64:
        return "rows x top_k > 64"
    if c.n_routed_experts > ROUTER_MAX_EXPERTS:     # the build's router selection (cuda/topk.cuh)
        return f"more than {ROUTER_MAX_EXPERTS} routed experts"
    if c.hidden_size % 8 or c.hidden_size > 8 * MAX_VEC_PER_THREAD * 32 * warps:
        return f"hidden size {c.hidden_size}: the norm body holds 8 x {MAX_VEC_PER_THREAD} values a thread"
    names = [qkv[i][0] for i in range(c.num_hidden_layers)]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names.append(w[p + "self_attn.o_proj.weight"])
        if c.is_moe(i):
            names += [w[p + f"mlp.experts.{n}_proj.weight"] for n in ("gate", "up", "down")]
            if c.n_shared_experts:
                names += [w[p + f"mlp.shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")]
        else:
            names += [w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")]
    formats = {weight_format(t) for t in names}
    if len(formats) != 1:
        return f"weights of several formats ({', '.join(sorted(formats))})"
    return None


def layer_table(config: FlintConfig, w: dict, qkv: dict, pools: list, first: int, last: int) -> np.ndarray:
    """int64 [layers, LAYER_PTRS]: each layer of [first, last)'s weights, norms, sinks and KV pools
    (pools[i - first]: its (K, V) ring or paged pool), zeros elsewhere."""
    c = config
    layers = np.zeros((c.num_hidden_layers, len(LAYER_PTRS)), dtype=np.int64)
    for i in range(first, last):
        p, row = f"model.layers.{i}.", layers[i]
        qkv_w, (split1, split2) = qkv[i]
        row[LP["IN_NORM"]] = w[p + "input_layernorm.weight"].data_ptr()
        row[LP["POST_NORM"]] = w[p + "post_attention_layernorm.weight"].data_ptr()
        row[LP["QKV"]:LP["QKV"] + 3] = _weight_ptrs(qkv_w)
        row[LP["QKV_SPLIT1"]], row[LP["QKV_SPLIT2"]] = split1, split2
        row[LP["Q_NORM"]] = w[p + "self_attn.q_norm.weight"].data_ptr()
        row[LP["K_NORM"]] = w[p + "self_attn.k_norm.weight"].data_ptr()
        row[LP["SINKS"]] = w[p + "self_attn.sinks"].data_ptr()
        pool = pools[i - first]
        row[LP["K_POOL"]], row[LP["V_POOL"]] = pool[0].data_ptr(), pool[1].data_ptr()
        row[LP["SLIDING"]] = int(c.is_sliding(i))
        row[LP["O"]:LP["O"] + 3] = _weight_ptrs(w[p + "self_attn.o_proj.weight"])
        if c.is_moe(i):
            row[LP["ROUTER"]] = w[p + "mlp.gate.weight"].data_ptr()
            row[LP["ROUTER_BIAS"]] = w[p + "mlp.gate.e_score_correction_bias"].data_ptr()
            for n in ("gate", "up", "down"):
                row[LP[n.upper()]:LP[n.upper()] + 3] = _weight_ptrs(w[p + f"mlp.experts.{n}_proj.weight"])
                if c.n_shared_experts:
                    name = "SHARED_" + n.upper()
                    row[LP[name]:LP[name] + 3] = _weight_ptrs(w[p + f"mlp.shared_experts.{n}_proj.weight"])
        else:
            for n in ("gate", "up", "down"):
                row[LP[n.upper()]:LP[n.upper()] + 3] = _weight_ptrs(w[p + f"mlp.{n}_proj.weight"])
    return layers


class DecodeStep:
    """Layers [first, last) of a fused decode step of `rows` rows as one launch.

    weights: executor/kernel_ops.py KernelWeights (weights by name, fused q/k/v, KV cache,
    workspaces); inputs: the step's DecodeInputs; hidden: the [rows, hidden] rows (hidden[0]),
    updated in place. Everything the launch reads is static here, so it can be captured.
    """

    def __init__(self, weights, inputs, hidden: torch.Tensor, rows: int, first: int, last: int,
                 grid: int | None = None, fold_norms: bool | None = None, trace: bool | None = None,
                 warps: int | None = None, fuse_qk: bool | None = None, early_weights: bool | None = None):
        """fold_norms, trace (stamp every task: `phase_times`), warps, fuse_qk, early_weights: FOLD_NORMS,
        TRACE, WARPS, FUSE_QK, EARLY_WEIGHTS by default; grid: every CTA that fits at once (8 // warps a SM,
        fewer if the driver's occupancy says so)."""
        c, w, dev = weights.config, weights.w, hidden.device
        why = supported(c, w, weights.qkv, rows, WARPS if warps is None else warps)
        if why is not None:
            raise ValueError(f"the persistent decode step cannot run this model: {why}")
        self.rows, self.first, self.last = rows, first, last
        self.warps = WARPS if warps is None else warps
        kv = weights.kv
        g, heads = c.num_key_value_heads, c.num_attention_heads
        self.fmt = weight_format(weights.qkv[first][0])
        pools = [kv.ring[kv.ring_index[i]] if c.is_sliding(i) else kv.full[kv.full_index[i]]
                 for i in range(first, last)]
        kv_dtype = pools[0].dtype
        self.fuse_qk = FUSE_QK if fuse_qk is None else fuse_qk
        self.kernel = _kernel(self.fmt, kernel_defines(kv_dtype, self.warps, self.fuse_qk))
        smem_attn = attn.fp8_smem_bytes(attn.FP8_STAGES) if kv_dtype == torch.float8_e4m3fn else attn.ATTN_SMEM_BYTES
        self.shared_bytes = max(smem_attn, rows * c.n_routed_experts * 4)
        if grid is None:       # every CTA resident at once (they wait on each other): as many as fit
            per_sm = 8 // self.warps
            if dev.type == "cuda":
                per_sm = min(per_sm, self.kernel.resident_blocks(32 * self.warps, self.shared_bytes, dev.index))
                if per_sm < 1:
                    raise ValueError(f"the persistent step's CTA ({self.warps} warps, {self.shared_bytes} B of "
                                     "dynamic shared memory) does not fit a SM")
            grid = (sm_count(dev) if SMS is None else min(SMS, sm_count(dev))) * per_sm
        self.grid = grid
        splits = {True: attention_splits(rows, c.sliding_window, g, self.grid),
                  False: attention_splits(rows, inputs.max_model_len, g, self.grid)}
        self.fold_norms = FOLD_NORMS if fold_norms is None else fold_norms
        self.early_weights = EARLY_WEIGHTS if early_weights is None else early_weights
        self.phases = step_phases(c, rows, first, last, splits, self.fold_norms, self.warps, self.fuse_qk)
        self.plan = plan_tasks(self.phases, self.grid)

        def zeros(*shape, dtype=torch.bfloat16):
            return torch.zeros(*shape, dtype=dtype, device=dev)
        a = c.num_experts_per_tok
        self.x = zeros(self.grid if self.fold_norms else 1, rows, c.hidden_size)   # folded: a slot a CTA
        self.qkv = zeros(rows, (heads + 2 * g) * attn.HEAD_DIM)
        self.q = zeros(self.grid if self.fuse_qk else rows, heads, attn.HEAD_DIM)   # fused: a slot a CTA
        self.attn = zeros(rows, heads * attn.HEAD_DIM)
        self.ids = zeros(rows, a, dtype=torch.int32)
        self.route_weights = zeros(rows, a, dtype=torch.float32)
        self.moe_h = zeros(rows, a + 1, c.moe_intermediate_size)
        self.dense_h = zeros(rows, c.intermediate_size)
        router, workspace = weights.workspaces.router, weights.workspaces.attention
        r_splits = router_splits(c.n_routed_experts, c.hidden_size)
        if router.numel() < r_splits * rows * c.n_routed_experts + 1:
            raise ValueError("the router workspace is too small for the persistent step")
        if workspace.numel() < attn.TICKET_SLOTS + rows * g * max(splits.values()) * attn.PARTIAL_FLOATS:
            raise ValueError(f"the attention workspace has no room for {max(splits.values())} splits of {rows} rows")

        self.layers = torch.from_numpy(layer_table(c, w, weights.qkv, pools, first, last)).to(dev)
        sinks = w[f"model.layers.{first}.self_attn.sinks"]

        ptrs = {
            "H": hidden, "X": self.x, "QKV": self.qkv, "Q": self.q, "ATTN": self.attn,
            "ROUTER_PARTIAL": router, "ROUTER_TICKET": router[router.numel() - 1:], "IDS": self.ids,
            "ROUTE_WEIGHTS": self.route_weights, "MOE_H": self.moe_h, "DENSE_H": self.dense_h,
            "POSITIONS": inputs.positions, "SEQ_LENS": inputs.seq_lens, "RING_SLOTS": inputs.ring_slots,
            "BLOCK_TABLES": inputs.block_tables, "ATTN_TICKETS": workspace,
            "ATTN_PARTIALS": workspace[attn.TICKET_SLOTS:],
            "ROPE_INV_FREQ": attn.rope_inv_freq(float(c.rope_theta), dev), "LAYERS": self.layers,
        }
        self.step_ptrs = torch.tensor([ptrs[n].data_ptr() for n in STEP_PTRS], dtype=torch.int64, device=dev)
        # what the tables point at stays alive as long as they do (a workspace or cache replaced
        # under a built step would otherwise be freed while its launches still read it)
        self.referenced = (ptrs, pools, weights.w, weights.qkv)
        f32 = lambda v: int(np.float32(v).view(np.int32))  # noqa: E731 - a float's bits as an int argument
        ints = {
            "ROWS": rows, "HIDDEN": c.hidden_size, "HEADS": heads, "KV_HEADS": g,
            "MOE_I": c.moe_intermediate_size, "DENSE_I": c.intermediate_size, "EXPERTS": c.n_routed_experts,
            "TOP_K": a, "ROUTER_SPLITS": r_splits, "SPLITS_SLIDING": splits[True], "SPLITS_FULL": splits[False],
            "ONE_SPLIT_SLIDING": 0, "ONE_SPLIT_FULL": 0, "TABLE_STRIDE": inputs.block_tables.shape[1],
            "BLOCK_SIZE": kv.full.shape[3], "RING_ROWS": kv.ring.shape[3], "WINDOW": c.sliding_window,
            "SINKS_BF16": int(sinks.dtype == torch.bfloat16), "HAS_SHARED": int(bool(c.n_shared_experts)),
            "EPS": f32(c.rms_norm_eps), "SCALING": f32(c.routed_scaling_factor),
            "SCALE_LOG2": f32(attn.LOG2E / np.sqrt(attn.HEAD_DIM)), "FOLD_NORMS": int(self.fold_norms),
            "EARLY_WEIGHTS": int(self.early_weights),
        }
        self.step_ints = torch.tensor([ints[n] for n in STEP_INTS], dtype=torch.int32, device=dev)
        self.tasks = torch.from_numpy(self.plan.tasks).to(dev)
        self.task_start = torch.from_numpy(self.plan.task_start).to(dev)
        self.counters = zeros(self.plan.num_counters + 1, dtype=torch.int32)
        self.trace = zeros(len(self.plan.tasks), 3, dtype=torch.int64) if (TRACE if trace is None else trace) else None

    def launch(self, pdl: bool = False) -> None:
        """The layers, on the current stream (after the kernel that wrote hidden[0])."""
        self.kernel.launch((self.grid,), (32 * self.warps,),
                           [self.tasks, self.task_start, self.counters, I32(self.plan.num_counters),
                            self.step_ptrs, self.step_ints, self.trace],
                           shared_bytes=self.shared_bytes, pdl=pdl, device=self.tasks.device.index)

    def phase_times(self) -> list[dict]:
        """With trace: each phase of the last launch as {op, layer, start, ready, end} in µs from the
        launch's first stamp: `start` its first task's wait began, `ready` its last task's wait
        ended (the operation before it was done and seen), `end` its last task was done."""
        if self.trace is None:
            raise ValueError("DecodeStep(trace=True) records the stamps")
        stamps = self.trace.cpu().numpy()
        origin = stamps[:, 0].min()
        by_phase: dict[int, list] = {}
        for task, (t0, t1, t2) in zip(self.plan.tasks, stamps, strict=True):
            by_phase.setdefault(int(task[6]), []).append((t0, t1, t2))
        out = []
        for p, (op, layer, _) in enumerate(self.phases):
            t = np.array(by_phase[p], dtype=np.int64) - origin
            out.append({"op": OPS[op], "layer": layer, "start": t[:, 0].min() / 1e3, "ready": t[:, 1].max() / 1e3,
                        "end": t[:, 2].max() / 1e3})
        return out
