"""The prefill-attention sources compile for sm_90a with NVRTC (no GPU needed); the step metadata on the CPU."""

import numpy as np
import pytest
import torch

from flint_sched.kernels import _runtime, prefill_attention
from flint_sched.kernels.prefill_attention import Chunk, PrefillBuffers, prefill_metadata

available, why = _runtime.nvrtc_available()
needs_nvrtc = pytest.mark.skipif(not available, reason=f"NVRTC cannot be imported: {why}")

ENTRY_POINTS = [("prefill_attention.cu", "prefill_attention_bf16"),
                ("prefill_attention_wgmma.cu", "prefill_attention_wgmma_bf16"), ("prefill_qkv.cu", "prefill_qk_norm_rope_bf16"),
                ("prefill_qkv.cu", "prefill_kv_copy_bf16")]



@needs_nvrtc
@pytest.mark.parametrize("source,entry", ENTRY_POINTS)
def test_compiles_for_sm90a(source, entry, private_cache):
    cubin = _runtime.compile_only(source, arch="sm_90a")
    assert cubin[:4] == b"\x7fELF"
    assert entry.encode() in cubin


@needs_nvrtc
@pytest.mark.parametrize("source,entry", ENTRY_POINTS)
def test_fp8_pool_variants_compile_for_sm90a(source, entry, private_cache):
    cubin = _runtime.compile_only(source, {"KV_FP8": 1}, arch="sm_90a")
    assert cubin[:4] == b"\x7fELF" and entry.encode() in cubin


@needs_nvrtc
def test_tma_variant_compiles_for_sm90a(private_cache):
    cubin = _runtime.compile_only("prefill_attention_wgmma.cu", {"PW_TMA": 1}, arch="sm_90a")
    assert cubin[:4] == b"\x7fELF" and b"prefill_attention_wgmma_bf16" in cubin


@needs_nvrtc
def test_tma_variant_refuses_fp8_pools(private_cache):
    """The launcher never asks for it (FP8 pools take the cp.async path); the source says so too."""
    with pytest.raises(_runtime.KernelCompileError, match="FP8 pools take the cp.async path"):
        _runtime.compile_only("prefill_attention_wgmma.cu", {"PW_TMA": 1, "KV_FP8": 1}, arch="sm_90a")


def test_launcher_constants_match_the_kernel_source():
    text = "".join((_runtime.source_dir() / name).read_text()
                   for name in ("prefill_attention.cuh", "prefill_attention.cu", "prefill_attention_wgmma.cu"))
    assert f"#define PF_TOKENS {prefill_attention.TILE_TOKENS}" in text
    assert "for (int page = 0; page < PW_KEYS / 16; ++page)" in text and prefill_attention.TMA_PAGE_ROWS == 16
    assert "#define PF_WARPS 4" in text and prefill_attention.ATTN_THREADS == 4 * 32
    assert f"Q_SMEM + 2 * KV_SMEM == {prefill_attention.SMEM_BYTES}" in text
    assert 2 * (prefill_attention.SMEM_BYTES + 1024) <= 228 * 1024          # two CTAs per SM
    assert f"== {prefill_attention.WGMMA_SMEM_BYTES - 1024}, \"kernels/prefill_attention.py WGMMA_SMEM_BYTES\"" in text


def test_metadata_rows_tiles_and_cache_rows():
    chunks = [Chunk(0, 40, 3, [5, 1, 7]), Chunk(1000, 600, 0, list(range(100, 200))), Chunk(7, 1, 1, [9])]
    meta = prefill_metadata(chunks, 16, 513, "cpu")
    assert meta.num_tokens == 641 and meta.num_entries == 3
    assert meta.entries.tolist() == [[0, 0, 40, 3], [40, 1000, 600, 0], [640, 7, 1, 1]]
    # 3 + 38 + 1 tiles of 16 tokens, heaviest (latest keys) first
    tiles = meta.tiles.tolist()
    assert sorted(map(tuple, tiles)) == sorted([(0, a) for a in range(0, 40, 16)] + [(1, a) for a in range(0, 600, 16)]
                                               + [(2, 0)])
    assert tiles[0] == [1, 592] and tiles[-1] == [0, 0]
    assert meta.positions[:3].tolist() == [0, 1, 2] and meta.positions[40:42].tolist() == [1000, 1001]
    # position 17 of entry 0: block_table[1] = 1, offset 1; position 1000 of entry 1: block 162, offset 8
    assert meta.kv_rows[17] == 1 * 16 + 1 and meta.kv_rows[40] == (100 + 62) * 16 + 8
    assert meta.block_tables.shape == (3, 100) and meta.block_tables[0, :4].tolist() == [5, 1, 7, 0]
    # ring: entries of <= 513 tokens keep all rows, the 600-token chunk its last 513
    src, dst = meta.ring_src.tolist(), meta.ring_dst.tolist()
    assert len(src) == 40 + 513 + 1
    assert src[40] == 40 + 87 and dst[40] == 0 * 513 + (1087 % 513)
    assert src[-1] == 640 and dst[-1] == 1 * 513 + 7
    assert all(t.dtype == torch.int32 for t in (meta.entries, meta.tiles, meta.kv_rows, meta.ring_dst))


def test_metadata_of_a_mixed_step_row_by_row():
    """Many entries (decodes beside prompt chunks, as a mixed step has): every field against a plain
    per-row walk of the chunks, tiles heaviest first with ties in entry order."""
    import random
    rng = random.Random(5)
    chunks = []
    for e in range(60):
        n = rng.choice([1, 1, 1, 7, 16, 17, 600])
        s = rng.randrange(0, 3000)
        table = [rng.randrange(5000) for _ in range(-(-(s + n) // 16) + rng.randrange(3))]
        chunks.append(Chunk(s, n, e, table))
    meta = prefill_metadata(chunks, 16, 513, "cpu", ring_rows=528)
    rows, positions, kv_rows, src, dst, entries, tiles = 0, [], [], [], [], [], []
    for e, c in enumerate(chunks):
        entries.append([rows, c.start_position, c.num_tokens, c.ring_slot])
        for i in range(c.num_tokens):
            p = c.start_position + i
            positions.append(p)
            kv_rows.append(c.block_table[p // 16] * 16 + p % 16)
            if i >= c.num_tokens - 528:
                src.append(rows + i)
                dst.append(c.ring_slot * 528 + p % 528)
        tiles += [(c.start_position + t + 16, e, t) for t in range(0, c.num_tokens, 16)]
        rows += c.num_tokens
    assert meta.num_tokens == rows and meta.entries.tolist() == entries
    assert meta.positions.tolist() == positions and meta.kv_rows.tolist() == kv_rows
    assert meta.ring_src.tolist() == src and meta.ring_dst.tolist() == dst
    assert meta.tiles.tolist() == [[e, t] for _, e, t in sorted(tiles, key=lambda x: -x[0])]
    for e, c in enumerate(chunks):
        assert meta.block_tables[e, :len(c.block_table)].tolist() == c.block_table
        assert not meta.block_tables[e, len(c.block_table):].any()


def test_metadata_sends_the_leading_decodes_apart():
    """max_decodes: the leading one-row entries (up to that many) leave the tiles for `decodes`
    (seq_len, ring slot, row, ring row); a one-row entry after a chunk stays in the tiles, and every
    row keeps its positions, cache rows and ring rows."""
    chunks = [Chunk(100, 1, 3, [0] * 7), Chunk(7, 1, 1, [2]), Chunk(0, 40, 2, [5, 6, 7]), Chunk(50, 1, 0, [1] * 4)]
    plain = prefill_metadata(chunks, 16, 513, "cpu", ring_rows=528)
    assert plain.num_decodes == 0 and plain.decodes.shape == (4, 0) and plain.num_tiles == 1 + 1 + 3 + 1
    for cap, d in ((8, 2), (1, 1)):
        meta = prefill_metadata(chunks, 16, 513, "cpu", ring_rows=528, max_decodes=cap)
        assert meta.num_decodes == d and meta.decode_max_len == 101
        assert meta.decodes.tolist() == [[101, 8][:d], [3, 1][:d], [0, 1][:d], [3 * 528 + 100, 1 * 528 + 7][:d]]
        assert sorted(map(tuple, meta.tiles.tolist())) == sorted({(e, 0) for e in range(d, 4)} | {(2, 16), (2, 32)})
        for name in ("entries", "positions", "kv_rows", "ring_src", "ring_dst", "block_tables"):
            assert torch.equal(getattr(meta, name), getattr(plain, name)), name
    only = prefill_metadata(chunks[:2], 16, 513, "cpu", max_decodes=8)
    assert only.num_decodes == 2 and only.num_tiles == 0


def test_static_buffers_hold_the_decodes_apart_then_padding():
    chunks = [Chunk(100, 1, 3, [0] * 7), Chunk(7, 1, 1, [2]), Chunk(0, 40, 2, [5, 6, 7])]
    buffers = PrefillBuffers(64, 4, 10, 16, 513, 528, "cpu", max_decodes=8)
    assert buffers.meta.num_decodes == 4 and buffers.meta.decode_max_len == 160     # the capacity, the tables
    for step in (chunks, chunks[2:]):
        buffers.fill(step)
        ref = prefill_metadata(step, 16, 513, "cpu", ring_rows=528, max_decodes=8)
        d = ref.num_decodes
        assert torch.equal(buffers.meta.decodes[:, :d], ref.decodes)
        assert buffers.meta.decodes[:, d:].tolist() == [[0] * (4 - d), [0] * (4 - d), [0] * (4 - d), [-1] * (4 - d)]
        assert torch.equal(buffers.meta.tiles[:ref.num_tiles], ref.tiles)
        assert (buffers.meta.tiles[ref.num_tiles:] == torch.tensor([-1, 0])).all()


def test_metadata_ring_rows_are_distinct_per_slot():
    meta = prefill_metadata([Chunk(200, 2000, 4, [0] * 200), Chunk(0, 513, 2, [0] * 40)], 16, 513, "cpu")
    dst = meta.ring_dst.numpy()
    assert len(np.unique(dst)) == len(dst) == 2 * 513


@pytest.mark.parametrize("chunks", [[], [Chunk(0, 0, 0, [0])], [Chunk(0, 40, 0, [0, 1])], [Chunk(-1, 4, 0, [0])]])
def test_metadata_rejects_bad_entries(chunks):
    with pytest.raises(ValueError):
        prefill_metadata(chunks, 16, 513, "cpu")


def test_pools_bf16_or_fp8_pick_the_kernel_compile():
    """bf16 pools take the plain compile, e4m3 ones KV_FP8; other dtypes and mixed pairs are refused."""
    bf16 = torch.zeros(2, 16, 4, 128, dtype=torch.bfloat16)
    fp8 = torch.zeros(2, 16, 4, 128, dtype=torch.float8_e4m3fn)
    assert prefill_attention._check_kv(bf16, bf16.clone()) == (4, ())
    assert prefill_attention._check_kv(fp8, fp8.clone()) == (4, (("KV_FP8", 1),))
    for k, v in ((bf16, fp8), (fp8, bf16), (bf16.half(), bf16.half()), (bf16.float(), bf16.float()),
                 (fp8.view(torch.float8_e5m2), fp8.view(torch.float8_e5m2))):
        with pytest.raises(ValueError, match="dtype|KV pools must be"):
            prefill_attention._check_kv(k, v)


def test_launchers_reject_cpu_tensors():
    meta = prefill_metadata([Chunk(0, 4, 0, [0])], 16, 513, "cpu")
    qkv = torch.zeros(4, 40 * 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 16, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        prefill_attention.prefill_attention(qkv, k, k, meta, torch.zeros(32), False)


def test_static_buffers_hold_the_step_then_padding():
    chunks = [Chunk(0, 40, 1, [3, 4, 5]), Chunk(100, 1, 0, list(range(8)))]
    buffers = PrefillBuffers(64, 4, 10, 16, 513, 528, "cpu")
    for _ in range(2):                          # a second fill leaves no trace of the first
        buffers.fill(chunks)
        ref, got = prefill_metadata(chunks, 16, 513, "cpu", ring_rows=528), buffers.meta
        assert got.num_tokens == 64 and buffers.num_tokens.tolist() == [sum(c.num_tokens for c in chunks)]
        e = ref.num_entries
        assert torch.equal(got.entries[:e], ref.entries) and not got.entries[e:].any()
        assert torch.equal(got.tiles[:ref.num_tiles], ref.tiles)
        assert got.num_tiles == 64 // 16 + 4 and (got.tiles[ref.num_tiles:] == torch.tensor([-1, 0])).all()
        w = ref.block_tables.shape[1]
        assert torch.equal(got.block_tables[:e, :w], ref.block_tables)     # past each table: never read
        for name, pad in (("positions", 0), ("kv_rows", -1), ("ring_src", 0), ("ring_dst", -1)):
            real, static = getattr(ref, name), getattr(got, name)
            assert torch.equal(static[:real.numel()], real), name
            assert (static[real.numel():] == pad).all(), name
        chunks = [Chunk(0, 64, 2, [7, 8, 9, 10])]


def test_static_buffers_share_one_block_table_buffer():
    tables = torch.zeros(8, 10, dtype=torch.int32)
    small, large = (PrefillBuffers(t, e, 10, 16, 513, 528, "cpu", block_tables=tables) for t, e in ((32, 2), (64, 8)))
    small.fill([Chunk(0, 20, 0, [4, 5])])
    assert small.meta.block_tables.data_ptr() == large.meta.block_tables.data_ptr() == tables.data_ptr()
    assert tables[0, :2].tolist() == [4, 5]
    with pytest.raises(ValueError):
        PrefillBuffers(64, 9, 10, 16, 513, 528, "cpu", block_tables=tables)


def test_static_buffers_refuse_steps_they_cannot_hold():
    buffers = PrefillBuffers(32, 2, 4, 16, 513, 528, "cpu")
    assert buffers.fits([Chunk(0, 32, 0, [0, 1])])
    for chunks in ([Chunk(0, 33, 0, [0, 1, 2])], [Chunk(0, 1, i, [0]) for i in range(3)], [Chunk(0, 8, 0, [0] * 5)]):
        assert not buffers.fits(chunks)
        with pytest.raises(ValueError):
            buffers.fill(chunks)
