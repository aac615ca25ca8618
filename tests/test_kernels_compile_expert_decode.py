"""The decode expert GEMMs (cuda/expert_decode.cu) compile for sm_90a with NVRTC in every config
(no GPU needed); the launcher's constants, shared memory and shape checks on the CPU."""

import pytest

from flint_sched.kernels import _runtime, expert_decode

available, why = _runtime.nvrtc_available()
needs_nvrtc = pytest.mark.skipif(not available, reason=f"NVRTC cannot be imported: {why}")


@needs_nvrtc
@pytest.mark.parametrize("config", sorted(expert_decode.CONFIGS))
def test_compiles_for_sm90a(config, private_cache):
    cubin = _runtime.compile_only("expert_decode.cu", expert_decode.CONFIGS[config], arch="sm_90a")
    assert cubin[:4] == b"\x7fELF"
    entries = ["expert_decode_gate_up_nvfp4", "expert_decode_down_nvfp4", "expert_decode_moe_nvfp4"]
    if expert_decode.cluster_size(config):
        entries += ["expert_decode_moe_cluster_nvfp4", "expert_decode_moe_routed_nvfp4"]
    for entry in entries:
        assert entry.encode() in cubin, f"{config} lacks {entry}"


@needs_nvrtc
@pytest.mark.parametrize("probe", [1, 2])
def test_timing_probes_compile(probe, private_cache):
    """The ED_PROBE builds benchmarks/bench_grouped.py --decode-probes times."""
    defines = dict(expert_decode.CONFIGS["g2w8t4"], ED_PROBE=probe)
    assert _runtime.compile_only("expert_decode.cu", defines, arch="sm_90a")[:4] == b"\x7fELF"


@needs_nvrtc
@pytest.mark.parametrize("config", ["g1t2d4", "g2w8t4p"])
def test_trace_build_compiles(config, private_cache):
    """The ED_TRACE build benchmarks/decode_moe_trace.py launches (one more kernel argument)."""
    cubin = _runtime.compile_only("expert_decode.cu", dict(expert_decode.CONFIGS[config], ED_TRACE=1), arch="sm_90a")
    assert cubin[:4] == b"\x7fELF" and b"expert_decode_moe_nvfp4" in cubin


def test_launcher_constants_match_the_kernel_source():
    text = (_runtime.source_dir() / "expert_decode.cu").read_text()
    assert f"#define ED_WARPS {expert_decode.WARPS}" in text
    assert f"#define ED_KR {expert_decode.K_ROUND}" in text
    assert f"#define ED_TABLE_BYTES {expert_decode.TABLE_BYTES}" in text
    cluster = (_runtime.source_dir() / "expert_decode_cluster.cuh").read_text()
    assert f"#define ED_ROUTE_MAX_TOKENS {expert_decode.ROUTE_MAX_TOKENS}" in cluster
    assert f"#define ED_ROUTE_MAX_TOP_K {expert_decode.ROUTE_MAX_TOP_K}" in cluster
    topk = (_runtime.source_dir() / "topk.cuh").read_text()
    assert f"#define ROUTER_MAX_EXPERTS {expert_decode.ROUTE_MAX_EXPERTS}" in topk
    trace = (_runtime.source_dir() / "expert_decode_trace.cuh").read_text()
    assert f"#define ED_TRACE_SLOTS {expert_decode.TRACE_SLOTS}" in trace


def test_grid_per_config():
    """Items x tile groups: gate/up's I / 8 tiles and down's N / 16 tiles over warps x tiles a CTA."""
    class Routing:
        max_items = 300
    assert expert_decode._grid(Routing, 512 // 8, "g1t4") == (300, 4)
    assert expert_decode._grid(Routing, 2048 // 16, "g1t4", down=True) == (300, 8)
    assert expert_decode._grid(Routing, 2048 // 16, "g1t4d8", down=True) == (300, 4)
    assert expert_decode._grid(Routing, 512 // 8, "g2w8t4") == (300, 2)
    assert expert_decode._grid(Routing, 2048 // 16, "g2w8t4", down=True) == (300, 4)
    assert expert_decode.moe_units("g1t2d4", 2048, 512) == (8, 8)          # 64 / (4 x 2), 128 / (4 x 4)
    assert expert_decode.moe_units("g2w8t4p", 2048, 512) == (2, 4)
    assert expert_decode.moe_grid_ctas(300, "g2w8t4p", 2048, 512) == 1800
    # a cluster an item: each CTA a gate/up and a down unit
    assert expert_decode.moe_units("g1t2d4c", 2048, 512) == (8, 8)
    assert expert_decode.moe_grid_ctas(300, "g1t2d4c", 2048, 512) == 300 * 8


def test_shapes_and_shared_memory():
    assert expert_decode.rows_per_item("g1t4") == 8 and expert_decode.rows_per_item("g2t4") == 16
    assert expert_decode.x_row_bytes(2048) == 260 * 16 and expert_decode.x_row_bytes(512) == 68 * 16
    assert expert_decode.shared_bytes("g1t4", 2048) == 1024 + 8 * 260 * 16
    assert expert_decode.supported("nvfp4", 2048, 512)                 # Flint
    assert not expert_decode.supported("bf16", 2048, 512)
    assert not expert_decode.supported("nvfp4", 2048, 256)             # down's K below a load round
    assert not expert_decode.supported("nvfp4", 16384, 512)            # x rows past shared memory (g1: 263 KB)
    assert expert_decode.supported("nvfp4", 8192, 512, "g1t4")
    assert not expert_decode.supported("nvfp4", 8192, 512, "g2t4")


def test_config_by_token_count(monkeypatch):
    assert expert_decode.pick_config(1, 2048, 512) == expert_decode.pick_config(16, 2048, 512) == "g1t2d4c"
    assert expert_decode.pick_config(17, 2048, 512) == expert_decode.pick_config(32, 2048, 512) == "g1t2d4"
    # where an item's gate/up and down units differ in number, not the cluster kernel (hidden 512:
    # 8 gate/up, 2 down units)
    assert expert_decode.pick_config(16, 512, 512) == "g1t2d4" and not expert_decode.fits("g1t2d4c", 512, 512)
    assert expert_decode.fits("g1t2d4c", 2048, 512) and expert_decode.fits("g1t4d8", 512, 512)
    assert expert_decode.pick_config(33, 2048, 512) == expert_decode.pick_config(160, 2048, 512) == "g1t4d8"
    assert expert_decode.pick_config(161, 2048, 512) == expert_decode.pick_config(1023, 2048, 512) == "g2w8t4p"
    assert expert_decode.rows_per_item("g2w8t4p") == 16 and expert_decode.warps("g2w8t4p") == 8
    monkeypatch.setattr(expert_decode, "CONFIG", "g2t4")
    assert expert_decode.pick_config(64, 2048, 512) == "g2t4" and expert_decode.rows_per_item("g2t4") == 16


def test_which_calls_route_in_the_cluster():
    """expert_decode_moe_routed takes a cluster config's calls of up to 32 tokens (a token mask is one
    word), 256 experts and top-16; anything else keeps moe_route."""
    assert expert_decode.routes_in_cluster("g1t2d4c", 16, 256, 6, 2048, 512)
    assert expert_decode.routes_in_cluster("g1t2d4c", 32, 256, 16, 2048, 512)
    assert not expert_decode.routes_in_cluster("g1t2d4c", 33, 256, 6, 2048, 512)
    assert not expert_decode.routes_in_cluster("g1t2d4c", 16, 512, 6, 2048, 512)
    assert not expert_decode.routes_in_cluster("g1t2d4c", 16, 256, 17, 2048, 512)
    assert not expert_decode.routes_in_cluster("g1t2d4c", 16, 256, 6, 512, 512)   # the cluster does not fit
    assert not expert_decode.routes_in_cluster("g1t2d4", 16, 256, 6, 2048, 512)   # no clusters
