"""Decode attention with the Q/K norm operation inside (attention.QKNorm, cuda/decode_attention_qk.cu)
against the two launches it replaces (qk_norm_rope_kv_*, then decode_attention_*): the same output
and the same K/V rows, bit for bit, and nothing else in the pools changed; full and sliding layers,
bf16 and e4m3 caches, padding requests, one split or many."""

import pytest
import torch

from flint_sched.kernels.attention import (
    QKNorm,
    attention_workspace,
    decode_attention_full,
    decode_attention_sliding,
    q_slots_elements,
    qk_norm_rope_kv_full,
    qk_norm_rope_kv_sliding,
)
from test_kernel_attention import EPS, FP8, G, THETA, WINDOW, mixed_sinks, paged_case, qkv_case, ring_case

pytestmark = pytest.mark.gpu


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("lens", [[1], [514, 0, 2000, 37, 1, 700], [100_000, 3]], ids=["one", "mixed", "long"])
def test_attention_with_the_qk_norm_inside_matches_the_two_launches(kv_dtype, sliding, lens):
    batch, seed = len(lens), 70 + len(lens)
    qkv, q_w, k_w = qkv_case(batch, seed)
    positions = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device="cuda")  # 0 keys: -1, padding
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sinks = mixed_sinks(seed + 1)
    if sliding:
        _, k, v, pages, _ = ring_case([max(0, n - 1) for n in lens], seed=seed)   # history below the new key
        max_keys = WINDOW
    else:
        _, k, v, pages, _ = paged_case([max(1, n) for n in lens], seed=seed)
        max_keys = max(lens)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    results = []
    for fused in (False, True):
        kp, vp = k.clone(), v.clone()
        ws = attention_workspace("cuda")
        if fused:
            slots = torch.full((q_slots_elements(batch, max_keys, G),), float("nan"), dtype=torch.bfloat16,
                               device="cuda")
            q = QKNorm(qkv, q_w, k_w, positions, EPS, THETA if sliding else None, slots)
        elif sliding:
            q = qk_norm_rope_kv_sliding(qkv, q_w, k_w, positions, kp, vp, pages, EPS, THETA)
        else:
            q = qk_norm_rope_kv_full(qkv, q_w, k_w, positions, kp, vp, pages, EPS)
        if sliding:
            out = decode_attention_sliding(q, kp, vp, pages, seq_lens, sinks, ws, window=WINDOW)
        else:
            out = decode_attention_full(q, kp, vp, pages, seq_lens, sinks, ws, max_keys)
        results.append((out, kp, vp))
    (out_a, k_a, v_a), (out_b, k_b, v_b) = results
    assert not torch.isnan(out_b).any(), "an output was not written"
    assert same_bits(out_a, out_b), f"outputs differ: max |diff| {float((out_a.float() - out_b.float()).abs().max())}"
    assert same_bits(k_a, k_b) and same_bits(v_a, v_b), "the K/V pools differ after the step"


def test_a_qk_norm_takes_only_the_default_splits():
    batch = 2
    qkv, q_w, k_w = qkv_case(batch, 90)
    _, k, v, tables, _ = paged_case([10, 20], seed=90)
    qk = QKNorm(qkv, q_w, k_w, torch.tensor([9, 19], dtype=torch.int32, device="cuda"), EPS, None,
                torch.empty(q_slots_elements(batch, 20, G), dtype=torch.bfloat16, device="cuda"))
    lens, ws = torch.tensor([10, 20], dtype=torch.int32, device="cuda"), attention_workspace("cuda")
    with pytest.raises(ValueError, match="default splits"):
        decode_attention_full(qk, k, v, tables, lens, mixed_sinks(0), ws, 20, num_splits=3)
    small = QKNorm(qk.qkv, q_w, k_w, qk.positions, EPS, None, qk.q_slots[:10])
    with pytest.raises(ValueError, match="q_slots"):
        decode_attention_full(small, k, v, tables, lens, mixed_sinks(0), ws, 20)
