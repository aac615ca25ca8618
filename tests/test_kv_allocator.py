"""HybridKVAllocator and IdPool: counts, incremental block tables, all-or-nothing, double frees."""

import pytest

from flint_sched.core import HybridKVAllocator, IdPool


def make_allocator(num_blocks=8, block_size=4, num_ring_slots=2):
    return HybridKVAllocator(num_blocks, block_size, num_ring_slots, sliding_window=513)


def assert_counts(allocator, used_blocks, used_slots):
    assert allocator.num_used_blocks == used_blocks
    assert allocator.num_free_blocks == allocator.num_total_blocks - used_blocks
    assert allocator.num_used_ring_slots == used_slots
    assert allocator.num_free_ring_slots == allocator.num_total_ring_slots - used_slots
    assert allocator.block_usage == used_blocks / allocator.num_total_blocks
    assert allocator.ring_slot_usage == used_slots / allocator.num_total_ring_slots


def test_id_pool_hands_out_lowest_ids_first_and_counts():
    pool = IdPool(5, "block")
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free, pool.num_used, pool.num_total) == (2, 3, 5)
    assert pool.allocate(0) == []
    pool.free([1])
    assert sorted(pool.allocate(3)) == [1, 3, 4]
    assert pool.num_free == 0


def test_id_pool_raises_when_exhausted_and_changes_nothing():
    pool = IdPool(2, "block")
    with pytest.raises(RuntimeError, match="out of blocks"):
        pool.allocate(3)
    assert pool.num_free == 2


@pytest.mark.parametrize("bad_ids", [[0, 0], [1], [0, 5], [-1], [0, "1"]])
def test_id_pool_rejects_double_and_unknown_frees_without_freeing_any(bad_ids):
    pool = IdPool(3, "block")
    assert pool.allocate(1) == [0]
    with pytest.raises(ValueError, match="cannot free block"):
        pool.free(bad_ids)
    assert pool.num_free == 2
    pool.free([0])
    with pytest.raises(ValueError, match="double free"):
        pool.free([0])


@pytest.mark.parametrize("num_total", [0, -1, 1.5, True])
def test_id_pool_rejects_bad_sizes(num_total):
    with pytest.raises(ValueError, match="ring slot"):
        IdPool(num_total, "ring slot")


def test_allocator_rejects_bad_sizes():
    with pytest.raises(ValueError, match="block_size"):
        HybridKVAllocator(4, 0, 1)
    with pytest.raises(ValueError, match="sliding_window"):
        HybridKVAllocator(4, 16, 1, sliding_window=0)
    with pytest.raises(ValueError, match="block"):
        HybridKVAllocator(0, 16, 1)


@pytest.mark.parametrize(
    "num_tokens, num_blocks", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)]
)
def test_num_blocks_for_is_ceil(num_tokens, num_blocks):
    assert make_allocator().num_blocks_for(num_tokens) == num_blocks


def test_block_table_grows_in_place_one_block_per_block_size_tokens():
    allocator = make_allocator()
    allocation = allocator.allocate("a", 3)
    table = allocation.block_table
    assert len(table) == 1 and allocation.ring_slot == 0
    assert_counts(allocator, used_blocks=1, used_slots=1)
    for num_tokens, expected_len in [(4, 1), (5, 2), (8, 2), (9, 3), (2, 3)]:
        assert allocator.allocate("a", num_tokens) is allocation
        assert allocation.block_table is table and len(table) == expected_len
    assert_counts(allocator, used_blocks=3, used_slots=1)
    assert allocator.get("a") is allocation


def test_can_allocate_counts_held_blocks_and_needs_a_ring_slot_for_new_requests():
    allocator = make_allocator(num_blocks=4, num_ring_slots=1)
    assert allocator.can_allocate("a", 16) and not allocator.can_allocate("a", 17)
    allocator.allocate("a", 8)
    assert allocator.can_allocate("a", 16) and not allocator.can_allocate("a", 17)
    assert not allocator.can_allocate("b", 1), "the only ring slot is taken"
    allocator.free("a")
    assert allocator.can_allocate("b", 1)


def test_allocate_is_all_or_nothing():
    allocator = make_allocator(num_blocks=2, num_ring_slots=1)
    with pytest.raises(RuntimeError, match="out of blocks"):
        allocator.allocate("a", 9)
    assert_counts(allocator, used_blocks=0, used_slots=0)
    assert allocator.get("a") is None
    allocator.allocate("a", 4)
    with pytest.raises(RuntimeError, match="out of ring slots"):
        allocator.allocate("b", 1)
    assert_counts(allocator, used_blocks=1, used_slots=1)


def test_free_returns_everything_and_a_second_free_raises():
    allocator = make_allocator()
    first = allocator.allocate("a", 10)
    allocator.allocate("b", 1)
    old_table = list(first.block_table)
    allocator.free("a")
    assert first.block_table == old_table, "a freed table is dropped, not cleared"
    assert_counts(allocator, used_blocks=1, used_slots=1)
    with pytest.raises(ValueError, match="freed twice"):
        allocator.free("a")
    allocator.free("b")
    assert_counts(allocator, used_blocks=0, used_slots=0)


def test_live_tables_never_share_a_block_or_a_ring_slot():
    allocator = make_allocator(num_blocks=12, num_ring_slots=3)
    tables = {rid: allocator.allocate(rid, n) for rid, n in [("a", 5), ("b", 9), ("c", 1)]}
    allocator.free("b")
    tables["d"] = allocator.allocate("d", 16)
    live = [tables[rid] for rid in ("a", "c", "d")]
    blocks = [b for allocation in live for b in allocation.block_table]
    assert len(blocks) == len(set(blocks)) == allocator.num_used_blocks
    assert len({allocation.ring_slot for allocation in live}) == 3
