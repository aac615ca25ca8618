"""The KV tensors behind the hybrid allocator's integers: paged blocks and per-request rings.

    full  [num_full_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]
          position p of a request lives in block block_table[p // block_size], row p % block_size
    ring  [num_sliding_layers, 2 (K, V), num_slots, ring_rows, kv_heads, head_dim]
          position p lives at row p % ring_rows of the request's slot (ring_rows = window +
          block_size - 1, core/kv_allocator.ring_rows); the last ring_rows positions written are
          there, older ones are overwritten; slots past max_num_seqs hold prefix-cache snapshots
          (copies of a request's rings, core/prefix_cache.py)
"""

from __future__ import annotations

import torch

from flint_sched.config import FlintConfig
from flint_sched.core.kv_allocator import ring_rows
from flint_sched.quant.fp8 import round_kv, to_kv


class KVCache:
    def __init__(self, config: FlintConfig, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str):
        g, d = config.num_key_value_heads, config.head_dim
        self.block_size = block_size
        self.dtype = dtype                # the compute dtype, or e4m3 (quant/fp8.py): reads return it as stored
        self.window = config.sliding_window
        self.ring_rows = ring_rows(self.window, block_size)
        self.full = torch.zeros(len(config.full_layers), 2, num_blocks, block_size, g, d, dtype=dtype, device=device)
        self.ring = torch.zeros(len(config.sliding_layers), 2, num_slots, self.ring_rows, g, d, dtype=dtype,
                                device=device)
        self.full_index = {layer: i for i, layer in enumerate(config.full_layers)}
        self.ring_index = {layer: i for i, layer in enumerate(config.sliding_layers)}

    @staticmethod
    def bytes_per_block(config: FlintConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return len(config.full_layers) * 2 * block_size * config.kv_size * itemsize

    @staticmethod
    def bytes_per_slot(config: FlintConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return len(config.sliding_layers) * 2 * ring_rows(config.sliding_window, block_size) * config.kv_size * itemsize

    def _paged_rows(self, block_table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return block_table[positions // self.block_size], positions % self.block_size

    def write_full(self, layer: int, block_table: torch.Tensor, positions: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
        blocks, rows = self._paged_rows(block_table, positions)
        kv = self.full[self.full_index[layer]]
        kv[0, blocks, rows] = to_kv(k, kv.dtype)
        kv[1, blocks, rows] = to_kv(v, kv.dtype)

    def rounded(self, x: torch.Tensor) -> torch.Tensor:
        """x as a read of it from the cache would return it (in x's dtype)."""
        return round_kv(x, self.dtype)

    def read_full(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [num_tokens, kv_heads, head_dim] of positions 0 .. num_tokens-1."""
        positions = torch.arange(num_tokens, device=block_table.device)
        blocks, rows = self._paged_rows(block_table, positions)
        kv = self.full[self.full_index[layer]]
        return kv[0, blocks, rows], kv[1, blocks, rows]

    def write_ring(self, layer: int, slot: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the last ring_rows of the given positions (older ones would be overwritten anyway)."""
        keep = slice(max(0, positions.numel() - self.ring_rows), None)
        rows = positions[keep] % self.ring_rows
        kv = self.ring[self.ring_index[layer]]
        kv[0, slot, rows] = to_kv(k[keep], kv.dtype)
        kv[1, slot, rows] = to_kv(v[keep], kv.dtype)

    def copy_rings(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole slots (every sliding layer, K and V), source to destination, in order."""
        for source, destination in copies:
            self.ring[:, :, destination] = self.ring[:, :, source]

    def read_ring(self, layer: int, slot: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the given past positions, which must be among the last ring_rows written."""
        rows = positions % self.ring_rows
        kv = self.ring[self.ring_index[layer]]
        return kv[0, slot, rows], kv[1, slot, rows]
