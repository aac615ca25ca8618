"""Bookkeeping for Flint's two KV caches, on integers only (the tensors live in the executor).

Every ring slot is either free or owned by exactly one request. Blocks live in a BlockPool
(block_pool.py): free, cached (ref 0, evictable) or held by one or more requests (a prefix hit
shares cached blocks); free + cached + used == total, and freeing what is not held raises. A
request's block table only grows (by appends) until the request frees everything at once; a freed
table list is dropped, never cleared. Ring snapshots (ring_snapshots.py) take the slot ids after
the running requests' ones.

    full-attention layers (14): position p -> block block_table[p // block_size], row p % block_size
                                one block holds K and V of all 14 layers for block_size positions
    sliding layers (35):        position p -> ring slot row p % ring_rows, one slot per request
                                (ring_rows = sliding_window + block_size - 1, see `ring_rows`)

    block_size = 4, 10 tokens:  block_table   7    2    9      ceil(10 / 4) = 3 blocks
                                positions    0-3  4-7  8-9     (block 9 has 2 rows free)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from flint_sched.core.block_pool import BlockPool
from flint_sched.core.ring_snapshots import RingSnapshots


def ring_rows(sliding_window: int, block_size: int) -> int:
    """Rows of a request's ring: the window plus block_size - 1, so that after a prompt's last chunk
    (which ends at most block_size positions past B, the last block boundary before its last token)
    the ring still holds the window - 1 positions before B: a prefix-cache snapshot at B is a copy of
    the ring then, with no chunk cut at B (core/prefix_cache.py). Reads and writes go by position
    (row p % ring_rows), so the rows past what a query's window reaches are never read."""
    return sliding_window + block_size - 1


class IdPool:
    """The ids 0 .. num_total-1 on a free stack; hands out the lowest ids first when fresh."""

    __slots__ = ("name", "num_total", "_free", "_is_free")

    def __init__(self, num_total: int, name: str) -> None:
        if isinstance(num_total, bool) or not isinstance(num_total, int) or num_total < 1:
            raise ValueError(f"number of {name}s must be an int >= 1, got {num_total!r}")
        self.name = name
        self.num_total = num_total
        self._free = list(range(num_total - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free)

    def allocate(self, num_ids: int) -> list[int]:
        free = self._free
        if num_ids > len(free):
            raise RuntimeError(f"out of {self.name}s: asked for {num_ids}, {len(free)} free")
        if num_ids <= 0:
            return []
        ids = free[len(free) - num_ids :]
        del free[len(free) - num_ids :]
        ids.reverse()
        is_free = self._is_free
        for i in ids:
            is_free[i] = 0
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return ids to the pool; raises ValueError (and frees none) on a free or unknown id."""
        is_free = self._is_free
        done: list[int] = []
        for i in ids:
            known = isinstance(i, int) and 0 <= i < self.num_total
            if not known or is_free[i]:
                for j in done:
                    is_free[j] = 0
                why = "already free (double free)" if known else "not an id of this pool"
                raise ValueError(f"cannot free {self.name} {i!r}: {why}")
            is_free[i] = 1
            done.append(i)
        self._free.extend(reversed(done))


class KVAllocation:
    """What one running request holds: its block table (full layers) and its ring slot."""

    __slots__ = ("block_table", "ring_slot")

    def __init__(self, block_table: list[int], ring_slot: int) -> None:
        self.block_table = block_table
        self.ring_slot = ring_slot


class HybridKVAllocator:
    """Paged blocks for the full-attention layers plus one ring slot per running request."""

    def __init__(
        self, num_blocks: int, block_size: int, num_ring_slots: int, sliding_window: int = 513,
        num_ring_snapshots: int = 0,
    ) -> None:
        for name, value in (("block_size", block_size), ("sliding_window", sliding_window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.ring_rows = ring_rows(sliding_window, block_size)
        self._ring_slots = IdPool(num_ring_slots, "ring slot")
        self.snapshots = RingSnapshots(num_ring_slots, num_ring_snapshots)
        self.blocks = BlockPool(num_blocks, on_evict=self.snapshots.drop)
        self._allocations: dict[str, KVAllocation] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold KV for positions 0 .. num_tokens-1."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Whether the request can hold KV for num_tokens positions (taking a ring slot if new);
        a new request may start its table with cached_blocks (a prefix hit), which it shares."""
        num_blocks = -(-num_tokens // self.block_size)
        allocation = self._allocations.get(request_id)
        if allocation is None:
            num_free = self.blocks.num_free - (self.blocks.num_evictable(cached_blocks) if cached_blocks else 0)
            return self._ring_slots.num_free > 0 and num_blocks - len(cached_blocks) <= num_free
        num_new_blocks = num_blocks - len(allocation.block_table)
        return num_new_blocks <= 0 or num_new_blocks <= self.blocks.num_free

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> KVAllocation:
        """Grow the request's holding to cover num_tokens positions; all or nothing. A new request's
        table starts with cached_blocks (shared, never written), then fresh blocks."""
        allocation = self._allocations.get(request_id)
        if allocation is not None and cached_blocks:
            raise ValueError(f"request {request_id!r} already holds blocks: cached blocks start a table")
        num_held = len(cached_blocks) if allocation is None else len(allocation.block_table)
        num_new_blocks = -(-num_tokens // self.block_size) - num_held
        if allocation is not None and num_new_blocks <= 0:
            return allocation                    # most decode steps: the last block has room
        num_free = self.blocks.num_free - (self.blocks.num_evictable(cached_blocks) if cached_blocks else 0)
        if num_new_blocks > num_free:
            raise RuntimeError(
                f"out of blocks: request {request_id!r} needs {num_new_blocks}, {num_free} free"
            )
        if allocation is None:
            allocation = KVAllocation(list(cached_blocks), self._ring_slots.allocate(1)[0])
            self.blocks.share(cached_blocks)
            self._allocations[request_id] = allocation
        if num_new_blocks > 0:
            allocation.block_table.extend(self.blocks.allocate(num_new_blocks))
        return allocation

    def free(self, request_id: str) -> None:
        """Drop the request's hold on its blocks and return its ring slot; raises ValueError if it
        holds none. Cached blocks nobody holds stay cached until evicted."""
        allocation = self._allocations.pop(request_id, None)
        if allocation is None:
            raise ValueError(f"request {request_id!r} holds no KV cache (freed twice?)")
        self.blocks.free(allocation.block_table)
        self._ring_slots.free((allocation.ring_slot,))

    def get(self, request_id: str) -> KVAllocation | None:
        return self._allocations.get(request_id)

    @property
    def num_total_blocks(self) -> int:
        return self.blocks.num_total

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.num_used

    @property
    def block_usage(self) -> float:
        return self.blocks.num_used / self.blocks.num_total

    @property
    def num_total_ring_slots(self) -> int:
        return self._ring_slots.num_total

    @property
    def num_free_ring_slots(self) -> int:
        return self._ring_slots.num_free

    @property
    def num_used_ring_slots(self) -> int:
        return self._ring_slots.num_used

    @property
    def ring_slot_usage(self) -> float:
        return self._ring_slots.num_used / self._ring_slots.num_total
