"""Prefill attention (kernels/prefill_attention.py) against model/reference.py on the paged KV layout.

Each case is a prompt step of one or more chunks (start position, tokens). History (positions before
a chunk) sits in the pool or ring as random K/V; every other pool and ring row is NaN, so a read
outside a request's keys shows up as NaN. Checks: the attention output of every request against
`attention_with_sinks` on the torch-normed q/k (bf16 bounds), and the cache left bit for bit as the
decode kernels (qk_norm_rope_kv_*) leave it token by token: the chunk's rows of the paged pool, or
the last <= 513 rows of the ring, the rest untouched. FP8 caches (e4m3, scale 1): the same cases on
the pools converted to e4m3; the reference reads what the kernels read (the e4m3 history and the
chunk's own rows exact, from q/k/v), and the cache must be the bf16 one as e4m3.
"""

import pytest
import torch

from flint_sched.kernels.attention import qk_norm_rope_kv_full, qk_norm_rope_kv_sliding
from flint_sched.kernels.prefill_attention import (
    Chunk,
    PrefillBuffers,
    prefill_attention,
    prefill_metadata,
    prefill_qk_norm_rope,
    prefill_ring_write,
)
from flint_sched.model.reference import apply_rope, attention_with_sinks, rms_norm
from gpu_checks import assert_close_bf16, gen
from test_kernel_attention import EPS, THETA, WINDOW, D, G, H, mixed_sinks, same_bits

pytestmark = pytest.mark.gpu

CHECK_ROWS = 256          # query rows checked per block of a long chunk (all rows of short ones)
FP8 = torch.float8_e4m3fn


class Case:
    """One prompt step: chunks [(start, tokens)], random raw q/k/v rows, history K/V in a NaN cache."""

    def __init__(self, chunks, sliding, block_size=16, seed=0):
        g = gen(seed)
        self.chunks, self.sliding, self.block_size = chunks, sliding, block_size
        t = sum(n for _, n in chunks)
        scale = torch.exp(0.5 * torch.randn(t, H + 2 * G, 1, device="cuda", generator=g))
        self.qkv = (torch.randn(t, H + 2 * G, D, device="cuda", generator=g) * scale).bfloat16().view(t, -1)
        self.q_w = (1 + 0.3 * torch.randn(D, device="cuda", generator=g)).bfloat16()
        self.k_w = (1 + 0.3 * torch.randn(D, device="cuda", generator=g)).bfloat16()
        self.sinks = mixed_sinks(seed + 1)
        self.history = []     # per chunk: (positions, k, v) already in the cache
        if sliding:
            slots = torch.randperm(len(chunks) + 2, device="cuda", generator=g)[:len(chunks)].tolist()
            self.k = torch.full((len(chunks) + 2, WINDOW, G, D), float("nan"), dtype=torch.bfloat16, device="cuda")
            self.tables = [[0] * -(-(s + n) // block_size) for s, n in chunks]     # unused by sliding layers
        else:
            need = [-(-(s + n) // block_size) for s, n in chunks]
            ids = torch.randperm(sum(need) + 1, device="cuda", generator=g).tolist()   # + one NaN block
            self.k = torch.full((sum(need) + 1, block_size, G, D), float("nan"), dtype=torch.bfloat16, device="cuda")
            self.tables, start = [], 0
            for n_blocks in need:
                self.tables.append(ids[start:start + n_blocks])
                start += n_blocks
            slots = list(range(len(chunks)))
        self.v = torch.full_like(self.k, float("nan"))
        self.slots = slots
        for b, (s, n) in enumerate(chunks):
            pos = torch.arange(max(0, s - WINDOW) if sliding else 0, s, device="cuda")
            k = torch.randn(pos.numel(), G, D, device="cuda", generator=g).bfloat16()
            v = torch.randn(pos.numel(), G, D, device="cuda", generator=g).bfloat16()
            self.k[self.rows(b, pos)], self.v[self.rows(b, pos)] = k, v
            self.history.append((pos, k, v))

    def rows(self, b, pos):
        """Cache index (page, row) of positions of chunk b."""
        if self.sliding:
            return self.slots[b], pos % WINDOW
        table = torch.tensor(self.tables[b], device="cuda")
        return table[pos // self.block_size], pos % self.block_size

    def metadata(self):
        chunks = [Chunk(s, n, self.slots[b], self.tables[b]) for b, (s, n) in enumerate(self.chunks)]
        return prefill_metadata(chunks, self.block_size, WINDOW, "cuda")


def reference_qkv(qkv, q_w, k_w, positions, rope):
    x = qkv.view(qkv.shape[0], H + 2 * G, D)
    q, k, v = rms_norm(x[:, :H], q_w, EPS), rms_norm(x[:, H:H + G], k_w, EPS), x[:, H + G:]
    if rope:
        q, k = apply_rope(q, positions, THETA), apply_rope(k, positions, THETA)
    return q, k, v


def checked_rows(n):
    """All rows of a short chunk; blocks at the start, middle and end of a long one."""
    if n <= 3 * CHECK_ROWS:
        return torch.arange(n, device="cuda")
    mid = n // 2 - CHECK_ROWS // 2
    return torch.cat([torch.arange(a, a + CHECK_ROWS, device="cuda") for a in (0, mid, n - CHECK_ROWS)])


def run_case(case: Case, kernel: str = "mma", kv_dtype: torch.dtype = torch.bfloat16):
    """The step on the case's cache (kv_dtype FP8: on a copy of it as e4m3), checked against the
    reference and the cache against check_cache's."""
    meta = case.metadata()
    raw = case.qkv.clone()
    k_before, v_before = case.k.clone(), case.v.clone()
    fp8 = kv_dtype == FP8
    k_cache, v_cache = (case.k.to(FP8), case.v.to(FP8)) if fp8 else (case.k, case.v)
    pools = () if case.sliding else (k_cache, v_cache)
    qkv = prefill_qk_norm_rope(case.qkv, case.q_w, case.k_w, meta, EPS, THETA if case.sliding else None, *pools)
    out = torch.full((meta.num_tokens, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    prefill_attention(qkv, k_cache, v_cache, meta, case.sinks, case.sliding, out=out, kernel=kernel)
    read = (k_cache.bfloat16(), v_cache.bfloat16()) if fp8 else None      # the cache after the attention read it
    if case.sliding:
        prefill_ring_write(qkv, k_cache, v_cache, meta)
    torch.cuda.synchronize()
    kind = ("sliding" if case.sliding else f"full bs={case.block_size}") + f" {kernel or 'default'} kernel"
    kind += " fp8 cache" if fp8 else ""
    first = 0
    for b, (s, n) in enumerate(case.chunks):
        what = f"{kind} chunk {b} (start {s}, {n} tokens of {case.chunks})"
        rows = slice(first, first + n)
        pos = torch.arange(s, s + n, device="cuda")
        q, k, v = reference_qkv(raw[rows], case.q_w, case.k_w, pos, case.sliding)
        hist_pos, hist_k, hist_v = case.history[b]
        if fp8:     # e4m3 history; the chunk's own rows exact (from q/k/v) on both kinds of layers
            hist_k, hist_v = read[0][case.rows(b, hist_pos)], read[1][case.rows(b, hist_pos)]
        k_all, v_all, k_pos = torch.cat((hist_k, k)), torch.cat((hist_v, v)), torch.cat((hist_pos, pos))
        window = WINDOW if case.sliding else None
        idx = checked_rows(n)
        refs = []
        for block in idx.split(CHECK_ROWS):
            qp = pos[block]
            lo = 0 if window is None else max(0, int(qp.min()) - WINDOW + 1)
            sel = (k_pos >= lo) & (k_pos <= int(qp.max()))
            refs.append(attention_with_sinks(q[block].float(), k_all[sel].float(), v_all[sel].float(),
                                             case.sinks.float(), qp, k_pos[sel], window))
        assert_close_bf16(out[rows][idx], torch.cat(refs), what, rtol=2.0**-7, abs_frac=2.0**-8)
        first += n
    check_cache(case, raw, meta, k_before, v_before, k_cache, v_cache)


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_cache(case, raw, meta, k_before, v_before, k_cache, v_cache):
    """The cache as the decode kernels leave it after writing the same positions one token at a time
    (into bf16 k_before / v_before; an e4m3 cache must hold that as e4m3)."""
    k_exp, v_exp = k_before, v_before
    first = 0
    for b, (s, n) in enumerate(case.chunks):
        keep = range(max(0, n - WINDOW), n) if case.sliding else range(n)
        for a in range(keep.start, keep.stop, 1024):               # the decode kernels take <= 1024 rows
            rows = torch.arange(a, min(a + 1024, keep.stop), device="cuda")
            positions = (s + rows).int()
            if case.sliding:
                slots = torch.full_like(positions, case.slots[b])
                qk_norm_rope_kv_sliding(raw[first + rows], case.q_w, case.k_w, positions, k_exp, v_exp, slots,
                                        EPS, THETA)
            else:
                tables = torch.tensor(case.tables[b], dtype=torch.int32, device="cuda").expand(rows.numel(), -1)
                qk_norm_rope_kv_full(raw[first + rows], case.q_w, case.k_w, positions, k_exp, v_exp,
                                     tables.contiguous(), EPS)
        first += n
    torch.cuda.synchronize()
    kind = ("ring" if case.sliding else "paged pool") + (" (e4m3)" if k_cache.dtype == FP8 else "")
    k_exp, v_exp = k_exp.to(k_cache.dtype), v_exp.to(v_cache.dtype)
    assert same_bytes(k_cache, k_exp), f"{kind} K differs from token-by-token decode ({case.chunks})"
    assert same_bytes(v_cache, v_exp), f"{kind} V differs from token-by-token decode ({case.chunks})"


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("tokens", [1, 512, 513, 514, 1000, 20_000])
def test_whole_prompt(tokens, sliding):
    run_case(Case([(0, tokens)], sliding, seed=tokens))


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("start,tokens", [(700, 300), (1000, 37), (300, 513), (520, 1), (5000, 2000)])
def test_chunk_after_history(start, tokens, sliding):
    """Chunks that start inside a block and inside the window: history from the pool or ring."""
    run_case(Case([(start, tokens)], sliding, seed=start + tokens))


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("block_size", [16, 7])
def test_several_requests_in_one_launch(block_size, sliding):
    chunks = [(0, 1), (0, 513), (700, 300), (1000, 37), (5, 1), (0, 1000), (2000, 514), (16, 17)]
    run_case(Case(chunks, sliding, block_size=block_size, seed=block_size))


def test_prompt_in_chunks_equals_one_pass():
    """A 1200-token prompt on a sliding layer read in steps of 256 (each step: its own keys and the
    ring's history) and in one pass: both against the reference, and the same ring at the end."""
    n, chunk = 1200, 256
    case = Case([(0, n)], sliding=True, seed=78)
    pos = torch.arange(n, device="cuda")
    q, k, v = reference_qkv(case.qkv, case.q_w, case.k_w, pos, True)
    ref = torch.cat([attention_with_sinks(q[a:a + 256].float(), k.float(), v.float(), case.sinks.float(),
                                          pos[a:a + 256], pos, WINDOW) for a in range(0, n, 256)])
    rings = []
    for steps in ([(a, min(chunk, n - a)) for a in range(0, n, chunk)], [(0, n)]):
        k_ring, v_ring = torch.full_like(case.k, float("nan")), torch.full_like(case.v, float("nan"))
        outs = []
        for s, m in steps:
            meta = prefill_metadata([Chunk(s, m, case.slots[0], [0] * 100)], 16, WINDOW, "cuda")
            qkv = case.qkv[s:s + m].clone()
            prefill_qk_norm_rope(qkv, case.q_w, case.k_w, meta, EPS, THETA)
            outs.append(prefill_attention(qkv, k_ring, v_ring, meta, case.sinks, True))
            prefill_ring_write(qkv, k_ring, v_ring, meta)
        assert_close_bf16(torch.cat(outs), ref, f"prefill in {len(steps)} steps", rtol=2.0**-7, abs_frac=2.0**-8)
        rings.append((k_ring, v_ring))
    assert same_bits(rings[0][0], rings[1][0]) and same_bits(rings[0][1], rings[1][1]), "rings differ"


def test_rejects_bad_inputs():
    case = Case([(0, 40)], sliding=False)
    meta = case.metadata()
    with pytest.raises(ValueError):
        prefill_attention(case.qkv.float(), case.k, case.v, meta, case.sinks, False)
    with pytest.raises(ValueError):
        prefill_attention(case.qkv[:, :-128], case.k, case.v, meta, case.sinks, False)   # not (8G + 2G) heads
    with pytest.raises(ValueError):
        prefill_attention(case.qkv, case.k, case.v, meta, case.sinks[:8], False)
    with pytest.raises(ValueError):
        prefill_attention(case.qkv, case.k, case.v, meta, case.sinks, True)              # pool is no ring
    with pytest.raises(ValueError):
        prefill_qk_norm_rope(case.qkv, case.q_w, case.k_w, meta, EPS, None, case.k, None)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_padded_static_buffers_give_the_exact_step(sliding):
    """The same step through PrefillBuffers (what prompt graphs replay: rows padded to 2,048, padding
    tiles, kv_rows and ring rows -1) and through exact metadata: the same output rows and the same
    cache, bit for bit; the padding rows write nothing."""
    chunks = [(0, 1), (700, 300), (1000, 37), (0, 513), (16, 17)]
    runs = []
    for padded in (False, True):
        case = Case(chunks, sliding, seed=91)
        t = case.qkv.shape[0]
        entries = [Chunk(s, n, case.slots[b], case.tables[b]) for b, (s, n) in enumerate(chunks)]
        if padded:
            buffers = PrefillBuffers(2048, 16, max(map(len, case.tables)) + 3, case.block_size, WINDOW, WINDOW, "cuda")
            buffers.fill(entries)
            meta = buffers.meta
            qkv = torch.cat([case.qkv, torch.randn(2048 - t, case.qkv.shape[1], device="cuda").bfloat16()])
        else:
            meta, qkv = prefill_metadata(entries, case.block_size, WINDOW, "cuda"), case.qkv.clone()
        pools = () if sliding else (case.k, case.v)
        prefill_qk_norm_rope(qkv, case.q_w, case.k_w, meta, EPS, THETA if sliding else None, *pools)
        out = prefill_attention(qkv, case.k, case.v, meta, case.sinks, sliding)
        if sliding:
            prefill_ring_write(qkv, case.k, case.v, meta)
        torch.cuda.synchronize()
        runs.append((out[:t], case.k, case.v))
    (out_a, k_a, v_a), (out_b, k_b, v_b) = runs
    assert same_bits(out_a, out_b), "outputs differ"
    assert same_bits(k_a, k_b) and same_bits(v_a, v_b), "the padding rows touched the cache"


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("chunks", [[(0, 1)], [(0, 1000)], [(700, 300)], [(5000, 2000)],
                                    [(0, 1), (0, 513), (700, 300), (1000, 37), (5, 1), (0, 1000), (2000, 514)]],
                         ids=["1", "1000", "700+300", "5000+2000", "several"])
@pytest.mark.parametrize("kernel", ["wgmma", "wgmma-tma"])
def test_wgmma_kernel_against_the_reference(chunks, sliding, kernel):
    """prefill_attention_wgmma_bf16 (a producer warpgroup, two consumers on warpgroup MMAs taking
    turns, V transposed by the instruction; full layers' whole tiles by TMA or cp.async) on the cases
    of the mma.sync kernel: outputs against the reference, the cache as token-by-token decode leaves
    it. The pools start as NaN, so a page read past the keys shows."""
    run_case(Case(chunks, sliding, seed=len(chunks) * 31 + chunks[0][1]), kernel=kernel)


FP8_CASES = {"700+300": ([(700, 300)], 16), "1000+37": ([(1000, 37)], 16), "5000+2000": ([(5000, 2000)], 16),
             "several": ([(0, 1), (0, 513), (700, 300), (1000, 37), (5, 1), (0, 1000), (2000, 514), (16, 17)], 16),
             "several-bs7": ([(0, 1), (700, 300), (1000, 37), (16, 17)], 7)}


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("chunks,block_size", list(FP8_CASES.values()), ids=list(FP8_CASES))
@pytest.mark.parametrize("kernel", ["mma", "wgmma", "wgmma-tma"])
def test_fp8_cache_against_the_reference(kernel, chunks, block_size, sliding):
    """Both kernels on an e4m3 cache (KV_FP8 compiles; "wgmma-tma" falls back to "wgmma"): pool and
    ring rows converted to bf16 on the way into shared memory, the fresh rows of sliding layers read as
    bf16. Chunks after history and several requests in one launch; the NaN rows stay NaN in e4m3."""
    if kernel != "mma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90a")
    run_case(Case(chunks, sliding, block_size=block_size, seed=len(chunks) * 17 + chunks[0][1]), kernel, FP8)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("chunks", [[(0, 2000)], [(0, 1), (0, 513), (700, 300), (2000, 514), (16, 17)]],
                         ids=["lone", "several"])
def test_fp8_fresh_tiles_by_the_bf16_copies(chunks, sliding):
    """With an e4m3 cache, tiles of fresh rows only take the bf16 producer path (a lone prompt: all
    of them, over many tiles), tiles with history the e4m3 one, in one launch."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90a")
    run_case(Case(chunks, sliding, seed=len(chunks) * 13 + 5), "wgmma", FP8)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_fp8_cache_rows_are_the_bf16_rows_as_e4m3(sliding):
    """prefill_qk_norm_rope (full layers: K normed, V as is, to the pool) and prefill_ring_write
    (sliding layers) on e4m3 pools store exactly the bf16 run's values converted by torch (values well
    inside +-448, where saturating and torch's conversion agree), and leave q/k/v as the bf16 run does."""
    chunks = [(0, 1), (700, 300), (1000, 37), (0, 513), (16, 17)]
    case = Case(chunks, sliding, seed=23)
    meta = case.metadata()
    k8, v8 = case.k.to(FP8), case.v.to(FP8)
    qkv_bf16, qkv_fp8 = case.qkv.clone(), case.qkv.clone()
    rope = THETA if sliding else None
    prefill_qk_norm_rope(qkv_bf16, case.q_w, case.k_w, meta, EPS, rope, *(() if sliding else (case.k, case.v)))
    prefill_qk_norm_rope(qkv_fp8, case.q_w, case.k_w, meta, EPS, rope, *(() if sliding else (k8, v8)))
    if sliding:
        prefill_ring_write(qkv_bf16, case.k, case.v, meta)
        prefill_ring_write(qkv_fp8, k8, v8, meta)
    torch.cuda.synchronize()
    assert same_bits(qkv_bf16, qkv_fp8), "q/k/v differ between the bf16 and e4m3 caches"
    written = ~torch.isnan(case.k.float())
    assert float(case.k.float()[written].abs().max()) < 448 and float(case.v.float()[written].abs().max()) < 448
    assert same_bytes(k8, case.k.to(FP8)), "e4m3 K is not the bf16 K converted"
    assert same_bytes(v8, case.v.to(FP8)), "e4m3 V is not the bf16 V converted"
