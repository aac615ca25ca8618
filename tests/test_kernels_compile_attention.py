"""The decode-attention sources compile for sm_90a with NVRTC (no GPU needed); split heuristics on the CPU."""

import pytest

from flint_sched.kernels import _runtime, attention

available, why = _runtime.nvrtc_available()
needs_nvrtc = pytest.mark.skipif(not available, reason=f"NVRTC cannot be imported: {why}")

ENTRY_POINTS = [("qk_norm_rope_kv.cu", "qk_norm_rope_kv_bf16"), ("decode_attention.cu", "decode_attention_bf16"),
                ("decode_attention_qk.cu", "decode_attention_qk_bf16")]



@needs_nvrtc
@pytest.mark.parametrize("source,entry", ENTRY_POINTS)
def test_compiles_for_sm90a(source, entry, private_cache):
    cubin = _runtime.compile_only(source, arch="sm_90a")
    assert cubin[:4] == b"\x7fELF"
    assert entry.encode() in cubin


@needs_nvrtc
@pytest.mark.parametrize("source", ["qk_norm_rope_kv.cu", "decode_attention.cu", "decode_attention_qk.cu"])
def test_fp8_kv_variants_compile(source, private_cache):
    """KV_FP8: the e4m3 cache's writes and reads (attention.kv_defines)."""
    assert _runtime.compile_only(source, {"KV_FP8": 1}, arch="sm_90a")[:4] == b"\x7fELF"


@needs_nvrtc
@pytest.mark.parametrize("defines", [{"ATTN_STAGES": 3}, {"ATTN_STAGES": 4}, {"ATTN_CP_ASYNC": 1},
                                     {"ATTN_CP_ASYNC": 1, "KV_FP8": 1, "ATTN_STAGES": 4}])
def test_attention_pipeline_variants_compile(defines, private_cache):
    assert _runtime.compile_only("decode_attention.cu", defines, arch="sm_90a")[:4] == b"\x7fELF"


@needs_nvrtc
@pytest.mark.parametrize("defines", [{}, {"ATTN_CP_ASYNC": 1, "KV_FP8": 1, "ATTN_STAGES": attention.FP8_STAGES}])
@pytest.mark.parametrize("source,entry", ENTRY_POINTS[1:])
def test_default_builds_fit_ctas_per_sm(defines, source, entry):
    """decode_splits sizes a wave as CTAS_PER_SM CTAs an SM: their registers (allocated per warp in
    units of 256) must fit the 64 K of an SM, without spills (the Q/K-norm variant's too)."""
    usage = _runtime.resource_usage(source, {"ATTN_MIN_SPLIT_KEYS": attention.MIN_SPLIT_KEYS, **defines})
    use = usage[entry]
    per_warp = -(-use.registers * 32 // 256) * 256
    assert attention.CTAS_PER_SM * (attention.ATTN_THREADS // 32) * per_warp <= 64 * 1024, use
    assert use.spill_store_bytes == 0 and use.spill_load_bytes == 0, use


def test_launcher_constants_match_the_kernel_source():
    text = (_runtime.source_dir() / "decode_attention.cu").read_text()
    assert f"#define ATTN_MIN_SPLIT_KEYS {attention.MIN_SPLIT_KEYS}" in text
    assert f"#define MERGE_GROUP {attention.MERGE_GROUP}" in text
    assert f"#define MAX_GROUPS {attention.MAX_SPLITS // attention.MERGE_GROUP}" in text
    assert f"#define TICKETS_PER_LAUNCH {attention.MAX_BATCH * attention.MAX_KV_HEADS}" in text
    assert "#define ATTN_WARPS 4" in text and "#define ATTN_STAGES 2" in text
    assert attention.ATTN_THREADS == 4 * 32
    assert attention.ATTN_SMEM_BYTES == 4 * 2 * 2 * 16 * 272 and 3 * (attention.ATTN_SMEM_BYTES + 1024) <= 228 * 1024
    assert attention.fp8_smem_bytes(2) == 4 * 2 * 2 * 16 * 144
    assert 3 * (attention.fp8_smem_bytes(attention.FP8_STAGES) + 1024) <= 228 * 1024
    assert attention.PARTIAL_FLOATS * 4 % 16 == 0 and attention.TICKET_SLOTS * 4 % 16 == 0  # float4 partials
    assert "#define QKN_WARPS 8" in (_runtime.source_dir() / "qk_norm_rope_kv.cu").read_text()


@pytest.mark.parametrize("batch,max_keys,splits", [
    (1, 100_000, 99), (1, 32_768, 99), (1, 1_024, 16), (1, 513, 9), (1, 1, 1),
    (8, 100_000, 12), (8, 513, 9), (19, 32_768, 5), (64, 100_000, 3), (64, 513, 1), (64, 1, 1),
    (96, 100_000, 1), (256, 1_024, 1), (256, 4_096, 1), (256, 32_768, 3),
])
def test_decode_splits(batch, max_keys, splits):
    assert attention.decode_splits(batch, max_keys) == splits


def test_wide_splits_only_past_one_wave_and_only_for_long_requests(monkeypatch):
    """Within one wave every request splits as the grid does; a grid of several waves gives the
    requests too short to gain one split, from a length of at least MIN_SPLIT_KEYS a split."""
    assert attention.one_split_below(16, attention.decode_splits(16, 100_000)) == 0
    assert attention.one_split_below(64, 1) == 0
    below = attention.one_split_below(64, 3)
    assert 3 * attention.MIN_SPLIT_KEYS <= below < 1_024
    assert attention.one_split_below(256, 3) > 4_096        # at 256 only long requests gain
    monkeypatch.setattr(attention, "WIDE_SPLITS", False)
    assert attention.decode_splits(64, 100_000) == 1 and attention.decode_splits(256, 32_768) == 1


@pytest.mark.parametrize("max_batch", [1, 8, 64])
def test_workspace_fits_every_split_choice(max_batch):
    slots = attention.workspace_partials(max_batch)
    for b in range(1, max_batch + 1):
        for max_keys in (1, 63, 64, 65, 513, 4097, 100_000, 262_144):
            assert b * 4 * attention.decode_splits(b, max_keys) <= slots
    assert attention.MAX_BATCH * attention.MAX_KV_HEADS <= attention.TICKET_SLOTS


def test_importing_needs_no_gpu():
    assert callable(attention.decode_attention_full) and callable(attention.qk_norm_rope_kv_sliding)


def test_q_slots_hold_every_fused_grid():
    """attention.q_slots_elements: a slot of H heads for every CTA of any batch up to the fused path's
    8 rows, at Flint's longest context (a few MB, not the 8 x 128 splits a bound by MAX_SPLITS would take)."""
    n = attention.q_slots_elements(8, 262_144, 4)
    for b in range(1, 9):
        assert n >= b * 4 * attention.decode_splits(b, 262_144, 4) * 32 * attention.HEAD_DIM
    assert n * 2 < 16 * 2**20, n
