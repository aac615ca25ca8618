"""Snapshots of sliding-window rings at block boundaries, for prefix-cache hits (no torch).

A snapshot is a ring slot of its own (ids after the running requests' slots) holding a copy of a
request's rings when exactly positions 0 .. B-1 had been computed, B a multiple of block_size:
so it holds the sliding layers' K/V of positions B-window .. B-1. It is keyed by the block key of
block B/block_size - 1 (block_hash.py), which names every token before B. Least recently used
snapshots make room for new ones; a snapshot whose key block is evicted is dropped with it.
"""

from __future__ import annotations

from collections import OrderedDict


class RingSnapshots:
    __slots__ = ("first_slot", "num_total", "_free", "_slot_of_key")

    def __init__(self, first_slot: int, num_total: int) -> None:
        if isinstance(num_total, bool) or not isinstance(num_total, int) or num_total < 0:
            raise ValueError(f"number of ring snapshots must be an int >= 0, got {num_total!r}")
        self.first_slot = first_slot
        self.num_total = num_total
        self._free = list(range(first_slot + num_total - 1, first_slot - 1, -1))
        self._slot_of_key: OrderedDict[bytes, int] = OrderedDict()   # least recently used first

    @property
    def num_used(self) -> int:
        return len(self._slot_of_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of_key

    def get(self, key: bytes) -> int | None:
        """The slot of the snapshot with this key (now most recently used), or None."""
        slot = self._slot_of_key.get(key)
        if slot is not None:
            self._slot_of_key.move_to_end(key)
        return slot

    def add(self, key: bytes) -> int | None:
        """A slot for a new snapshot with this key (evicting the least recently used when none is
        free); None when there are no snapshot slots or the key has one already."""
        if self.num_total == 0 or key in self._slot_of_key:
            return None
        slot = self._free.pop() if self._free else self._slot_of_key.popitem(last=False)[1]
        self._slot_of_key[key] = slot
        return slot

    def demote(self, key: bytes) -> None:
        """Make this snapshot the next to be evicted (a request restored from it has moved on and
        snapshotted further along the same prompt)."""
        if key in self._slot_of_key:
            self._slot_of_key.move_to_end(key, last=False)

    def drop(self, key: bytes) -> None:
        slot = self._slot_of_key.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def reset(self) -> None:
        for key in list(self._slot_of_key):
            self.drop(key)
