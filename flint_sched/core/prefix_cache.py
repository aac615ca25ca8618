"""Prefix caching for a hybrid model: shared full-attention blocks plus ring snapshots (no torch).

A hit needs two things at one block boundary H: the cached blocks of positions 0 .. H-1 (full
layers) and a ring snapshot taken at H (sliding layers: K/V of H-window .. H-1). The rings cannot be
rebuilt by recomputing the last window of tokens: a sliding layer's K/V at p depends on the layer
below at p-window+1 .. p, so the reach grows by window-1 per sliding layer (about 18K tokens in
Flint), and recomputing less would not equal a cold prefill. So snapshots are taken, once per
prompt, at the last block boundary before its last token:

    prompt       [=========================|====]      snapshot position B = ((len - 1) // bs) * bs
    chunks       [..... cut at B ..........][tail]      the chunk that crosses B stops at B
    after it     ring slot --copy--> snapshot slot      (StepPlan.ring_copies, before the next forward)
    next turn    [== cached blocks, hit at B ==][new tokens ...]
                 ring <--copy-- snapshot slot; the first chunk starts at B, and writes only blocks
                 of its own (B is a block boundary), so cached blocks are never written.

Copies run in plan order before the forward: snapshots first (they read the rings as the last
forward left them, even of a request finished or preempted since), then restores.
"""

from __future__ import annotations

from dataclasses import dataclass

from flint_sched.core.block_hash import extend_block_keys, root_key
from flint_sched.core.kv_allocator import HybridKVAllocator, KVAllocation
from flint_sched.core.request import Request


@dataclass(slots=True)
class PrefixHit:
    """num_tokens cached positions: their blocks, and the ring snapshot to restore (when any)."""

    num_tokens: int
    blocks: list[int]
    snapshot_slot: int | None


NO_HIT = PrefixHit(0, [], None)


class PrefixCache:
    """Finds hits for waiting requests, caches what running ones compute, counts queries and hits."""

    def __init__(self, allocator: HybridKVAllocator, extra_key: str = "") -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.root = root_key(extra_key)
        self.num_queried_tokens = 0       # vLLM's prefix_cache_queries: tokens of admitted requests
        self.num_hit_tokens = 0           # vLLM's prefix_cache_hits: of those, tokens served from the cache
        self._pending_copies: list[tuple[int, int]] = []

    def keys(self, request: Request) -> list[bytes]:
        """The block keys of the request's full blocks (computed once, grown as tokens come)."""
        return extend_block_keys(request.block_keys, request.all_token_ids, self.block_size, self.root)

    def find(self, request: Request) -> PrefixHit:
        """The longest cached prefix with a snapshot at its end, leaving one token to compute."""
        keys, pool, snapshots = self.keys(request), self.allocator.blocks, self.allocator.snapshots
        blocks: list[int] = []
        num_hit_blocks = 0
        for key in keys[: (request.num_tokens - 1) // self.block_size]:
            block = pool.cached_block(key)
            if block is None:
                break
            blocks.append(block)
            if key in snapshots:
                num_hit_blocks = len(blocks)
        if num_hit_blocks == 0:
            return NO_HIT
        slot = snapshots.get(keys[num_hit_blocks - 1])
        return PrefixHit(num_hit_blocks * self.block_size, blocks[:num_hit_blocks], slot)

    def count(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def snapshot_position(self, request: Request) -> int:
        """B: the last block boundary before the prompt's last token (0: none)."""
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """end, or B when the chunk start .. end-1 crosses B and no snapshot is kept there yet."""
        position = self.snapshot_position(request)
        if start < position < end and self.keys(request)[position // self.block_size - 1] not in self.allocator.snapshots:
            return position
        return end

    def awaits_snapshot(self, request: Request) -> bool:
        """Whether a plan in flight (async scheduling) ends the request at B with no snapshot kept
        there yet: its next chunk must wait, or it would overwrite the rings before they are copied."""
        position = self.snapshot_position(request)
        return (position > request.num_computed_tokens
                and request.num_computed_tokens + request.num_in_flight_tokens == position
                and self.keys(request)[position // self.block_size - 1] not in self.allocator.snapshots)

    def computed(self, request: Request, allocation: KVAllocation) -> None:
        """After a step: cache the blocks the request has filled, and snapshot its rings at B."""
        num_full = request.num_computed_tokens // self.block_size
        if num_full > request.num_keyed_blocks:
            keys, pool = self.keys(request), self.allocator.blocks
            for i in range(request.num_keyed_blocks, num_full):
                pool.cache(allocation.block_table[i], keys[i])
            request.num_keyed_blocks = num_full
        position = self.snapshot_position(request)
        if position and request.num_computed_tokens == position:
            slot = self.allocator.snapshots.add(self.keys(request)[position // self.block_size - 1])
            if slot is not None:
                self._pending_copies.append((allocation.ring_slot, slot))

    def take_snapshot_copies(self) -> list[tuple[int, int]]:
        """The (ring slot, snapshot slot) copies due before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset(self) -> None:
        """Forget every cached block and snapshot (blocks held by requests stay held)."""
        self.allocator.blocks.reset()
        self.allocator.snapshots.reset()
        self._pending_copies.clear()
