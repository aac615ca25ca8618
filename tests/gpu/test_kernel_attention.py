"""Decode-attention kernels against model/reference.py on the paged KV layout of executor/kv_cache.py.

Pools start as NaN and only the positions a request owns are filled, so any read outside a
request's keys (masked tail, unused ring rows, padding blocks) shows up as NaN in the output.
Failures name the case, the request, its context length and the worst (head, dim).
"""

import pytest
import torch

from flint_sched.kernels import attention
from flint_sched.kernels.attention import (
    TICKET_SLOTS,
    attention_workspace,
    decode_attention_full,
    decode_attention_sliding,
    decode_splits,
    one_split_below,
    qk_norm_rope_kv_full,
    qk_norm_rope_kv_sliding,
)
from flint_sched.model.reference import apply_rope, attention_with_sinks, rms_norm
from gpu_checks import gen

pytestmark = pytest.mark.gpu

H, G, D = 32, 4, 128
WINDOW = 513
EPS = 1e-5
THETA = 10000.0
CONTEXTS = [1, 2, 7, 512, 513, 514, 1000, 4097, 32768]
LONG = 100_000



def mixed_sinks(seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Per head: 8 ordinary (N(0, 2)), 8 large positive (+20..+40), 8 large negative (-30, -1e4), 8 zero."""
    g = gen(seed)
    ordinary = 2 * torch.randn(8, device="cuda", generator=g)
    positive = 20 + 20 * torch.rand(8, device="cuda", generator=g)
    negative = torch.tensor([-30.0, -1e4] * 4, device="cuda")
    return torch.cat([ordinary, positive, negative, torch.zeros(8, device="cuda")]).to(dtype)


def assert_attention_close(out, ref, what, lens):
    """Per request: no NaN, rel. L2 < 1e-2, |out - ref| <= 2^-7 |ref| + 2^-8 max|ref| (bf16 out, fp32 ref)."""
    out, ref = out.float(), ref.float()
    for b in range(out.shape[0]):
        o, r, tag = out[b], ref[b], f"{what}: request {b} (seq_len {lens[b]})"
        nan = torch.isnan(o)
        assert not nan.any(), f"{tag}: {int(nan.sum())} NaN outputs, first (head, dim) {nan.nonzero()[0].tolist()}"
        scale = float(r.abs().max())
        if scale == 0.0:
            assert float(o.abs().max()) == 0.0, f"{tag}: reference is all zero, kernel max |out| {float(o.abs().max())}"
            continue
        rel = float((o - r).norm() / r.norm())
        excess = (o - r).abs() - (2.0**-7 * r.abs() + 2.0**-8 * scale)
        worst = int(excess.argmax())
        head, dim = divmod(worst, D)
        assert rel < 1e-2 and float(excess.flatten()[worst]) <= 0, (
            f"{tag}: rel L2 {rel:.3e}, max abs err {float((o - r).abs().max()):.3e} (max |ref| {scale:.3e}); "
            f"worst at head {head} dim {dim}: out {float(o[head, dim])}, ref {float(r[head, dim])}; "
            f"{int((excess > 0).sum())} elements over the bound")


# ---- paged (full) layers ------------------------------------------------------------------------


def paged_case(lens, block_size=16, seed=0, table_tokens=0):
    """NaN pools with random K/V at each request's positions, block ids shuffled; tables padded with a NaN block
    (to cover `table_tokens` positions at least)."""
    g = gen(seed)
    blocks_per = [max(1, -(-n // block_size)) for n in lens]
    num_blocks = sum(blocks_per) + 1
    ids = torch.randperm(num_blocks, device="cuda", generator=g).int()
    pad_block = ids[-1]
    width = max(max(blocks_per), -(-table_tokens // block_size))
    tables = torch.full((len(lens), width), int(pad_block), dtype=torch.int32, device="cuda")
    k = torch.full((num_blocks, block_size, G, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    v = torch.full_like(k, float("nan"))
    start, owned = 0, []
    for b, (n, nb) in enumerate(zip(lens, blocks_per)):
        tables[b, :nb] = ids[start:start + nb]
        start += nb
        pos = torch.arange(n, device="cuda")
        blocks, rows = tables[b].long()[pos // block_size], pos % block_size
        k[blocks, rows] = torch.randn(n, G, D, device="cuda", generator=g).bfloat16()
        v[blocks, rows] = torch.randn(n, G, D, device="cuda", generator=g).bfloat16()
        owned.append((blocks, rows))
    q = (2 * torch.randn(len(lens), H, D, device="cuda", generator=g)).bfloat16()
    return q, k, v, tables, owned


def reference_full(q, k, v, owned, lens, sinks):
    outs = []
    for b, n in enumerate(lens):
        if n == 0:
            outs.append(torch.zeros(H, D, device="cuda"))
            continue
        blocks, rows = owned[b][0][:n], owned[b][1][:n]
        pos = torch.arange(n, device="cuda")
        outs.append(attention_with_sinks(q[b:b + 1].float(), k[blocks, rows].float(), v[blocks, rows].float(),
                                         sinks.float(), pos[-1:], pos, None)[0])
    return torch.stack(outs)


def run_full(lens, block_size=16, max_seq_len=None, num_splits=None, sinks_dtype=torch.bfloat16, seed=0,
             kv_dtype=torch.bfloat16):
    q, k, v, tables, owned = paged_case(lens, block_size, seed, table_tokens=max_seq_len or 0)
    k, v = k.to(kv_dtype), v.to(kv_dtype)     # e4m3: the reference reads the same rounded keys
    sinks = mixed_sinks(seed + 1, sinks_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    ws = attention_workspace("cuda", max_splits=num_splits)
    ws[TICKET_SLOTS:] = float("nan")  # partials must be written before they are read
    bound = max_seq_len or max(max(lens), 1)
    decode_attention_full(q, k, v, tables, seq_lens, sinks, ws, bound, out=out, num_splits=num_splits)
    splits = num_splits or decode_splits(len(lens), bound)
    what = f"full bs={block_size} B={len(lens)} splits={splits} bound={bound} kv {kv_dtype}"
    assert_attention_close(out, reference_full(q, k, v, owned, lens, sinks), what, lens)
    assert int(ws[:TICKET_SLOTS].view(torch.int32).abs().sum()) == 0, f"{what}: tickets not reset"


@pytest.mark.parametrize("context", CONTEXTS + [LONG])
def test_full_batch1(context):
    run_full([context])


@pytest.mark.parametrize("batch", [3, 8, 19, 300])
def test_full_mixed_lengths(batch):
    lens = [CONTEXTS[(3 * i + batch) % len(CONTEXTS)] for i in range(batch)]
    if batch == 3:
        lens[0] = LONG
    run_full(lens, seed=batch)


@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
def test_full_block_sizes(block_size):
    run_full([5, 300, 1000], block_size=block_size, seed=block_size)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 17, 128])
def test_full_forced_splits(num_splits):
    run_full([1, 700, 4097], num_splits=num_splits, seed=num_splits)


def test_full_bound_far_above_lengths():
    """A graph captured for 100K serving short requests: most splits exit early."""
    run_full([1, 64, 65, 1000, 4097], max_seq_len=LONG, seed=7)


@pytest.mark.parametrize("batch,bound", [(64, LONG), (128, 2_048)])
def test_full_wide_splits_serve_short_and_long_requests(batch, bound):
    """A grid of several waves (decode_splits' wide splits): requests shorter than one_split_below
    take one split, longer ones every split, padding requests none; all match the reference."""
    splits = decode_splits(batch, bound)
    below = one_split_below(batch, splits)
    assert splits > 1 and below > 0, (splits, below)
    around = [0, 1, 64, below - 1, below, below + 1, 1_000, bound]
    run_full([around[i % len(around)] for i in range(batch)], max_seq_len=bound, seed=batch)


def test_full_fp32_sinks_and_padding_request():
    run_full([0, 513, 0, 2], sinks_dtype=torch.float32, seed=8)


# ---- sliding layers (ring) ----------------------------------------------------------------------


def ring_case(lens, seed=0, rows=WINDOW):
    """NaN rings of `rows` rows (two spare slots); request b's visible positions at row p % rows of a
    shuffled slot (rows > WINDOW: the engine's rings, kv_allocator.ring_rows; the rest stays NaN)."""
    g = gen(seed)
    num_slots = len(lens) + 2
    slots = torch.randperm(num_slots, device="cuda", generator=g)[:len(lens)].int()
    k = torch.full((num_slots, rows, G, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    v = torch.full_like(k, float("nan"))
    kv = []
    for b, n in enumerate(lens):
        pos = torch.arange(max(0, n - WINDOW), n, device="cuda")
        kb = torch.randn(pos.numel(), G, D, device="cuda", generator=g).bfloat16()
        vb = torch.randn(pos.numel(), G, D, device="cuda", generator=g).bfloat16()
        k[int(slots[b]), pos % rows], v[int(slots[b]), pos % rows] = kb, vb
        kv.append((pos, kb, vb))
    q = (2 * torch.randn(len(lens), H, D, device="cuda", generator=g)).bfloat16()
    return q, k, v, slots, kv


def run_sliding(lens, num_splits=None, seed=0, rows=WINDOW, kv_dtype=torch.bfloat16):
    q, k, v, slots, kv = ring_case(lens, seed, rows)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    kv = [(pos, kb.to(kv_dtype), vb.to(kv_dtype)) for pos, kb, vb in kv]
    sinks = mixed_sinks(seed + 1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    ws = attention_workspace("cuda", max_splits=num_splits)
    ws[TICKET_SLOTS:] = float("nan")
    decode_attention_sliding(q, k, v, slots, seq_lens, sinks, ws, out=out, num_splits=num_splits, window=WINDOW)
    ref = torch.stack([attention_with_sinks(q[b:b + 1].float(), kb.float(), vb.float(), sinks.float(), pos[-1:], pos,
                                            WINDOW)[0] for b, (pos, kb, vb) in enumerate(kv)])
    splits = num_splits or decode_splits(len(lens), WINDOW)
    assert_attention_close(out, ref, f"sliding B={len(lens)} splits={splits} kv {kv_dtype}", lens)


@pytest.mark.parametrize("context", CONTEXTS + [LONG, 262_144])
def test_sliding_batch1(context):
    run_sliding([context])


def test_sliding_ring_longer_than_the_window():
    """The engine's rings hold WINDOW + 15 rows (a prefix-cache snapshot after a prompt's last
    chunk): the kernel attends the last WINDOW positions, found at p % rows."""
    run_sliding([1, 512, 513, 514, 528, 529, 530, 1000, 4097], seed=9, rows=WINDOW + 15)


@pytest.mark.parametrize("batch", [3, 8, 19, 300])
def test_sliding_mixed_lengths(batch):
    run_sliding([CONTEXTS[(5 * i + batch) % len(CONTEXTS)] + 1000 * (i % 3) for i in range(batch)], seed=batch)


@pytest.mark.parametrize("num_splits", [1, 3, 9, 64])
def test_sliding_forced_splits(num_splits):
    run_sliding([513, 514, 2000, 7], num_splits=num_splits, seed=20 + num_splits)


# ---- FP8 (e4m3) cache -----------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("lens", [[1], [7, 513, 1000], [LONG], [CONTEXTS[i % len(CONTEXTS)] for i in range(300)]],
                         ids=["1", "mixed", "long", "300"])
def test_fp8_full(lens):
    """The e4m3 cache against the reference over the same e4m3 keys and values (NaN outside them)."""
    run_full(lens, seed=len(lens) + 60, kv_dtype=FP8)


@pytest.mark.parametrize("num_splits", [1, 5, 128])
def test_fp8_full_forced_splits(num_splits):
    run_full([1, 700, 4097], num_splits=num_splits, seed=70 + num_splits, kv_dtype=FP8)


@pytest.mark.parametrize("batch", [1, 19, 300])
def test_fp8_sliding(batch):
    run_sliding([CONTEXTS[(5 * i + batch) % len(CONTEXTS)] + 1000 * (i % 3) for i in range(batch)], seed=80 + batch,
                rows=WINDOW + 15, kv_dtype=FP8)


def test_fp8_block_sizes_and_padding():
    run_full([0, 5, 300, 1000], block_size=7, sinks_dtype=torch.float32, seed=90, kv_dtype=FP8)


# ---- tile rows by bulk copies or cp.async (attention.CP_ASYNC_DTYPES) -----------------------------


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("cp_async", [False, True], ids=["bulk", "cp_async"])
def test_tile_loaders(kv_dtype, cp_async, monkeypatch):
    """Both loaders for both dtypes (each dtype's default is tested above): partial tiles zero-filled
    (NaN pools), paged and ring rows, several split counts."""
    monkeypatch.setattr(attention, "CP_ASYNC_DTYPES", attention.KV_DTYPES if cp_async else ())
    run_full([1, 7, 513, 1000, 4097, LONG], block_size=7, seed=100, kv_dtype=kv_dtype)
    run_full([CONTEXTS[i % len(CONTEXTS)] for i in range(300)], seed=101, kv_dtype=kv_dtype)
    run_full([1, 700, 4097], num_splits=5, seed=102, kv_dtype=kv_dtype)
    run_sliding([CONTEXTS[(5 * i) % len(CONTEXTS)] + 1000 * (i % 3) for i in range(19)], seed=103, rows=WINDOW + 15,
                kv_dtype=kv_dtype)


# ---- one graph, growing lengths --------------------------------------------------------------------


def test_graph_replay_as_lengths_grow():
    lens0 = [3, 600, 2000]
    q, k, v, tables, owned = paged_case([5000] * 3, seed=30)
    sinks = mixed_sinks(31)
    seq_lens = torch.tensor(lens0, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    ws = attention_workspace("cuda")
    decode_attention_full(q, k, v, tables, seq_lens, sinks, ws, 5000, out=out)  # compile + load
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention_full(q, k, v, tables, seq_lens, sinks, ws, 5000, out=out)
    for step, lens in enumerate([lens0, [4, 601, 2001], [64, 1024, 4999], [5000, 1, 65]]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, reference_full(q, k, v, owned, lens, sinks), f"graph replay {step}", lens)


# ---- fused Q/K norm + RoPE + KV write ------------------------------------------------------------------


def qkv_case(batch, seed):
    g = gen(seed)
    scale = torch.exp(torch.randn(batch, H + 2 * G, 1, device="cuda", generator=g))  # per-head magnitudes
    qkv = (torch.randn(batch, H + 2 * G, D, device="cuda", generator=g) * scale).bfloat16().view(batch, -1)
    q_w = (1 + 0.3 * torch.randn(D, device="cuda", generator=g)).bfloat16()
    k_w = (1 + 0.3 * torch.randn(D, device="cuda", generator=g)).bfloat16()
    return qkv, q_w, k_w


def reference_qkv(qkv, q_w, k_w, positions, rope):
    x = qkv.view(qkv.shape[0], H + 2 * G, D)
    q, k, v = rms_norm(x[:, :H], q_w, EPS), rms_norm(x[:, H:H + G], k_w, EPS), x[:, H + G:]
    if rope:
        q, k = apply_rope(q, positions.long(), THETA), apply_rope(k, positions.long(), THETA)
    return q, k, v


def assert_bf16_match(out, ref, what):
    """bf16 vs the same torch ops in bf16: >= 99 % bit-equal (fp32 sum order in the norm may flip a rounding),
    the rest within 2 bf16 ulps of their row's scale: |out - ref| <= 2^-6 |ref| + 2^-8 rms(row)."""
    o, r = out.float(), ref.float()
    assert not torch.isnan(o).any(), f"{what}: NaN in output"
    equal = float((o == r).float().mean())
    bound = 2.0**-6 * r.abs() + 2.0**-8 * r.pow(2).mean(-1, keepdim=True).sqrt()
    excess = (o - r).abs() - bound
    worst = int(excess.argmax())
    idx = list(torch.unravel_index(torch.tensor(worst), o.shape))
    assert equal >= 0.99 and float(excess.flatten()[worst]) <= 0, (
        f"{what}: {equal:.4%} bit-equal; worst at {[int(i) for i in idx]}: out {float(o.flatten()[worst])}, "
        f"ref {float(r.flatten()[worst])}")


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("batch", [1, 3, 8, 19, 300])
def test_qk_norm_rope_kv_sliding(batch):
    qkv, q_w, k_w = qkv_case(batch, seed=40 + batch)
    special = [0, 1, 511, 512, 513, 70_000, 262_143]
    positions = torch.tensor([special[i % len(special)] + 3 * (i // len(special)) for i in range(batch)],
                             dtype=torch.int32, device="cuda")
    slots = torch.randperm(batch + 2, device="cuda", generator=gen(batch))[:batch].int()
    k_ring = torch.randn(batch + 2, WINDOW, G, D, device="cuda", generator=gen(1)).bfloat16()
    v_ring = torch.randn_like(k_ring)
    k_before, v_before = k_ring.clone(), v_ring.clone()
    q_out = torch.full((batch, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    qk_norm_rope_kv_sliding(qkv, q_w, k_w, positions, k_ring, v_ring, slots, EPS, THETA, q_out=q_out)
    q_ref, k_ref, v_ref = reference_qkv(qkv, q_w, k_w, positions, rope=True)
    assert_bf16_match(q_out, q_ref, f"sliding q (positions {positions.tolist()})")
    rows = positions.long() % WINDOW
    assert_bf16_match(k_ring[slots.long(), rows], k_ref, "sliding k rows")
    assert same_bits(v_ring[slots.long(), rows], v_ref), "sliding v rows must be the raw v"
    k_ring[slots.long(), rows], v_ring[slots.long(), rows] = k_before[slots.long(), rows], v_before[slots.long(), rows]
    assert same_bits(k_ring, k_before) and same_bits(v_ring, v_before), "ring rows other than the new ones changed"


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("batch", [1, 19])
def test_qk_norm_kv_full(batch, block_size):
    qkv, q_w, k_w = qkv_case(batch, seed=50 + batch)
    max_blocks = 40
    num_blocks = batch * max_blocks
    tables = torch.randperm(num_blocks, device="cuda", generator=gen(2)).int().view(batch, max_blocks)
    positions = torch.randint(0, max_blocks * block_size, (batch,), device="cuda", generator=gen(3)).int()
    if batch > 1:
        positions[0] = -1  # padding: nothing written
    k_pool = torch.randn(num_blocks, block_size, G, D, device="cuda", generator=gen(4)).bfloat16()
    v_pool = torch.randn_like(k_pool)
    k_before, v_before = k_pool.clone(), v_pool.clone()
    q_out = torch.full((batch, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    qk_norm_rope_kv_full(qkv, q_w, k_w, positions, k_pool, v_pool, tables, EPS, q_out=q_out)
    q_ref, k_ref, v_ref = reference_qkv(qkv, q_w, k_w, positions, rope=False)
    assert_bf16_match(q_out, q_ref, "full q (no RoPE)")
    live = (positions >= 0).nonzero().flatten()
    pos = positions[live].long()
    blocks, rows = tables[live].long().gather(1, (pos // block_size)[:, None])[:, 0], pos % block_size
    assert_bf16_match(k_pool[blocks, rows], k_ref[live], "full k rows")
    assert same_bits(v_pool[blocks, rows], v_ref[live]), "full v rows must be the raw v"
    k_pool[blocks, rows], v_pool[blocks, rows] = k_before[blocks, rows], v_before[blocks, rows]
    assert same_bits(k_pool, k_before) and same_bits(v_pool, v_before), "pool rows other than the new ones changed"


@pytest.mark.parametrize("sliding", [False, True])
def test_qk_norm_rope_kv_into_an_fp8_cache(sliding):
    """The e4m3 cache receives exactly the bf16 cache's K and V rows rounded to e4m3, and nothing else."""
    batch, rows = 19, WINDOW
    qkv, q_w, k_w = qkv_case(batch, seed=95)
    positions = torch.randint(0, 5000, (batch,), device="cuda", generator=gen(5)).int()
    slots = torch.randperm(batch + 2, device="cuda", generator=gen(6))[:batch].int()
    tables = torch.randperm(batch * 400, device="cuda", generator=gen(7)).int().view(batch, 400)
    results = []
    for dtype in (torch.bfloat16, FP8):
        shape = (batch + 2, rows, G, D) if sliding else (batch * 400, 16, G, D)
        k_pool = torch.zeros(shape, dtype=dtype, device="cuda")
        v_pool = torch.zeros_like(k_pool)
        q_out = torch.empty(batch, H, D, dtype=torch.bfloat16, device="cuda")
        if sliding:
            qk_norm_rope_kv_sliding(qkv, q_w, k_w, positions, k_pool, v_pool, slots, EPS, THETA, q_out=q_out)
        else:
            qk_norm_rope_kv_full(qkv, q_w, k_w, positions, k_pool, v_pool, tables, EPS, q_out=q_out)
        results.append((q_out, k_pool, v_pool))
    (q16, k16, v16), (q8, k8, v8) = results
    assert same_bits(q16, q8)
    assert float(k16.float().abs().max()) < 448 and float(v16.float().abs().max()) < 448   # in e4m3's range
    assert torch.equal(k8.view(torch.uint8), k16.to(FP8).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v16.to(FP8).view(torch.uint8))


def test_decode_step_on_a_wrapped_ring():
    """Kernel 1 then attention, against the torch path of executor/torch_executor.py, positions past the window."""
    batch, lens = 3, [2000, 514, 100_000]
    qkv, q_w, k_w = qkv_case(batch, seed=60)
    _, k_ring, v_ring, slots, kv = ring_case([n - 1 for n in lens], seed=61)  # history: positions < n - 1
    positions = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device="cuda")
    sinks = mixed_sinks(62)
    q_out = qk_norm_rope_kv_sliding(qkv, q_w, k_w, positions, k_ring, v_ring, slots, EPS, THETA)
    out = decode_attention_sliding(q_out, k_ring, v_ring, slots, positions + 1, sinks, attention_workspace("cuda"))
    q_ref, k_new, v_new = reference_qkv(qkv, q_w, k_w, positions, rope=True)
    refs = []
    for b, (pos, kb, vb) in enumerate(kv):
        keep = pos > positions[b] - WINDOW
        k_all = torch.cat((kb[keep], k_new[b:b + 1])).float()
        v_all = torch.cat((vb[keep], v_new[b:b + 1])).float()
        k_pos = torch.cat((pos[keep], positions[b:b + 1].long()))
        refs.append(attention_with_sinks(q_ref[b:b + 1].float(), k_all, v_all, sinks.float(), k_pos[-1:], k_pos,
                                         WINDOW)[0])
    assert_attention_close(out, torch.stack(refs), "decode step (kernel 1 + sliding attention)", lens)


def test_rejects_bad_inputs():
    q, k, v, tables, _ = paged_case([10])
    sinks, lens, ws = mixed_sinks(0), torch.tensor([10], dtype=torch.int32, device="cuda"), attention_workspace("cuda")
    with pytest.raises(ValueError):
        decode_attention_full(q.float(), k, v, tables, lens, sinks, ws, 10)
    with pytest.raises(ValueError):
        decode_attention_full(q, k, v, tables, lens.long(), sinks, ws, 10)
    with pytest.raises(ValueError):
        decode_attention_full(q, k, v, tables, lens, sinks, ws[:100], 10)
    with pytest.raises(ValueError):
        decode_attention_full(q, k, v, tables, lens, sinks, ws, 10 ** 6)  # beyond the block table
