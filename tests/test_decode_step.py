"""The persistent decode step's host side (kernels/decode_step.py), on the CPU: the task lists
cuda/decode_step.cu walks (every tile once, each operation after the one before, no deadlock in any
order the CTAs may run), the tables' layouts against the kernel's enums, its builds (NVRTC), and
forward() handing a layer range to ops that run it in one go."""

import random

import numpy as np
import pytest
import torch

from flint_sched.config import preset
from flint_sched.executor import kernel_ops
from flint_sched.executor.forward import forward
from flint_sched.kernels import VARIANTS, _runtime
from flint_sched.kernels import decode_step as ds

WAIT, TARGET, SIGNAL = 4, 5, 6


@pytest.mark.parametrize("name,ours", [("StepOp", ds.OPS), ("StepPtr", ds.STEP_PTRS), ("StepInt", ds.STEP_INTS),
                                       ("LayerPtr", ds.LAYER_PTRS)])
def test_the_tables_follow_the_kernels_enums(name, ours):
    assert ds.cuda_enum(name) == ours


def run_plan(plan: ds.Plan, rng: random.Random) -> list[tuple[int, int, int]]:
    """Run the CTAs' lists as the kernel does (a CTA's next task starts once its counter is reached),
    choosing at random among the CTAs that can go on; returns (phase, op, tile) in the order run.
    Fails on a deadlock (no CTA can go on before all are done)."""
    counters = [0] * plan.num_counters
    heads = [int(plan.task_start[c]) for c in range(plan.grid)]
    done: list[tuple[int, int, int]] = []
    while True:
        ready = [c for c in range(plan.grid) if heads[c] < plan.task_start[c + 1]
                 and (plan.tasks[heads[c], WAIT] < 0 or counters[plan.tasks[heads[c], WAIT]] >= plan.tasks[heads[c], TARGET])]
        if not ready:
            break
        c = rng.choice(ready)
        op, layer, begin, end, _, _, signal, _ = plan.tasks[heads[c]]
        done += [(int(signal), int(op), i) for i in range(begin, end)]
        counters[signal] += 1
        heads[c] += 1
    assert all(heads[c] == plan.task_start[c + 1] for c in range(plan.grid)), "deadlock: tasks left, none can start"
    return done


@pytest.mark.parametrize("grid", [1, 3, 132])
def test_the_plan_runs_every_tile_once_each_operation_after_the_one_before(grid):
    phases = [(ds.OP["NORM_IN"], 0, 1), (ds.OP["QKV"], 0, 320), (ds.OP["QK_NORM"], 0, 5),
              (ds.OP["ATTENTION"], 0, 132), (ds.OP["O_PROJ"], 0, 128), (ds.OP["NORM_POST"], 1, 2)]
    plan = ds.plan_tasks(phases, grid)
    assert plan.tasks.shape[1] == ds.TASK_INTS and plan.num_counters == len(phases)
    for seed in range(5):
        order = run_plan(plan, random.Random(seed))
        assert sorted(order) == sorted((p, op, i) for p, (op, _, n) in enumerate(phases) for i in range(n))
        phase_seen = [p for p, _, _ in order]
        assert phase_seen == sorted(phase_seen), "a tile ran before the operation before it had finished"
    for c in range(grid):                   # each CTA's list in operation order, a task per phase at most
        mine = plan.tasks[plan.task_start[c]:plan.task_start[c + 1]]
        assert list(mine[:, SIGNAL]) == sorted(set(mine[:, SIGNAL]))


def test_small_operations_land_on_different_ctas():
    """Consecutive phases of few tiles (a norm, the Q/K norms) go to CTAs after the previous one's,
    so one SM does not carry every small hop of the chain."""
    plan = ds.plan_tasks([(0, 0, 1), (2, 0, 5), (0, 0, 1)], 8)
    owner = {}
    for c in range(8):
        for task in plan.tasks[plan.task_start[c]:plan.task_start[c + 1]]:
            owner.setdefault(int(task[SIGNAL]), []).append(c)
    assert owner == {0: [0], 1: [1, 2, 3, 4, 5], 2: [6]}


def test_a_phase_without_tiles_is_refused():
    with pytest.raises(ValueError, match="no tiles"):
        ds.plan_tasks([(0, 0, 0)], 4)


@pytest.mark.parametrize("rows", [1, 8])
def test_flints_phases(rows):
    """Flint's layers: 9 operations a MoE layer, 8 a dense one (layers 0-1), tile counts as the kernel
    splits them (16-row GEMV tiles, 8-row gate/up tiles for each chosen expert and the shared one)."""
    c = preset("flint")
    phases = ds.step_phases(c, rows, 0, c.num_hidden_layers, {True: 9, False: 33})
    assert len(phases) == 2 * 8 + 47 * 9
    by = {(ds.OPS[op], layer): n for op, layer, n in phases}
    assert by["QKV", 5] == (32 + 8) * 128 // 16 and by["O_PROJ", 5] == 2048 // 16
    assert by["GATE_UP", 5] == 512 // 8 * (rows * 6 + 1) and by["DOWN", 5] == 128
    assert by["ROUTER", 5] == 16 * ds.router_splits(256, 2048) and ds.router_splits(256, 2048) == 8
    assert by["DENSE_GATE_UP", 0] == 10240 // 8 and ("ROUTER", 0) not in by
    assert by["ATTENTION", 0] == rows * 4 * 9 and by["ATTENTION", 3] == rows * 4 * 33      # layer 3: full
    assert by["QK_NORM", 5] == rows * 5 and by["NORM_IN", 5] == rows
    four = ds.step_phases(c, rows, 5, 6, {True: 9, False: 33}, warps=4)       # a head a warp
    assert [n for op, _, n in four if ds.OPS[op] == "QK_NORM"] == [rows * 10]
    plan = ds.plan_tasks(phases, 132)
    assert run_plan(plan, random.Random(1))


def test_folded_norms_and_fused_qk_leave_their_operations_out():
    c = preset("flint")
    phases = ds.step_phases(c, 1, 0, 4, {True: 9, False: 33}, fold_norms=True)
    assert [ds.OPS[op] for op, layer, _ in phases if layer == 3] == [
        "QKV", "QK_NORM", "ATTENTION", "O_PROJ", "ROUTER", "GATE_UP", "DOWN"]
    assert [ds.OPS[op] for op, layer, _ in phases if layer == 0] == [
        "QKV", "QK_NORM", "ATTENTION", "O_PROJ", "DENSE_GATE_UP", "DENSE_DOWN"]
    phases = ds.step_phases(c, 1, 3, 4, {True: 9, False: 33}, fold_norms=True, fuse_qk=True)
    assert [ds.OPS[op] for op, _, _ in phases] == ["QKV", "ATTENTION", "O_PROJ", "ROUTER", "GATE_UP", "DOWN"]


def test_attention_splits_fill_the_grid_within_the_keys():
    assert ds.attention_splits(1, 513, 4, 132) == 9          # 513 keys: 9 splits of >= 64
    assert ds.attention_splits(1, 8192, 4, 132) == 33        # one task a CTA
    assert ds.attention_splits(8, 8192, 4, 132) == 4
    assert ds.attention_splits(8, 10, 4, 16) == 1


def test_unsupported_shapes_are_named():
    c = preset("flint-tiny")
    assert "rows 9" in ds.supported(c, {}, {}, 9)


def test_the_kernel_builds_are_the_compile_tests_variants():
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for warps in (4, 8):
            for fuse_qk in (False, True):
                assert dict(ds.kernel_defines(dtype, warps, fuse_qk)) in VARIANTS["decode_step.cu"]
    with pytest.raises(ValueError, match="4 or 8 warps"):
        ds.kernel_defines(torch.bfloat16, 16)


available, why = _runtime.nvrtc_available()


@pytest.mark.skipif(not available, reason=f"NVRTC cannot be imported: {why}")
@pytest.mark.usefixtures("private_cache")
@pytest.mark.parametrize("fuse_qk", [False, True], ids=["qk-norm-tasks", "fused-qk"])
@pytest.mark.parametrize("warps", [8, 4])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-kv", "e4m3-kv"])
def test_the_kernel_fits_its_ctas_on_a_sm(kv_dtype, warps, fuse_qk):
    """8 // warps CTAs a SM: registers within the 64 K of a SM for all of them. Spills: the kernel
    sits at the 255-register ceiling, where ptxas moves a few values of the task loop to the stack
    in some builds and not in others as unrelated lines change (0-30 bytes, session 30); a body
    that did not fit would spill far more."""
    from flint_sched.kernels import _compiler
    usage = _compiler.resource_usage("decode_step.cu", dict(ds.kernel_defines(kv_dtype, warps, fuse_qk)))
    for name in ("decode_step_nvfp4", "decode_step_bf16"):
        use = usage[name]
        assert use.registers * 32 * 8 <= 65536 and use.spill_store_bytes <= 64, (name, use)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("fold", [False, True], ids=["norm-tasks", "folded-norms-fused-qk"])
def test_the_tables_point_at_each_layers_tensors(fmt, fold):
    """DecodeStep's tables, built on the CPU over flint-tiny: each layer's row names its own norms,
    q/k/v (with the splits), KV pools (ring or paged) and expert stacks; the step's buffers and
    sizes; the plan of the layers asked for (folded: no norm operations, a row slot a CTA)."""
    from flint_sched.checkpoint.make import dummy_checkpoint
    from flint_sched.executor.cuda_executor import _kernel_weight
    from flint_sched.executor.kv_cache import KVCache
    from flint_sched.executor.step_inputs import DecodeInputs
    from flint_sched.executor.workspace import Workspaces
    from flint_sched.kernels.linear import concat_rows
    from flint_sched.quant.nvfp4 import NVFP4Tensor

    c, cpu, rows = preset("flint-tiny"), torch.device("cpu"), 3
    ckpt = dummy_checkpoint(c, fmt, seed=1, device="cpu")
    w = {n: _kernel_weight(t, cpu) for n, t in ckpt.weights.items()}
    qkv = {i: concat_rows([w[f"model.layers.{i}.self_attn.{n}_proj.weight"] for n in "qkv"])
           for i in range(c.num_hidden_layers)}
    kv = KVCache(c, 32, 16, 4, torch.bfloat16, "cpu")
    ws = Workspaces(c, 8, 4, cpu)
    inputs = DecodeInputs(8, 256, 16, cpu)
    hidden = ws.hidden[0][:rows]
    step = ds.DecodeStep(kernel_ops.KernelWeights(c, w, qkv, kv, ws), inputs, hidden, rows, 1, 5, fold_norms=fold,
                         fuse_qk=fold)
    assert step.fmt == fmt and step.plan.grid == step.grid
    assert {int(t[1]) for t in step.plan.tasks} == {1, 2, 3, 4}
    assert (ds.OP["NORM_IN"] in step.plan.tasks[:, 0]) is not fold
    assert (ds.OP["QK_NORM"] in step.plan.tasks[:, 0]) is not fold
    assert tuple(step.x.shape) == ((step.grid if fold else 1), rows, c.hidden_size)
    assert tuple(step.q.shape) == ((step.grid if fold else rows), c.num_attention_heads, 128)

    def first(t):
        return (t.codes if isinstance(t, NVFP4Tensor) else t).data_ptr()
    table = step.layers.tolist()
    for i in (1, 3, 4):
        row, p = table[i], f"model.layers.{i}."
        assert row[ds.LP["IN_NORM"]] == w[p + "input_layernorm.weight"].data_ptr()
        assert row[ds.LP["POST_NORM"]] == w[p + "post_attention_layernorm.weight"].data_ptr()
        assert row[ds.LP["QKV"]] == first(qkv[i][0])
        assert (row[ds.LP["QKV_SPLIT1"]], row[ds.LP["QKV_SPLIT2"]]) == tuple(qkv[i][1])
        assert row[ds.LP["O"]] == first(w[p + "self_attn.o_proj.weight"])
        sliding = c.is_sliding(i)
        pool = kv.ring[kv.ring_index[i]] if sliding else kv.full[kv.full_index[i]]
        assert (row[ds.LP["SLIDING"]], row[ds.LP["K_POOL"]], row[ds.LP["V_POOL"]]) == (
            int(sliding), pool[0].data_ptr(), pool[1].data_ptr())
        gate = p + ("mlp.experts.gate_proj.weight" if c.is_moe(i) else "mlp.gate_proj.weight")
        assert row[ds.LP["GATE"]] == first(w[gate])
        if fmt == "nvfp4":
            assert row[ds.LP["GATE_2"]] == w[gate].tensor_scale.data_ptr()
    assert table[0] == [0] * len(ds.LAYER_PTRS) and table[5] == [0] * len(ds.LAYER_PTRS)   # not in the range
    ptrs, ints = step.step_ptrs.tolist(), step.step_ints.tolist()
    assert ptrs[ds.SP["H"]] == hidden.data_ptr() and ptrs[ds.SP["BLOCK_TABLES"]] == inputs.block_tables.data_ptr()
    assert ptrs[ds.SP["LAYERS"]] == step.layers.data_ptr()
    assert ints[ds.SI["ROWS"]] == rows and ints[ds.SI["TABLE_STRIDE"]] == inputs.block_tables.shape[1]
    assert ints[ds.SI["RING_ROWS"]] == kv.ring.shape[3] and ints[ds.SI["FOLD_NORMS"]] == int(fold)
    assert np.float32(np.int32(ints[ds.SI["EPS"]]).view(np.float32)) == np.float32(c.rms_norm_eps)


class _OneGo:
    """Ops whose layers run in one call: forward must not touch the per-layer operations."""

    def __init__(self):
        self.calls = []

    def embed(self):
        self.calls.append("embed")
        return torch.zeros(2, 4)

    def resume(self):
        self.calls.append("resume")
        return torch.zeros(2, 4)

    def layers(self, first, last):
        self.calls.append(("layers", first, last))
        return torch.ones(2, 4)

    def logits(self, h):
        self.calls.append("logits")
        return h + 1

    def __getattr__(self, name):
        raise AssertionError(f"forward called {name} though the layers ran in one go")


def test_forward_hands_the_layer_range_to_ops_that_run_it_in_one_go():
    c = preset("flint-tiny")
    ops = _OneGo()
    assert torch.equal(forward(ops, c), torch.full((2, 4), 2.0))
    assert ops.calls == ["embed", ("layers", 0, c.num_hidden_layers), "logits"]
    ops = _OneGo()
    assert torch.equal(forward(ops, c, 1, 2), torch.ones(2, 4))
    assert ops.calls == ["resume", ("layers", 1, 2)]


def test_forward_keeps_each_layers_output_from_ops_that_run_layers_in_one_go():
    """With layer_outputs, a layer a call: the persistent step's outputs can be checked layer by layer."""
    c = preset("flint-tiny")
    ops = _OneGo()
    outputs = []
    forward(ops, c, 0, 3, layer_outputs=outputs)
    assert ops.calls == ["embed", ("layers", 0, 1), ("layers", 1, 2), ("layers", 2, 3)]
    assert len(outputs) == 3 and all(torch.equal(o, torch.ones(2, 4)) for o in outputs)


def test_kernel_ops_runs_layers_one_at_a_time_unless_persistent():
    assert kernel_ops.PERSISTENT is False    # prepared without a GPU: off until measured
    ops = kernel_ops.KernelOps.__new__(kernel_ops.KernelOps)
    ops.variant = "fused"
    assert ops.layers(0, 3) is None


def test_plan_arrays_are_int32():
    plan = ds.plan_tasks([(0, 0, 3)], 2)
    assert plan.tasks.dtype == np.int32 and plan.task_start.dtype == np.int32
    assert list(plan.task_start) == [0, 1, 2]
