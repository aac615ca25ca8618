"""The full-attention blocks with prefix caching: reference counts, keys, and an LRU of cached blocks.

Every block is in exactly one state, so free + cached + held == total at all times:

    free      ref 0, no key          in the free stack (lowest ids first when fresh)
    cached    ref 0, keyed           in the LRU; evicted (its key dropped) only when a block is needed
    held      ref >= 1, keyed or not  in the block tables of ref requests

A keyed block is full and never written again (writes go to positions past what was computed), so
requests share it read-only. free() lowers ref counts and takes tables in reverse, so that the last
block of a prefix is evicted before the blocks it depends on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class BlockPool:
    __slots__ = ("num_total", "on_evict", "_free", "_ref_counts", "_key_of_block", "_block_of_key", "_lru")

    def __init__(self, num_total: int, on_evict: Callable[[bytes], None] | None = None) -> None:
        if isinstance(num_total, bool) or not isinstance(num_total, int) or num_total < 1:
            raise ValueError(f"number of blocks must be an int >= 1, got {num_total!r}")
        self.num_total = num_total
        self.on_evict = on_evict
        self._free = list(range(num_total - 1, -1, -1))
        self._ref_counts = [0] * num_total
        self._key_of_block: list[bytes | None] = [None] * num_total
        self._block_of_key: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()       # cached blocks, least recently freed first

    @property
    def num_free(self) -> int:
        """Blocks that allocate() can hand out: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free) - len(self._lru)

    @property
    def num_cached(self) -> int:
        """Keyed blocks, held or not."""
        return len(self._block_of_key)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def cached_block(self, key: bytes) -> int | None:
        return self._block_of_key.get(key)

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of these (cached) blocks are in the LRU, i.e. counted in num_free."""
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def allocate(self, num_blocks: int) -> list[int]:
        """num_blocks blocks held once each, free ones first, then evicting the least recently used."""
        if num_blocks > self.num_free:
            raise RuntimeError(f"out of blocks: asked for {num_blocks}, {self.num_free} free")
        blocks = []
        for _ in range(max(0, num_blocks)):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                self._drop_key(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks once more (a prefix hit): those in the LRU leave it."""
        for block in blocks:
            if self._key_of_block[block] is None:
                raise ValueError(f"block {block} is not cached: only cached blocks are shared")
            if self._ref_counts[block] == 0:
                del self._lru[block]
            self._ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one hold on each block, last block first; raises ValueError (and frees none) on a
        block that is not held or not a block of this pool."""
        for block in blocks:
            if not (isinstance(block, int) and 0 <= block < self.num_total) or self._ref_counts[block] < 1:
                raise ValueError(f"cannot free block {block!r}: not held (double free?)")
        if len(set(blocks)) != len(blocks):
            raise ValueError("cannot free a block twice in one table")
        for block in reversed(blocks):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._key_of_block[block] is None:
                    self._free.append(block)
                else:
                    self._lru[block] = None

    def cache(self, block: int, key: bytes) -> bool:
        """Key a held, full block; False when the key already names another block (it stays unkeyed)."""
        if self._ref_counts[block] < 1:
            raise ValueError(f"block {block} is not held: only a held block that is full can be cached")
        if key in self._block_of_key or self._key_of_block[block] is not None:
            return False
        self._block_of_key[key] = block
        self._key_of_block[block] = key
        return True

    def reset(self) -> None:
        """Forget every key: cached blocks become free, held ones stay held (unkeyed)."""
        for block in self._lru:
            self._free.append(block)
        self._lru.clear()
        self._block_of_key.clear()
        self._key_of_block = [None] * self.num_total

    def _drop_key(self, block: int) -> None:
        key = self._key_of_block[block]
        self._key_of_block[block] = None
        del self._block_of_key[key]
        if self.on_evict is not None:
            self.on_evict(key)
