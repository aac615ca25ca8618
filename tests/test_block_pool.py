"""BlockPool and RingSnapshots by hand: sharing, the LRU's order, eviction, reset."""

import pytest

from flint_sched.core.block_hash import block_key, extend_block_keys, root_key
from flint_sched.core.block_pool import BlockPool
from flint_sched.core.kv_allocator import HybridKVAllocator
from flint_sched.core.ring_snapshots import RingSnapshots


def test_keys_chain_every_earlier_token_and_the_extra_key():
    root = root_key("flint-tiny@abc")
    keys = extend_block_keys([], [1, 2, 3, 4, 5, 6, 7], 2, root)
    assert len(keys) == 3 and keys[1] == block_key(keys[0], [3, 4])
    assert extend_block_keys([], [9, 2, 3, 4], 2, root)[1] != keys[1]          # same block, other parent
    assert extend_block_keys([], [1, 2], 2, root_key("other-model"))[0] != keys[0]


def test_keys_grown_a_few_blocks_at_a_time_are_the_keys_block_by_block():
    root, tokens = root_key("flint-tiny@abc"), [(i * 7919) % 150_000 for i in range(83)]
    expected = [block_key(root, tokens[:4])]
    for i in range(1, 83 // 4):
        expected.append(block_key(expected[-1], tokens[4 * i: 4 * i + 4]))
    keys: list[bytes] = []
    for end in (0, 3, 4, 13, 50, 83, 83):
        assert extend_block_keys(keys, tokens[:end], 4, root) is keys and keys == expected[:end // 4]


def test_a_freed_cached_block_stays_until_the_pool_needs_it():
    evicted = []
    pool = BlockPool(3, on_evict=evicted.append)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"ka") and pool.cache(b, b"kb") and not pool.cache(a, b"kx")
    pool.free([a, b])                       # reversed: b is the least recently used
    assert pool.num_free == 3 and pool.num_used == 0 and pool.cached_block(b"ka") == a
    pool.share([a])
    assert pool.ref_count(a) == 1 and pool.num_free == 2
    assert pool.allocate(1) == [2]          # the free block before any cached one
    assert pool.allocate(1) == [b] and evicted == [b"kb"] and pool.cached_block(b"kb") is None
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    with pytest.raises(ValueError):
        pool.free([a, a])
    pool.free([a])
    with pytest.raises(ValueError):
        pool.free([a])


def test_reset_forgets_keys_but_not_holds():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"ka")
    pool.cache(b, b"kb")
    pool.free([b])
    pool.reset()
    assert pool.num_cached == 0 and pool.num_used == 1 and pool.ref_count(a) == 1
    pool.free([a])
    assert pool.num_free == 2 and pool.cached_block(b"ka") is None


def test_evicting_a_key_block_drops_its_snapshot():
    allocator = HybridKVAllocator(2, 4, 1, sliding_window=5, num_ring_snapshots=1)
    table = allocator.allocate("r", 8).block_table
    allocator.blocks.cache(table[1], b"k1")
    assert allocator.snapshots.add(b"k1") == 1          # snapshot slots follow the running ones
    allocator.free("r")
    assert allocator.can_allocate("s", 4, [table[1]]) and not allocator.can_allocate("s", 12, [table[1]])
    allocator.allocate("s", 8)                           # takes both blocks: k1 is evicted
    assert b"k1" not in allocator.snapshots


def test_snapshots_evict_the_least_recently_used():
    snapshots = RingSnapshots(4, 2)
    assert snapshots.add(b"a") == 4 and snapshots.add(b"b") == 5 and snapshots.add(b"a") is None
    assert snapshots.get(b"a") == 4                      # a is now the most recently used
    assert snapshots.add(b"c") == 5 and b"b" not in snapshots
    assert RingSnapshots(4, 0).add(b"a") is None


def test_a_demoted_snapshot_is_evicted_first():
    snapshots = RingSnapshots(0, 3)
    for key in (b"a", b"b", b"c"):
        snapshots.add(key)
    snapshots.demote(b"c")                               # the most recent, now first in line
    snapshots.demote(b"gone")                            # unknown keys: nothing happens
    assert snapshots.add(b"d") == 2 and b"c" not in snapshots and b"a" in snapshots and b"b" in snapshots
