"""A decode step's inputs on the device, in static buffers that CUDA graphs read.

One pinned host-to-device copy per step carries, per row, the token, its position, the sequence
length, the ring slot, one block-table entry to write (flat index, value) and where a placeholder
token comes from (a row of the previous step's sampled tokens, or -1), the number of real rows, and
whether the step's greedy choice is wanted (0: every row samples, the graph's argmax writes nothing).
Two pinned buffers take turns, so filling step N+1 never touches the one step N copies from. Rows past it pad a graph's batch size: position -1 (no K/V write), length 0 (zero
attention output), and no expert work in the grouped MoE.

The block tables stay on the device across steps: a row is rewritten when its request changes;
otherwise only the entries the request gained since (one per block in steady decode) are written,
by a scatter inside the graph.
"""

from __future__ import annotations

import numpy as np
import torch

from flint_sched.core.plan import ScheduledRequest, StepPlan

FIELDS = ("tokens", "positions", "seq_lens", "ring_slots", "table_index", "table_value", "sources")


class DecodeInputs:
    def __init__(self, max_rows: int, max_model_len: int, block_size: int, device: torch.device,
                 sampled: torch.Tensor | None = None):
        """`sampled`: the previous step's sampled tokens on the device (executor/sampled_tokens.py)."""
        self.max_rows, self.max_model_len = max_rows, max_model_len
        n = len(FIELDS) * max_rows + 2
        self.flat = torch.zeros(n, dtype=torch.int32, device=device)
        self._hosts = [torch.zeros(n, dtype=torch.int32, pin_memory=device.type == "cuda") for _ in range(2)]
        self._turn = 0
        fields = self.flat[:-2].view(len(FIELDS), max_rows)
        (self.tokens, self.positions, self.seq_lens, self.ring_slots, self.table_index, self.table_value,
         self.sources) = fields
        self.sampled = torch.zeros(1, dtype=torch.int32, device=device) if sampled is None else sampled
        self.num_rows, self.argmax = self.flat[-2:-1], self.flat[-1:]
        max_blocks = -(-max_model_len // block_size)
        # The last element is where rows with no new block entry write.
        self.block_tables_flat = torch.zeros(max_rows * max_blocks + 1, dtype=torch.int32, device=device)
        self.block_tables = self.block_tables_flat[:-1].view(max_rows, max_blocks)
        self._table_rows: list[tuple[str, int] | None] = [None] * max_rows   # (request, entries on device)
        # padding rows: no token, position -1, length 0, ring slot 0, no table entry, no source
        pad = (0, -1, 0, 0, self.block_tables_flat.numel() - 1, 0, -1)
        self._padding = np.array(pad, dtype=np.int32)[:, None].repeat(max_rows, axis=1)

    def fill(self, entries: list[ScheduledRequest], sources: list[int] | None = None, argmax: bool = True) -> None:
        """Decode entries in rows 0..b-1; every later row is padding (a graph of a larger batch size
        computes it, and the block-table scatter reads all rows). sources[i]: the row of `sampled`
        that entry i's token is (-1: its own token_ids[0]); argmax: whether the step's greedy choice
        is wanted (`argmax`, read by kernels/sampling.py greedy)."""
        flat_host = self._hosts[self._turn]
        self._turn ^= 1
        host = flat_host.numpy()
        fields = host[:-2].reshape(len(FIELDS), self.max_rows)
        b, width, dummy = len(entries), self.block_tables.shape[1], self.block_tables_flat.numel() - 1
        # One list per field and one numpy write each (a write per row and field took ~3 µs a row:
        # ~0.9 ms of host time a 256-row step, GPU machine)
        index, value = [dummy] * b, [0] * b
        table_rows = self._table_rows
        for row, e in enumerate(entries):
            table, known = e.block_table, table_rows[row]
            if known is not None and known[0] == e.request_id:
                if len(table) == known[1]:
                    continue                               # steady decode: no new block
                if len(table) == known[1] + 1:
                    index[row], value[row] = row * width + known[1], table[-1]
                elif len(table) > known[1]:
                    self._copy_table(row, table, known[1])
                else:
                    self._copy_table(row, table, 0)
            else:
                self._copy_table(row, table, 0)
            table_rows[row] = (e.request_id, len(table))
        fields[0, :b] = [e.token_ids[0] for e in entries]
        np.maximum(fields[0, :b], 0, out=fields[0, :b])    # a placeholder token reads `sources`
        fields[1, :b] = [e.start_position for e in entries]
        np.add(fields[1, :b], 1, out=fields[2, :b])
        fields[3, :b] = [e.ring_slot for e in entries]
        fields[4, :b] = index
        fields[5, :b] = value
        fields[6, :b] = -1 if sources is None else sources
        fields[:, b:] = self._padding[:, b:]
        host[-2], host[-1] = b, argmax
        self.flat.copy_(flat_host, non_blocking=True)

    @property
    def table_scatter(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index, value, flat): the step's new block-table entries, flat[index[r]] = value[r], which
        the CUDA executor's first kernel writes (kernels/embedding.py); update_block_tables in torch."""
        return self.table_index, self.table_value, self.block_tables_flat

    def update_block_tables(self) -> None:
        """The step's new block-table entries (a scatter)."""
        self.block_tables_flat.index_put_((self.table_index,), self.table_value)

    def fed_tokens(self, rows: int) -> torch.Tensor:
        """The tokens of rows 0..rows-1, a placeholder's taken from the previous step's `sampled`
        (the CUDA executor's first kernel picks them the same way, kernels/embedding.py)."""
        sources = self.sources[:rows]
        picked = self.sampled.index_select(0, sources.clamp(min=0))
        return torch.where(sources >= 0, picked, self.tokens[:rows])

    def _copy_table(self, row: int, table: list[int], start: int) -> None:
        if len(table) > self.block_tables.shape[1]:
            raise ValueError(f"block table of {len(table)} blocks exceeds max_model_len {self.max_model_len}")
        self.block_tables[row, start: len(table)].copy_(torch.tensor(table[start:], dtype=torch.int32))

    def forget(self, plan: StepPlan) -> None:
        """Rows of preempted or finished requests are rewritten when next used (call for every plan,
        also those that do not run through these buffers)."""
        gone = set(plan.preempted_request_ids) | set(plan.finished_request_ids)
        if gone:
            self._table_rows = [None if k is not None and k[0] in gone else k for k in self._table_rows]
