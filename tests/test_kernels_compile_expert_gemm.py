"""The tiled expert GEMMs (cuda/expert_gemm.cu) compile for sm_90a with NVRTC in every config the
launcher uses (no GPU needed); launcher constants and dispatch on the CPU."""

import pytest

from flint_sched.kernels import _runtime, expert_gemm
from flint_sched.kernels.grouped_moe import EXPERT_GEMM_MIN_TOKENS, expert_gemms

available, why = _runtime.nvrtc_available()
needs_nvrtc = pytest.mark.skipif(not available, reason=f"NVRTC cannot be imported: {why}")

ENTRY_POINTS = [f"expert_{op}_{fmt}" for op in ("gate_up", "down") for fmt in ("bf16", "nvfp4")]
MAX_SHARED_BYTES = 227 * 1024   # sm_90 opt-in limit per block



@needs_nvrtc
@pytest.mark.parametrize("config", sorted(expert_gemm.CONFIGS))
def test_compiles_for_sm90a(config, private_cache):
    cubin = _runtime.compile_only("expert_gemm.cu", expert_gemm.CONFIGS[config], arch="sm_90a")
    assert cubin[:4] == b"\x7fELF"
    for entry in ENTRY_POINTS:
        if entry.rsplit("_", 1)[1] in expert_gemm.formats(config):
            assert entry.encode() in cubin, f"{config} lacks {entry}"


def test_launcher_constants_match_the_kernel_source():
    text = (_runtime.source_dir() / "expert_gemm.cu").read_text()
    assert f"#define EG_BM {expert_gemm.TILE_M}" in text
    assert f"#define EG_BK {expert_gemm.TILE_K}" in text


@pytest.mark.parametrize("config", sorted(expert_gemm.CONFIGS))
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_shared_memory_fits(config, fmt):
    if fmt not in expert_gemm.formats(config):
        pytest.skip(f"{config} is not used for {fmt}")
    c = expert_gemm.CONFIGS[config]
    per_sm = expert_gemm.shared_bytes(fmt, config) * c["EG_MIN_CTAS"]
    assert expert_gemm.shared_bytes(fmt, config) <= MAX_SHARED_BYTES
    assert per_sm + 1024 * c["EG_MIN_CTAS"] <= 228 * 1024, "the CTAs per SM the config asks for do not fit"
    # one thread per weight row in the NVFP4 decode, or two (EG_WIDE)
    assert expert_gemm.threads(config) == c["EG_BN"] * (2 if c.get("EG_WIDE") else 1)


def test_dispatch_by_token_count():
    small = {"bf16": "swap-ab", "nvfp4": "decode"}
    for fmt in ("bf16", "nvfp4"):
        assert expert_gemms(128, fmt, 2048, 512) == small[fmt]   # decode graphs stay off the tiles
        assert expert_gemms(EXPERT_GEMM_MIN_TOKENS[fmt] - 1, fmt, 2048, 512) == small[fmt]
        assert expert_gemms(EXPERT_GEMM_MIN_TOKENS[fmt], fmt, 2048, 512) == "tiled"
        assert expert_gemms(8192, fmt, 2048, 512) == "tiled"
    assert expert_gemms(511, "nvfp4", 2048, 512) == "decode"     # ... NVFP4 ones up to 511 rows
    assert expert_gemms(8192, "bf16", 2048, 96) == "swap-ab"     # I not a multiple of the tile
    assert expert_gemms(64, "nvfp4", 2048, 96) == "swap-ab"      # nor K of a decode load round
    assert expert_gemms(1, "bf16", 2048, 512, "tiled") == "tiled"
    assert expert_gemms(8192, "bf16", 2048, 512, "swap-ab") == "swap-ab"
    assert expert_gemms(8192, "bf16", 2048, 512, "decode") == "swap-ab"   # NVFP4 only
    with pytest.raises(ValueError, match="gemms"):
        expert_gemms(8, "bf16", 2048, 512, "fast")
