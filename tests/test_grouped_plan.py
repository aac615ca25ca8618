"""Planning of the grouped GEMMs (kernels/grouped.py, grouped_moe.py): pure Python, no GPU."""

import itertools
import random

import pytest

from flint_sched import kernels
from flint_sched.kernels import grouped, grouped_moe


def items_of(counts: list[int], chunk: int) -> int:
    return sum(-(-c // chunk) for c in counts)


def routed_counts(choices: list[list[int]], experts: int) -> list[int]:
    counts = [0] * (experts + 1)
    for chosen in choices:
        assert len(set(chosen)) == len(chosen)     # a token's experts are distinct
        for e in chosen:
            counts[e] += 1
    counts[experts] = len(choices)                 # the shared expert: one row a token
    return counts


@pytest.mark.parametrize("chunk", (*grouped.CHUNKS, 128))
def test_work_bound_covers_every_distribution(chunk):
    rng = random.Random(chunk)
    for tokens, experts, top_k in itertools.product((1, 7, 9, 16, 63, 64, 257, 4099), (4, 32, 256), (1, 6)):
        top_k = min(top_k, experts)
        bound = grouped.work_bound(tokens, top_k, experts, chunk)
        # worst cases: the choices spread over every expert (most experts touched), all tokens on
        # the same top_k experts (fullest experts), one row short of whole chunks, random
        spread = [[(t * top_k + j) % experts for j in range(top_k)] for t in range(tokens)]
        same = [list(range(top_k))] * tokens
        rand = [rng.sample(range(experts), top_k) for _ in range(tokens)]
        for choices in (spread, same, rand):
            counts = routed_counts(choices, experts)
            assert items_of(counts, chunk) <= bound, (tokens, experts, top_k, chunk)
    # tight where the spread reaches every expert: one item each, then whole chunks
    assert items_of(routed_counts([[t % 256] for t in range(256 * 9)], 256), 8) == grouped.work_bound(256 * 9, 1, 256, 8)


@pytest.mark.parametrize("split", (1, 8, 32, 64, 200))
@pytest.mark.parametrize("chunk", grouped.CHUNKS)
def test_split_bounds_cover_every_distribution(chunk, split):
    """route_and_split's two lists: the items of experts of at most `split` rows (in `chunk`-row
    items) and of the others (128-row items) within split_bounds, for spread, piled-up, skewed and
    random choices."""
    rng = random.Random(chunk * 1000 + split)
    for tokens, experts, top_k in itertools.product((1, 7, 16, 64, 100, 257, 600, 4099), (32, 256), (1, 6)):
        small_bound, tiled_bound = grouped_moe.split_bounds(tokens, top_k, experts, chunk, split)
        spread = [[(t * top_k + j) % experts for j in range(top_k)] for t in range(tokens)]
        same = [list(range(top_k))] * tokens
        few = range(min(experts, 3 * top_k))      # two tokens in three on a few experts
        skewed = [rng.sample(few, top_k) if t % 3 else rng.sample(range(experts), top_k) for t in range(tokens)]
        rand = [rng.sample(range(experts), top_k) for _ in range(tokens)]
        for choices in (spread, same, skewed, rand):
            counts = routed_counts(choices, experts)
            small = items_of([c for c in counts if c <= split], chunk)
            tiled = items_of([c for c in counts if c > split], 128)
            assert small <= small_bound and tiled <= tiled_bound, (tokens, experts, top_k, chunk, split)
    # 16 tokens: no expert can pass 16 rows, so the tiled list is empty (moe_grouped launches no tile)
    assert grouped_moe.split_bounds(16, 6, 256, 16, 200)[1] == 0
    expected = (grouped.work_bound(64, 6, 256, 16), 448 // 33 + 448 // 128)
    assert grouped_moe.split_bounds(64, 6, 256, 16, 32) == expected


def test_hybrid_gemms_choice(monkeypatch):
    """The hybrid GEMMs only where both kinds fit (NVFP4, Flint's shapes) and only when asked for or
    from HYBRID_MIN_TOKENS on (off by default)."""
    assert grouped_moe.expert_gemms(4096, "nvfp4", 2048, 512) == "tiled"
    assert grouped_moe.expert_gemms(64, "nvfp4", 2048, 512, "hybrid") == "hybrid"
    assert grouped_moe.expert_gemms(64, "bf16", 2048, 512, "hybrid") == "swap-ab"   # no decode GEMMs for BF16
    monkeypatch.setattr(grouped_moe, "HYBRID_MIN_TOKENS", 512)
    assert grouped_moe.expert_gemms(511, "nvfp4", 2048, 512) == "decode"
    assert grouped_moe.expert_gemms(512, "nvfp4", 2048, 512) == "hybrid"
    assert grouped_moe.expert_gemms(512, "bf16", 2048, 512) == "tiled"


def test_work_bound_values():
    assert grouped.work_bound(64, 6, 256, 16) == 256 + 128 // 16 + 4   # 384 routed rows, 64 shared
    assert grouped.work_bound(16, 6, 256, 8) == 96 + 2                   # every routed row alone
    assert grouped.work_bound(1, 6, 256, 16) == 6 + 1                    # one token: 7 experts
    assert grouped.work_bound(0, 6, 256, 64) == 0


def test_chunk_choice():
    assert grouped.dense_chunk(1) == grouped.dense_chunk(16) == 16
    assert grouped.dense_chunk(17) == grouped.dense_chunk(8192) == 64
    # Flint: 256 experts, top-6. Decode (<= 6 rows per expert on average) takes 8-row items.
    assert [grouped.moe_chunk(m, 6, 256) for m in (1, 16, 64, 256, 682, 683, 1024, 8192)] == \
        [8, 8, 8, 8, 8, 64, 64, 64]


def test_tiles_per_cta_and_grid():
    assert grouped.tiles_per_cta(1, 9472, 16, 132) == 1        # LM head, 16 tokens: split K
    assert grouped.tiles_per_cta(128, 9472, 64, 132) == 4      # LM head, 8192 tokens
    assert grouped.tiles_per_cta(1, 64, 64, 132) == 1          # too few CTAs with 4 tiles each
    assert grouped.grid(5, 130, 4) == (5, 33)
    with pytest.raises(ValueError, match="grid y"):
        grouped.grid(1, 70000 * 4 + 1, 4)


@pytest.mark.parametrize("small_chunk", [8, 16])
def test_every_plan_uses_a_compiled_variant(monkeypatch, small_chunk):
    monkeypatch.setattr(grouped, "MOE_SMALL_CHUNK", small_chunk)
    assert grouped.moe_chunk(256, 6, 256) == small_chunk and grouped.moe_chunk(1024, 6, 256) == 64
    for m in (1, 9, 64, 256, 1024, 8192):
        chunk = grouped.dense_chunk(m)
        for tiles in (16, 64, 128, 320, 9472):
            picked = {"GROUPED_CHUNK": chunk,
                      "GROUPED_TILES": grouped.tiles_per_cta(grouped.cdiv(m, chunk), tiles, chunk, 132)}
            assert picked in kernels.VARIANTS["grouped_gemm.cu"]
        moe = {"GROUPED_CHUNK": grouped_moe.moe_chunk(m, 6, 256), "GROUPED_TILES": grouped_moe.moe_tiles_per_cta()}
        assert moe in kernels.VARIANTS["grouped_gemm.cu"]


def test_routing_shared_memory_and_workspace_checks():
    assert grouped_moe.routing_shared_bytes(256) == 16 * 257 * 4 + 258 * 8 + 256 + 4 * 2048
    assert grouped_moe.routing_shared_bytes(1024) < 227 * 1024
    with pytest.raises(ValueError, match="top_k"):
        grouped_moe.moe_routing_workspace(8, 4, 5, "cpu")
    ws = grouped_moe.moe_routing_workspace(9, 32, 6, "cpu", hidden_size=64, intermediate_size=32)
    assert ws.sorted_token.numel() == 9 * 7 and ws.pair_row.shape == (9, 7)
    assert ws.work_expert.numel() == grouped.work_bound(9, 6, 32, min(grouped.CHUNKS))
    assert ws.h_sorted.shape == (63, 32) and ws.y_sorted.shape == (63, 64)
    assert int(ws.ticket) == 0


def test_check_work_list_names_the_mismatch():
    """The routing check both expert GEMM launchers share (expert_gemm.py, expert_decode.py)."""
    from types import SimpleNamespace

    import torch
    routing = SimpleNamespace(chunk=8, num_experts=256, sorted_token=torch.zeros(70, dtype=torch.int32))
    grouped.check_work_list(routing, 8, 70, 256, "expert_decode (g1t1)")
    with pytest.raises(ValueError, match=r"expert_decode \(g1t2\) needs a work list of 16-row items"):
        grouped.check_work_list(routing, 16, 70, 256, "expert_decode (g1t2)")
    with pytest.raises(ValueError, match="weights have 256 experts / 71 rows; routing has 256 / 70"):
        grouped.check_work_list(routing, 8, 71, 256, "expert_gemm")
