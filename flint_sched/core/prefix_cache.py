"""Prefix caching for a hybrid model: shared full-attention blocks plus ring snapshots (no torch).

A hit needs two things at one block boundary H: the cached blocks of positions 0 .. H-1 (full
layers) and a ring snapshot taken at H (sliding layers: K/V of H-window .. H-1). The rings cannot be
rebuilt by recomputing the last window of tokens: a sliding layer's K/V at p depends on the layer
below at p-window+1 .. p, so the reach grows by window-1 per sliding layer (about 18K tokens in
Flint), and recomputing less would not equal a cold prefill. So snapshots are taken, once per
prompt, at the last block boundary before its last token:

    prompt       [=========================|====]      snapshot position B = ((len - 1) // bs) * bs
    chunks       [....................... B ....]       the prompt's last chunk ends <= bs past B
    after it     ring slot --copy--> snapshot slot      (StepPlan.ring_copies, before the next forward;
                                                         with async scheduling, the plan made while
                                                         that chunk runs carries the copy: the
                                                         forwards run in plan order)
    next turn    [== cached blocks, hit at B ==][new tokens ...]
                 ring <--copy-- snapshot slot; the first chunk starts at B, and writes only blocks
                 of its own (B is a block boundary), so cached blocks are never written.

A ring has window + bs - 1 rows (kv_allocator.ring_rows), so when a chunk ends at most bs
positions past a snapshot position p it still holds the window - 1 positions before p, all a
query at p reads of the past: the copy taken then serves a hit at p (the rows of positions >= p it
also holds are rewritten before anything reads them). A chunk that would run further past p (a
preempted request recomputing its prompt and output, or the cut at D) stops at p.

A second snapshot shares prefixes across conversations (the same system prompt and tools before
different first messages): when a request with no hit is admitted and cached blocks cover at
least a window's worth of its first tokens, another request computed those tokens and this one is
about to compute them again, so it is cut and snapshotted where the shared blocks end (position
D), and the next request with that prefix hits there:

    request 1    [system prompt ....|.. A's message ...]          blocks cached; snapshot only at its B
    request 2    [system prompt ....|.. B's message ...]          blocks cached up to D, no snapshot
                 [== computed ====][D: snapshot][rest][B: snapshot]
    request 3    [== hit at D =====][C's message ...]

A shorter shared run is not worth a snapshot slot and an extra chunk boundary: recomputing it
costs less than a window of tokens. A request that has a hit takes no D: the blocks past its hit
are, in the common case, the next turn of its own conversation (the last prompt's tail and the
answer, which the request's own B snapshot serves next time); a snapshot there would take a slot
from snapshots that are used. (Nested shared prefixes, a common preamble before several system
prompts, so get a snapshot only at the first divergence.)

Copies run in plan order before the forward: snapshots first (they read the rings as the last
forward left them, even of a request finished or preempted since), then restores.
"""

from __future__ import annotations

from dataclasses import dataclass

from flint_sched.core.block_hash import extend_block_keys, root_key, salted_root
from flint_sched.core.kv_allocator import HybridKVAllocator, KVAllocation
from flint_sched.core.request import Request, RequestStatus


@dataclass(slots=True)
class PrefixHit:
    """num_tokens cached positions: their blocks, and the ring snapshot to restore (when any);
    num_shared_tokens: how far the cached blocks reach (>= num_tokens; the hit stops at the last
    snapshot among them)."""

    num_tokens: int
    blocks: list[int]
    snapshot_slot: int | None
    num_shared_tokens: int = 0


NO_HIT = PrefixHit(0, [], None)


class PrefixCache:
    """Finds hits for waiting requests, caches what running ones compute, counts queries and hits."""

    def __init__(self, allocator: HybridKVAllocator, extra_key: str = "", min_shared_tokens: int = 0) -> None:
        """min_shared_tokens: the shortest run of cached blocks past a hit that earns a second
        snapshot (the scheduler gives the sliding window; 0: any)."""
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.min_shared_tokens = min_shared_tokens
        # how far past a snapshot position a chunk may end with the ring still holding its history
        self.snapshot_slack = allocator.ring_rows - allocator.sliding_window + 1
        self._d_takers: dict[bytes, Request] = {}   # key at D -> the running request that will snapshot it
        self.root = root_key(extra_key)
        self.num_queried_tokens = 0       # vLLM's prefix_cache_queries: tokens of admitted requests
        self.num_hit_tokens = 0           # vLLM's prefix_cache_hits: of those, tokens served from the cache
        self._pending_copies: list[tuple[int, int]] = []

    def keys(self, request: Request) -> list[bytes]:
        """The block keys of the request's full blocks (computed once, grown as tokens come), from
        the salted root when the request has a cache salt."""
        salt, root = request.sampling_params.cache_salt, self.root
        if salt is not None and not request.block_keys:
            root = salted_root(root, salt)
        return extend_block_keys(request.block_keys, request.all_token_ids, self.block_size, root)

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
        shared = len(blocks) * self.block_size
        if num_hit_blocks == 0:
            return PrefixHit(0, [], None, shared) if shared else NO_HIT
        slot = snapshots.get(keys[num_hit_blocks - 1])
        return PrefixHit(num_hit_blocks * self.block_size, blocks[:num_hit_blocks], slot, shared)

    def admit(self, request: Request, hit: PrefixHit) -> None:
        """Before the request's first chunk: where it takes a snapshot besides B (D, see the module
        docstring: 0 for none) and which snapshot its rings come from."""
        position = hit.num_shared_tokens
        if hit.num_tokens or position < max(1, self.min_shared_tokens) or position >= self.snapshot_position(request):
            position = 0
        if position:       # one request cuts and snapshots a D (many may arrive with it together)
            key = self._key_at(request, position)
            taker = self._d_takers.get(key)
            if taker is not None and taker is not request and _will_snapshot(taker, position):
                position = 0
            else:
                if len(self._d_takers) >= 1024:
                    self._d_takers = {k: r for k, r in self._d_takers.items()
                                      if _will_snapshot(r, r.shared_prefix_position)}
                self._d_takers[key] = request
        request.shared_prefix_position = position
        request.restored_snapshot_key = self._key_at(request, hit.num_tokens) if hit.snapshot_slot is not None else None

    def count(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def snapshot_position(self, request: Request) -> int:
        """B: the last block boundary before the prompt's last token (0: none)."""
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _positions(self, request: Request) -> tuple[int, ...]:
        """Where the request's rings are snapshotted: D (when chosen at admission) and B."""
        b = self.snapshot_position(request)
        d = request.shared_prefix_position
        return (d, b) if 0 < d < b else (b,) if b else ()

    def _key_at(self, request: Request, position: int) -> bytes:
        """The key of the block that ends at `position` (a block boundary > 0): a snapshot's key."""
        return self.keys(request)[position // self.block_size - 1]

    def _due(self, request: Request, reached: int, after: int = -1) -> list[int]:
        """Snapshot positions p in (after, reached] with no snapshot kept yet whose history the ring
        still holds once positions up to `reached` are computed (reached <= p + snapshot_slack)."""
        return [p for p in self._positions(request) if after < p <= reached <= p + self.snapshot_slack
                and self._key_at(request, p) not in self.allocator.snapshots]

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """end, or the first snapshot position with no snapshot kept yet that the chunk start ..
        end-1 crosses and ends more than snapshot_slack past (the ring would lose its history)."""
        for position in self._positions(request):
            if (start < position < end - self.snapshot_slack
                    and self._key_at(request, position) not in self.allocator.snapshots):
                return position
        return end

    def snapshot_in_flight(self, request: Request, allocation: KVAllocation, copies: list[tuple[int, int]]) -> None:
        """Async scheduling: when the chunk in flight reaches a snapshot position, keep the snapshot
        now and copy the rings first thing in the plan being built (after the forward in flight,
        before this plan's), so the next step need not wait for the update."""
        computed = request.num_computed_tokens
        if computed >= self.snapshot_position(request):     # decoding: every position is behind it
            return
        for position in self._due(request, computed + request.num_in_flight_tokens, after=computed):
            self._cache_blocks(request, allocation, position)   # a snapshot's key block is cached
            self._snapshot(request, allocation, position, copies)

    def computed(self, request: Request, allocation: KVAllocation) -> None:
        """After a step: cache the blocks the request has filled, and snapshot its rings at D or B.
        The copy runs before the next plan's forward, after the plans still in flight (async
        scheduling), so the rings will then hold positions up to computed + in flight: a snapshot
        is due only if that is still within its slack (else the copy would keep later positions
        under the snapshot's key: a snapshot evicted and taken again, as with one slot and two
        requests, restored the wrong window)."""
        self._cache_blocks(request, allocation, request.num_computed_tokens)
        reached = request.num_computed_tokens + request.num_in_flight_tokens
        for position in self._due(request, reached):
            self._snapshot(request, allocation, position, self._pending_copies)

    def _snapshot(self, request: Request, allocation: KVAllocation, position: int,
                  copies: list[tuple[int, int]]) -> None:
        """Keep the request's rings at `position` (a copy into a snapshot slot, appended to `copies`).
        The snapshot it was restored from goes first in line for eviction: an agent's next turn
        hits this one, and with LRU alone a snapshot per conversation would evict the ones
        other conversations still need (one slot per session: the hit rate fell from 82 % to 56 %
        in benchmarks/bench_agent_sim.py)."""
        key = self._key_at(request, position)
        if self.allocator.blocks.cached_block(key) is None:   # its block's key was dropped by a reset
            return
        if request.restored_snapshot_key is not None:     # before the add, which may evict
            self.allocator.snapshots.demote(request.restored_snapshot_key)
            request.restored_snapshot_key = None
        slot = self.allocator.snapshots.add(key)
        if slot is not None:
            copies.append((allocation.ring_slot, slot))
        if self._d_takers.get(key) is request:
            del self._d_takers[key]

    def _cache_blocks(self, request: Request, allocation: KVAllocation, num_tokens: int) -> None:
        """Key the request's full blocks of positions 0 .. num_tokens-1 (those of a chunk still in
        flight too: every later plan reads them after that chunk's forward)."""
        num_full = num_tokens // self.block_size
        if num_full > request.num_keyed_blocks:
            keys, pool = self.keys(request), self.allocator.blocks
            for i in range(request.num_keyed_blocks, num_full):
                pool.cache(allocation.block_table[i], keys[i])
            request.num_keyed_blocks = num_full

    def take_snapshot_copies(self) -> list[tuple[int, int]]:
        """The (ring slot, snapshot slot) copies due before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset(self) -> None:
        """Forget every cached block and snapshot (blocks held by requests stay held)."""
        self.allocator.blocks.reset()
        self.allocator.snapshots.reset()
        self._pending_copies.clear()
        self._d_takers.clear()


def _will_snapshot(request: Request, position: int) -> bool:
    """Whether the request, admitted to snapshot at D = position, still will (running, D still its
    own, not reached yet)."""
    return (request.status is RequestStatus.RUNNING and position > 0 and request.shared_prefix_position == position
            and request.num_computed_tokens < position)
