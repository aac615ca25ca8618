"""Every CUDA source compiles for sm_90a with NVRTC (no GPU needed), and the runtime's CPU paths."""

import pytest

from flint_sched.kernels import _compiler, _runtime
from flint_sched.kernels import ENTRY_POINTS, VARIANTS

available, why = _runtime.nvrtc_available()
# every test with a fresh kernel cache (conftest's private_cache), so every test really compiles
pytestmark = [pytest.mark.skipif(not available, reason=f"NVRTC cannot be imported: {why}"),
              pytest.mark.usefixtures("private_cache")]

SOURCES = sorted(p.name for p in _runtime.source_dir().glob("*.cu"))


def test_sources_exist():
    assert {"rmsnorm.cu", "gemv.cu", "moe.cu", "router.cu", "argmax.cu"} <= set(SOURCES)


CASES = [(source, defines) for source in SOURCES for defines in VARIANTS.get(source, ({},))]


@pytest.mark.parametrize("source,defines", CASES, ids=[f"{s}{d or ''}" for s, d in CASES])
def test_source_compiles_for_sm90a(source, defines):
    cubin = _runtime.compile_only(source, defines, arch="sm_90a")
    assert cubin[:4] == b"\x7fELF"
    for src, name in ENTRY_POINTS:
        if src == source:
            assert name.encode() in cubin, f"{source} {defines} lacks the entry point {name}"


def test_every_entry_point_has_a_source():
    assert {src for src, _ in ENTRY_POINTS} <= set(SOURCES)


def test_compile_error_carries_the_log():
    with pytest.raises(_runtime.KernelCompileError) as info:
        _runtime.compile_only("broken.cu", source_text='extern "C" __global__ void k() { undeclared(); }\n')
    assert "undeclared" in info.value.log
    assert "broken.cu" in str(info.value)


SPILLER = '''
extern "C" __global__ void __launch_bounds__(1024, 2) spills(float* y, const float* x, int n) {
  float acc[48];
#pragma unroll
  for (int j = 0; j < 48; ++j) acc[j] = x[threadIdx.x + j];
  for (int i = 0; i < n; ++i)
#pragma unroll
    for (int j = 0; j < 48; ++j) acc[j] = acc[j] * acc[(j + 7) % 48] + x[i * 48 + j];
#pragma unroll
  for (int j = 0; j < 48; ++j) y[threadIdx.x * 48 + j] = acc[j];
}
extern "C" __global__ void tiny(float* y) { *y = 1.0f; }
'''


def test_resource_usage_reports_registers_and_spills():
    """ptxas -v through NVRTC (benchmarks/kernel_resources.py): 48 live floats under a 32-register cap
    (1024 threads, 2 blocks a SM) spill; a one-store kernel does not."""
    usage = _runtime.resource_usage("spill_probe.cu", source_text=SPILLER)
    assert set(usage) == {"spills", "tiny"}
    assert usage["spills"].registers <= 32 and usage["spills"].spill_store_bytes > 0 and usage["spills"].stack_bytes > 0
    assert usage["tiny"].registers >= 1 and usage["tiny"].spill_store_bytes == usage["tiny"].spill_load_bytes == 0


@pytest.mark.parametrize("source,defines", [
    ("moe_routing.cu", {"ROUTER_MAX_EXPERTS": 256}), ("moe_routing.cu", {"ROUTER_MAX_EXPERTS": 1024}),
    ("moe_routing.cu", {"ROUTER_MAX_EXPERTS": 1024, "MASK_TOKENS": 0}), ("rmsnorm.cu", {}), ("argmax.cu", {}),
    ("embedding.cu", {}), ("gemv_chain.cu", {"GEMV_WARPS": 16, "X_BATCH": 0}),
    ("router.cu", {"ROUTER_MAX_EXPERTS": 256}), ("router.cu", {"ROUTER_MAX_EXPERTS": 256, "RC_ST_ASYNC": 1})])
def test_small_kernels_do_not_spill(source, defines):
    """The routing (split-K logit parts held at once for 256 experts, one part at a time for 1024),
    norms, argmax / sampling and embedding builds keep everything in registers."""
    for name, usage in _runtime.resource_usage(source, defines).items():
        assert usage.spill_store_bytes == usage.spill_load_bytes == 0, f"{source} {defines} {name}: {usage}"


def test_kernel_resources_command(monkeypatch, capsys):
    from flint_sched.benchmarks import kernel_resources

    assert kernel_resources.parse_defines("KV_FP8=1, B") == {"KV_FP8": "1", "B": None}
    monkeypatch.setattr("sys.argv", ["kernel_resources", "--source", "rmsnorm.cu", "--defines", "UNUSED_PROBE=1"])
    kernel_resources.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| rmsnorm.cu")]
    assert {row.split("|")[3].strip() for row in rows} == {"add_rmsnorm_f32", "add_rmsnorm_fixed", "rmsnorm_bf16"}
    assert all(row.split("|")[2].strip() == "UNUSED_PROBE=1" and int(row.split("|")[4]) > 0 for row in rows)


def test_disk_cache_is_keyed_by_headers_and_defines(tmp_path):
    text = '#include "common.cuh"\nextern "C" __global__ void k(float* y) { *y = VALUE; }\n'
    first = _runtime.compile_only("probe.cu", {"VALUE": "1.0f"}, source_text=text)
    files = sorted((tmp_path / "kernels").glob("probe-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == first
    _compiler._cubins.clear()                           # the in-process cache: next from disk
    assert _runtime.compile_only("probe.cu", {"VALUE": "1.0f"}, source_text=text) == first  # from disk
    _runtime.compile_only("probe.cu", {"VALUE": "2.0f"}, source_text=text)
    assert len(list((tmp_path / "kernels").glob("probe-*.cubin"))) == 2


def test_scalar_arguments_need_a_c_type():
    with pytest.raises(TypeError, match="typed scalar"):
        _runtime._kind(3)
    assert _runtime._kind(_runtime.I32(3)) is _runtime.I32
    assert _runtime._kind(None) == _runtime._PTR


def test_arg_pack_points_at_its_slots():
    import ctypes

    import torch

    pack = _runtime._ArgPack((_runtime._PTR, _runtime.I32, _runtime.F32))
    address = pack.fill([None, _runtime.I32(-7), _runtime.F32(0.5)])
    pointers = (ctypes.c_void_p * 3).from_address(address)
    assert ctypes.c_uint64.from_address(pointers[0]).value == 0
    assert ctypes.c_int32.from_address(pointers[1]).value == -7
    assert ctypes.c_float.from_address(pointers[2]).value == 0.5
    t = torch.zeros(4)
    pack.fill([t, _runtime.I32(1), _runtime.F32(1.0)])
    assert ctypes.c_uint64.from_address(pointers[0]).value == t.data_ptr()


def test_arg_pack_passes_a_tensor_map_by_value():
    """A TensorMap's 128 bytes are copied into its slot (the kernel's __grid_constant__ parameter)."""
    import ctypes

    tmap = _runtime.TensorMap()
    tmap.opaque[:] = list(range(100, 116))
    assert _runtime._kind(tmap) is _runtime.TensorMap and ctypes.sizeof(tmap) == 128
    pack = _runtime._ArgPack((_runtime.I32, _runtime.TensorMap))
    pointers = (ctypes.c_void_p * 2).from_address(pack.fill([_runtime.I32(3), tmap]))
    assert list((ctypes.c_uint64 * 16).from_address(pointers[1])) == list(range(100, 116))
    tmap.opaque[0] = 7                                   # the pack holds a copy, refreshed per fill
    assert (ctypes.c_uint64 * 16).from_address(pointers[1])[0] == 100
    pack.fill([_runtime.I32(3), tmap])
    assert (ctypes.c_uint64 * 16).from_address(pointers[1])[0] == 7


def test_importing_the_package_needs_no_gpu():
    import flint_sched.kernels as kernels

    assert callable(kernels.linear) and callable(kernels.greedy)


def test_gemv_register_table_matches_the_builds():
    """kernels/linear.py REGISTERS (what gemv_warps sizes its waves by) is ptxas's most registers
    over the GEMV builds of each format and group count, rounded up to the allocation unit."""
    import importlib

    linear_mod = importlib.import_module("flint_sched.kernels.linear")
    entries = {"bf16": ("gemv_bf16", "gemv_bf16_f32", "gate_up_bf16"), "nvfp4": ("gemv_nvfp4", "gate_up_nvfp4")}
    for (fmt, groups), table in linear_mod.REGISTERS.items():
        most = 0
        for warps in (4, 8, 16) if groups <= 2 else (4, 8):
            use = _runtime.resource_usage("gemv.cu", {"GEMV_WARPS": warps, "X_BATCH": linear_mod.x_batch(fmt),
                                                      "GEMV_GROUPS": groups})
            most = max(most, *(use[name].registers for name in entries[fmt]))
        unit = linear_mod.REGISTER_UNIT
        assert table == -(-most // unit) * unit, (fmt, groups, most, table)


def test_the_lm_heads_folded_argmax_fits_the_gemv_register_table():
    """gemv_*_argmax (the LM head with its greedy choice) builds without spills at the warp counts
    gemv_warps picks, within kernels/linear.py REGISTERS, so the waves it is sized by still hold."""
    import importlib

    linear_mod = importlib.import_module("flint_sched.kernels.linear")
    for (fmt, groups), table in linear_mod.REGISTERS.items():
        for warps in (4, 8, 16) if groups <= 2 else (4, 8):
            use = _runtime.resource_usage("gemv.cu", {"GEMV_WARPS": warps, "X_BATCH": linear_mod.x_batch(fmt),
                                                      "GEMV_GROUPS": groups})[f"gemv_{fmt}_argmax"]
            assert use.registers <= table and use.spill_store_bytes == use.stack_bytes == 0, (fmt, groups, warps, use)


def test_every_launch_shape_of_flint_uses_a_compiled_variant():
    """The warps each launcher picks for Flint's shapes, at every decode batch size, are among the
    variants CI compiles; BF16 q/k/v stays at 4 warps (one wave of CTAs, see gemv_warps)."""
    import importlib

    from flint_sched.kernels import VARIANTS
    linear_mod = importlib.import_module("flint_sched.kernels.linear")
    moe_mod = importlib.import_module("flint_sched.kernels.moe")
    shapes = [(5120, 2048), (2048, 4096), (2048, 10240), (151552, 2048)]        # q/k/v, o_proj, down, LM head
    for fmt in ("bf16", "nvfp4"):
        for n, k in shapes + [(2 * 10240 // 2, 2048)]:                        # + dense gate/up (8-row tiles)
            tiles = n // 16
            for tokens in (1, 8, 9, 16, 17, 24, 25, 32):
                g = linear_mod.groups(tokens)
                picked = {"GEMV_WARPS": linear_mod.gemv_warps(tiles, k, fmt, g), "X_BATCH": linear_mod.x_batch(fmt),
                          "GEMV_GROUPS": g}
                assert picked in VARIANTS["gemv.cu"], (fmt, n, k, picked)
        for tokens in range(1, 9):
            picked = {"MOE_GATE_UP_WARPS": moe_mod.gate_up_warps(fmt, tokens), "X_BATCH": linear_mod.x_batch(fmt)}
            assert picked in VARIANTS["moe.cu"], (fmt, tokens, picked)
    assert linear_mod.gemv_warps(5120 // 16, 2048, "bf16") == 4
    # NVFP4 q/k/v at 1-8 tokens: 4 warps since the word layout (82 registers, so 2 CTAs of 8 warps an SM:
    # 8 warps would take 1.2 waves; with 80 they fitted in one and 8 was picked)
    assert linear_mod.gemv_warps(5120 // 16, 2048, "nvfp4") == 4
    assert linear_mod.gemv_warps(5120 // 16, 2048, "nvfp4", 2) == 4    # 9-16 tokens: 8 warps would take 1.2 waves
    assert [moe_mod.gate_up_warps("bf16", t) for t in (1, 3, 4, 8)] == [8, 8, 4, 4]


@pytest.mark.parametrize("waves", [1, 2, 8, 64])
def test_the_argmax_workspace_holds_every_split_count(waves, monkeypatch):
    """argmax_workspace is sized for the most CTAs a row can take, so a WAVES changed after it is
    made (ab_decode variants) still fits: every batch size's candidates and the ticket."""
    from flint_sched.kernels import sampling
    monkeypatch.setattr(sampling, "sm_count", lambda *a, **k: 132)
    monkeypatch.setattr(sampling, "WAVES", waves)
    vocab, rows = 151552, 256
    size = sampling.argmax_workspace(rows, vocab, "cpu").numel()
    for b in range(1, rows + 1):
        splits, chunk = sampling.argmax_splits(b, vocab)
        assert b * splits + 1 <= size and splits * chunk >= vocab and chunk % 8 == 0


@pytest.mark.parametrize("source,defines", [
    ("decode_attention.cu", {"ATTN_MIN_SPLIT_KEYS": 64}), ("decode_attention.cu", {"ATTN_MIN_SPLIT_KEYS": 64, "KV_FP8": 1}),
    ("argmax.cu", {}), ("gemv.cu", {"GEMV_WARPS": 8, "X_BATCH": 1}), ("gemv.cu", {"GEMV_WARPS": 4, "X_BATCH": 0}),
    ("router.cu", {"ROUTER_MAX_EXPERTS": 256}),
    ("moe_routing.cu", {"ROUTER_MAX_EXPERTS": 256, "MASK_TOKENS": 256}),
    ("expert_decode.cu", {"ED_GROUPS": 1, "ED_TILES": 2, "ED_TILES_DOWN": 4, "ED_CLUSTER": 8}),
    ("expert_decode.cu", {"ED_GROUPS": 1, "ED_TILES": 4, "ED_TILES_DOWN": 8})])
def test_acq_rel_tickets_cost_no_registers(source, defines):
    """kernels/tickets.py ACQ_REL: the kernels that take tickets or grid counters build without spills
    and with at most the registers of their fence.sc builds (decode attention's 3 CTAs a SM hold)."""
    sc = _runtime.resource_usage(source, {**defines, "TICKET_ACQ_REL": 0})
    acq_rel = _runtime.resource_usage(source, {**defines, "TICKET_ACQ_REL": 1})
    assert set(sc) == set(acq_rel)
    for name, usage in acq_rel.items():
        assert usage.spill_store_bytes <= sc[name].spill_store_bytes, (name, usage, sc[name])
        assert usage.registers <= max(sc[name].registers, 8 * -(-sc[name].registers // 8)), (name, usage, sc[name])
