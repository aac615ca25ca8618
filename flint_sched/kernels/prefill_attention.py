"""Prefill attention on the paged KV layout: the prompt chunks of one step, all requests in one launch.

Per attention layer of a prompt step (cuda/prefill_qkv.cu, cuda/prefill_attention*.cu):

    full layer      prefill_qk_norm_rope (K/V rows to the paged pool)  ->  prefill_attention
    sliding layer   prefill_qk_norm_rope (RoPE)  ->  prefill_attention  ->  prefill_ring_write

`PrefillMetadata` holds the step's per-entry and per-token int32 tensors, built once per step on the
host and copied in one transfer, then read by every layer. The q/k/v buffer [T, (H + 2G) * 128] is
normed and roped in place; head dim 128 and 8 query heads per KV head are fixed (attention.py).
Pools and rings are bf16 or e4m3 (attention.KV_DTYPES; an FP8 cache holds e4m3 of the bf16 value at
scale 1): the kernels' KV_FP8 compiles write them converted and read them back as bf16.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flint_sched.kernels._runtime import F32, I32, Kernel, TensorMap, compile_kernel, encode_tensor_map
from flint_sched.kernels.attention import (
    GROUP,
    HEAD_DIM,
    LOG2E,
    MAX_KV_HEADS,
    _check_pools,
    kv_defines,
    rope_inv_freq,
)
from flint_sched.kernels.linear import check_tensor

TILE_TOKENS = 16               # cuda/prefill_attention.cuh PF_TOKENS: 16 tokens x 8 heads = 128 rows
ATTN_THREADS = 128             # 4 warps of 32 rows
SMEM_BYTES = 128 * 272 + 2 * 64 * 272   # Q tile + one K and one V tile of 64 keys, rows padded to 272 B
# The warp-specialized warpgroup-MMA kernel (sm_90a): a producer and two consumer warpgroups; Q and two
# stages of K and V tiles of 128 keys, in 128-byte-swizzled sub-tiles (+1 KB to align).
WGMMA_THREADS = 384
WGMMA_SMEM_BYTES = 163840 + 1024
# name -> (source, entry point, threads, shared bytes, defines). "mma": mma.sync, any GPU from sm_80;
# "wgmma": FlashAttention-3's design, sm_90a only, the default there (measured in RESULTS.md: 443
# against 177 TFLOP/s for a full layer at 8K tokens); "wgmma-tma": the same, the full layers' whole
# tiles of 16-row pages copied by TMA instead of cp.async (sliding layers as "wgmma"), to measure.
# FP8 pools take "wgmma" for "wgmma-tma": TMA would land e4m3 bytes, and the MMAs read bf16 tiles.
_VARIANTS = {
    "mma": ("prefill_attention.cu", "prefill_attention_bf16", ATTN_THREADS, SMEM_BYTES, ()),
    "wgmma": ("prefill_attention_wgmma.cu", "prefill_attention_wgmma_bf16", WGMMA_THREADS, WGMMA_SMEM_BYTES, ()),
    "wgmma-tma": ("prefill_attention_wgmma.cu", "prefill_attention_wgmma_bf16", WGMMA_THREADS, WGMMA_SMEM_BYTES,
                  (("PW_TMA", 1),)),
}
KERNELS = tuple(_VARIANTS)
TMA_PAGE_ROWS = 16          # cuda/prefill_attention_wgmma.cu load_kv_tile_tma: pages of 16 rows
NORM_THREADS = 256
COPY_THREADS = 128


@functools.cache
def _kernel(source: str, name: str, defines: tuple = ()) -> Kernel:
    return compile_kernel(source, name, dict(defines))


def _check_kv(k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[int, tuple]:
    """(G, defines) of a K/V pool or ring pair of one KV_DTYPES dtype: KV_FP8 for e4m3."""
    return _check_pools(k_pool, v_pool), kv_defines(k_pool)


_pool_maps: dict[tuple, TensorMap] = {}


def pool_tensor_map(pool: torch.Tensor) -> TensorMap:
    """The TMA descriptor of a paged pool [blocks, 16, G, 128] as rows x heads x dims, in boxes of one
    page x one head x 64 dims. Cached by address and shape (a descriptor holds nothing else, so it
    stays right for any pool of that shape at that address), not by the tensor: no pool is kept alive."""
    if pool.shape[1] != TMA_PAGE_ROWS or not pool.is_contiguous():
        raise ValueError(f"TMA reads contiguous pools of {TMA_PAGE_ROWS}-row pages, got {tuple(pool.shape)}")
    key = (pool.device.index, pool.data_ptr(), tuple(pool.shape))
    found = _pool_maps.get(key)
    if found is None:
        if len(_pool_maps) >= 256:
            _pool_maps.clear()
        found = _pool_maps[key] = encode_tensor_map(pool.view(-1, pool.shape[2], HEAD_DIM), (64, 1, TMA_PAGE_ROWS))
    return found


@functools.cache
def default_kernel(device_index: int | None) -> str:
    """"wgmma" on Hopper (sm_90a), "mma" elsewhere."""
    return "wgmma" if torch.cuda.get_device_capability(device_index) == (9, 0) else "mma"


@dataclass(frozen=True)
class Chunk:
    """One entry of a prompt step: `num_tokens` tokens from `start_position`, its rows following the
    previous entry's in the step's q/k/v buffer."""

    start_position: int
    num_tokens: int
    ring_slot: int
    block_table: Sequence[int]


@dataclass
class PrefillMetadata:
    """Device int32 tensors of one prompt step (see the module docstring), views of one buffer.

    entries [E, 4]        first row in the step, start position, tokens, ring slot
    tiles [N, 2]          (entry, first token within it) of each 16-token query tile, heaviest first
    block_tables [E, B]   each entry's block table (padded with 0)
    positions [T]         absolute position of each row (RoPE)
    kv_rows [T]           the paged pool row of each row's K/V: block * block_size + offset
    ring_src / ring_dst [R]   the rows a sliding layer keeps (each entry's last <= ring_rows) and
                          their ring rows, slot * ring_rows + position % ring_rows
    decodes [4, D]        the step's leading one-row entries that attend apart, on the decode
                          kernel (`max_decodes`; their rows in no tile): seq_len, ring slot, row,
                          ring row of each (padding of static buffers: 0, 0, 0, -1)
    num_decodes           D (static buffers: their capacity, the decode launch's grid)
    decode_max_len        the longest of their seq_lens (static buffers: what their tables hold)
    """

    num_tokens: int
    block_size: int
    window: int
    ring_rows: int
    entries: torch.Tensor
    tiles: torch.Tensor
    block_tables: torch.Tensor
    positions: torch.Tensor
    kv_rows: torch.Tensor
    ring_src: torch.Tensor
    ring_dst: torch.Tensor
    decodes: torch.Tensor | None = None
    num_decodes: int = 0
    decode_max_len: int = 0

    @property
    def num_entries(self) -> int:
        return self.entries.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[0]


def prefill_metadata(chunks: Sequence[Chunk], block_size: int, window: int,
                     device: torch.device | str, ring_rows: int | None = None, max_decodes: int = 0) -> PrefillMetadata:
    """The step's metadata for `chunks` (in row order); one host-to-device copy, not waited for.
    ring_rows: rows of a ring slot (>= window; default window; the engine's: core/kv_allocator.ring_rows).
    max_decodes: up to this many leading one-row entries attend apart (`decodes`), not in the tiles."""
    ring_rows = _check_sizes(block_size, window, ring_rows)
    rows, parts = _metadata_parts(chunks, block_size, ring_rows, max_decodes)
    # Without blocking: a blocking copy syncs the stream, and the host would wait for the step before.
    flat = torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]).astype(np.int32)).to(
        device, non_blocking=True)
    views, start = [], 0
    for p in parts:
        views.append(flat[start:start + p.size].view(p.shape))
        start += p.size
    decodes = parts[-1]
    return PrefillMetadata(rows, block_size, window, ring_rows, *views, num_decodes=decodes.shape[1],
                           decode_max_len=int(decodes[0].max(initial=0)))


class PrefillBuffers:
    """PrefillMetadata of fixed shapes in static device memory, for prompt steps replayed from a CUDA
    graph: `tokens` rows (the step's, then padding), up to `max_entries` entries with block tables
    `table_width` wide. `fill(chunks)` writes a step's metadata (stream-ordered copies, so the
    previous step may still be reading the old one). Padding: tiles (-1, 0) (their CTAs exit),
    kv_rows -1 and ring_dst -1 (nothing written), positions 0; `num_tokens` (device int32 [1])
    holds the real row count for the MoE, whose routing skips the rest. Of the block tables only
    each step's [entries, longest table] corner is copied (an entry reads no further than its own
    table); `block_tables` ([>= max_entries, table_width] int32) may be shared by several buffers
    whose graphs never run at once. max_decodes: as prefill_metadata's; the decode launch then
    covers min(max_decodes, max_entries) rows, the step's leading one-row entries and padding."""

    def __init__(self, tokens: int, max_entries: int, table_width: int, block_size: int, window: int,
                 ring_rows: int, device: torch.device | str, block_tables: torch.Tensor | None = None,
                 max_decodes: int = 0):
        self.ring_rows = _check_sizes(block_size, window, ring_rows)
        self.tokens, self.max_entries, self.table_width = tokens, max_entries, table_width
        self.max_decodes = min(max_decodes, max_entries)
        self.max_tiles = math.ceil(tokens / TILE_TOKENS) + max_entries
        # entries, tiles, positions, kv_rows, ring_src, ring_dst, decodes, num_tokens
        self.shapes = [(max_entries, 4), (self.max_tiles, 2), (tokens,), (tokens,), (tokens,), (tokens,),
                       (4, self.max_decodes), (1,)]
        sizes = [math.prod(shape) for shape in self.shapes]
        self.flat = torch.zeros(sum(sizes), dtype=torch.int32, device=device)
        self._host = np.zeros(sum(sizes), dtype=np.int32)
        self._offsets = list(itertools.accumulate(sizes, initial=0))
        views = [self.flat[o:o + n].view(shape) for o, n, shape in zip(self._offsets, sizes, self.shapes)]
        if block_tables is None:
            block_tables = torch.zeros(max_entries, table_width, dtype=torch.int32, device=device)
        if (block_tables.dtype != torch.int32 or block_tables.shape[0] < max_entries
                or block_tables.shape[1] != table_width):
            raise ValueError(f"block_tables must be int32 [>= {max_entries}, {table_width}]")
        self.num_tokens = views[-1]
        self.meta = PrefillMetadata(tokens, block_size, window, self.ring_rows, views[0], views[1],
                                    block_tables[:max_entries], *views[2:-1], num_decodes=self.max_decodes,
                                    decode_max_len=table_width * block_size)

    def fits(self, chunks: Sequence[Chunk]) -> bool:
        return (len(chunks) <= self.max_entries and sum(c.num_tokens for c in chunks) <= self.tokens
                and max(len(c.block_table) for c in chunks) <= self.table_width)

    def fill(self, chunks: Sequence[Chunk]) -> None:
        if not self.fits(chunks):
            raise ValueError(f"{len(chunks)} entries / {sum(c.num_tokens for c in chunks)} tokens / tables of "
                             f"{max(len(c.block_table) for c in chunks)} blocks do not fit buffers of "
                             f"{self.max_entries} / {self.tokens} / {self.table_width}")
        rows, parts = _metadata_parts(chunks, self.meta.block_size, self.ring_rows, self.max_decodes)
        entries, tiles, tables, *per_row, decodes = parts
        host = self._host
        for i, (part, pad) in enumerate(zip([entries, tiles, *per_row], [0, -1, 0, -1, 0, -1])):
            region = host[self._offsets[i]:self._offsets[i + 1]].reshape(self.shapes[i])
            region.fill(pad)
            if i == 1:
                region[:, 1] = 0                    # padding tiles: (-1, 0)
            region[:len(part)] = part
        region = host[self._offsets[6]:self._offsets[7]].reshape(self.shapes[6])
        region[:3], region[3] = 0, -1
        region[:, :decodes.shape[1]] = decodes
        host[-1] = rows
        # Pageable host memory: each copy is staged at once, so the host arrays are free again.
        self.flat.copy_(torch.from_numpy(host), non_blocking=True)
        e, w = tables.shape
        self.meta.block_tables[:e, :w].copy_(torch.from_numpy(tables.astype(np.int32)), non_blocking=True)


def _check_sizes(block_size: int, window: int, ring_rows: int | None) -> int:
    ring_rows = window if ring_rows is None else ring_rows
    if block_size < 1 or window < 1 or ring_rows < window:
        raise ValueError(f"block_size ({block_size}) and window ({window}) must be positive and ring_rows "
                         f"({ring_rows}) >= window")
    return ring_rows


def _metadata_parts(chunks: Sequence[Chunk], block_size: int, ring_rows: int,
                    max_decodes: int = 0) -> tuple[int, list[np.ndarray]]:
    """(rows, [entries, tiles, block_tables, positions, kv_rows, ring_src, ring_dst, decodes]) on the
    host, whole arrays at a time (a mixed step has an entry per decode: 256 at 256 streams)."""
    if not chunks:
        raise ValueError("a prompt step needs at least one entry")
    num = len(chunks)
    starts = np.fromiter((c.start_position for c in chunks), np.int64, num)
    counts = np.fromiter((c.num_tokens for c in chunks), np.int64, num)
    slots = np.fromiter((c.ring_slot for c in chunks), np.int64, num)
    lens = np.fromiter((len(c.block_table) for c in chunks), np.int64, num)
    bad = np.flatnonzero((counts < 1) | (starts < 0) | (slots < 0))
    if bad.size:
        raise ValueError(f"entry {bad[0]}: needs >= 1 token, start >= 0 and a ring slot, got {chunks[bad[0]]}")
    short = np.flatnonzero(lens * block_size < starts + counts)
    if short.size:
        e = short[0]
        raise ValueError(f"entry {e}: block table of {lens[e]} blocks of {block_size} "
                         f"cannot hold positions up to {starts[e] + counts[e] - 1}")
    tables = np.zeros((num, max(1, int(lens.max()))), dtype=np.int64)
    filled = np.arange(tables.shape[1]) < lens[:, None]
    tables[filled] = np.fromiter(itertools.chain.from_iterable(c.block_table for c in chunks), np.int64, int(lens.sum()))
    first_row = np.cumsum(counts) - counts
    rows = int(counts.sum())
    entry = np.repeat(np.arange(num), counts)                  # each row's entry
    offset = np.arange(rows) - first_row[entry]                 # its place in the entry's chunk
    positions = starts[entry] + offset
    kv_rows = tables[entry, positions // block_size] * block_size + positions % block_size
    kept = offset >= (counts - ring_rows)[entry]                # each entry's last <= ring_rows rows
    ring_src = np.flatnonzero(kept)
    ring_dst = slots[entry[kept]] * ring_rows + positions[kept] % ring_rows
    # The leading one-row entries (a mixed step's decodes come first) attend apart, up to max_decodes.
    d = min(max_decodes, int(np.argmax(counts != 1)) if (counts != 1).any() else num)
    decodes = np.stack([starts[:d] + 1, slots[:d], first_row[:d], slots[:d] * ring_rows + starts[:d] % ring_rows])
    num_tiles = -(-counts // TILE_TOKENS)
    num_tiles[:d] = 0
    tile_entry = np.repeat(np.arange(num), num_tiles)
    tile_first = (np.arange(int(num_tiles.sum())) - np.repeat(np.cumsum(num_tiles) - num_tiles, num_tiles)) * TILE_TOKENS
    work = starts[tile_entry] + tile_first + TILE_TOKENS        # keys of a full layer: the cost of the tile
    tiles = np.stack([tile_entry, tile_first], axis=1)[np.argsort(-work, kind="stable")]
    parts = [np.stack([first_row, starts, counts, slots], axis=1), tiles, tables, positions, kv_rows, ring_src,
             ring_dst, decodes]
    if max(int(p.max(initial=0)) for p in parts) >= 2**31:
        raise ValueError("prompt step metadata exceeds int32")
    return rows, parts


# ---- launches ------------------------------------------------------------------------------------


def prefill_qk_norm_rope(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                         meta: PrefillMetadata, eps: float, rope_theta: float | None = None,
                         k_pool: torch.Tensor | None = None, v_pool: torch.Tensor | None = None,
                         pdl: bool = False) -> torch.Tensor:
    """In place: q and k heads of qkv [T, (H + 2G) * 128] RMS-normed, then roped when rope_theta is
    given (sliding layers); with pools (full layers: [num_blocks, block_size, G, 128], bf16 or e4m3)
    each row's K and V also go to its paged row meta.kv_rows[t]. Returns qkv."""
    h, g = _check_qkv(qkv, meta)
    dev = qkv.device
    check_tensor(q_norm_weight, "q_norm_weight", torch.bfloat16, (HEAD_DIM,), dev)
    check_tensor(k_norm_weight, "k_norm_weight", torch.bfloat16, (HEAD_DIM,), dev)
    if (k_pool is None) != (v_pool is None):
        raise ValueError("give both K and V pools, or neither")
    defines = ()
    if k_pool is not None:
        pool_g, defines = _check_kv(k_pool, v_pool)
        if pool_g != g or k_pool.device != dev:
            raise ValueError(f"pools must be [blocks, block_size, {g}, {HEAD_DIM}] on {dev}")
        if k_pool.shape[1] != meta.block_size:
            raise ValueError(f"pool block size {k_pool.shape[1]} != metadata block size {meta.block_size}")
    inv_freq = None
    if rope_theta is not None:
        if not rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {rope_theta}")
        inv_freq = rope_inv_freq(float(rope_theta), dev)
    _kernel("prefill_qkv.cu", "prefill_qk_norm_rope_bf16", defines).launch(
        (meta.num_tokens,), (NORM_THREADS,),
        [qkv, k_pool, v_pool, meta.kv_rows if k_pool is not None else None, q_norm_weight, k_norm_weight,
         meta.positions, I32(h), I32(g), F32(eps), inv_freq],
        pdl=pdl, device=dev.index)
    return qkv


def prefill_attention(qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: PrefillMetadata,
                      sinks: torch.Tensor, sliding: bool, out: torch.Tensor | None = None,
                      softmax_scale: float | None = None, pdl: bool = False,
                      kernel: str | None = None) -> torch.Tensor:
    """out [T, H, 128]: causal attention with sinks of each entry's queries (qkv, normed and roped).

    Full layers (sliding False): keys 0 .. p from the paged pool [num_blocks, block_size, G, 128]
    through meta.block_tables; the chunk's rows must be written (prefill_qk_norm_rope with pools).
    Sliding layers: the last meta.window keys up to p, history from the ring [slots, ring_rows, G, 128]
    and the chunk's own from qkv; the ring is written afterwards (prefill_ring_write).
    Pools and rings bf16 or e4m3. kernel: one of KERNELS (None: default_kernel, by the GPU).
    """
    h, g = _check_qkv(qkv, meta)
    dev = qkv.device
    kernel = default_kernel(dev.index) if kernel is None else kernel
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    pool_g, kv_defines = _check_kv(k_pool, v_pool)
    if pool_g != g or k_pool.device != dev:
        raise ValueError(f"pools must be [pages, rows, {g}, {HEAD_DIM}] on {dev}")
    if sliding and k_pool.shape[1] != meta.ring_rows:
        raise ValueError(f"ring of {k_pool.shape[1]} rows != metadata ring rows {meta.ring_rows}")
    if not sliding and k_pool.shape[1] != meta.block_size:
        raise ValueError(f"pool block size {k_pool.shape[1]} != metadata block size {meta.block_size}")
    if sinks.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"sinks must be bf16 or fp32, got {sinks.dtype}")
    check_tensor(sinks, "sinks", sinks.dtype, (h,), dev, 4)
    if out is None:
        out = torch.empty(meta.num_tokens, h, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    check_tensor(out, "out", torch.bfloat16, (meta.num_tokens, h, HEAD_DIM), dev)
    scale = 1.0 / math.sqrt(HEAD_DIM) if softmax_scale is None else softmax_scale
    source, name, threads, smem, defines = _VARIANTS[kernel]
    tma = bool(defines) and not sliding and k_pool.shape[1] == TMA_PAGE_ROWS and not kv_defines
    args = [out, qkv, k_pool, v_pool, None if sliding else meta.block_tables, I32(meta.block_tables.shape[1]),
            I32(k_pool.shape[1]), I32(meta.window if sliding else 0), meta.entries, meta.tiles, I32(h), I32(g),
            sinks, I32(sinks.dtype == torch.bfloat16), F32(scale * LOG2E)]
    compiled = _kernel(source, name, (defines if tma else ()) + kv_defines)
    if tma:
        compiled.load(dev.index)                  # the driver's context, for the descriptors
        args += [pool_tensor_map(k_pool), pool_tensor_map(v_pool)]
    if meta.num_tiles:          # none when every entry is a decode apart
        compiled.launch((meta.num_tiles * g,), (threads,), args, shared_bytes=smem, pdl=pdl, device=dev.index)
    return out


def prefill_ring_write(qkv: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, meta: PrefillMetadata,
                       pdl: bool = False) -> None:
    """Each entry's last <= ring_rows K/V rows (normed, roped) into its ring slot (bf16 or e4m3), after
    attention."""
    _ring_copy(qkv, k_ring, v_ring, meta, meta.ring_src, meta.ring_dst, pdl)


def decode_ring_write(qkv: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, meta: PrefillMetadata,
                      pdl: bool = False) -> None:
    """The new K/V row of each decode apart (meta.decodes) into its ring, before their attention: a
    decode's row p overwrites position p - ring_rows, which no window reaches. (prefill_ring_write
    writes them again after the step's attention, with the chunks' rows.)"""
    if meta.num_decodes:
        _ring_copy(qkv, k_ring, v_ring, meta, meta.decodes[2], meta.decodes[3], pdl)   # rows -> ring rows


def _ring_copy(qkv: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, meta: PrefillMetadata,
               src: torch.Tensor, dst: torch.Tensor, pdl: bool) -> None:
    """K/V of q/k/v rows src[r] into ring rows dst[r] (dst < 0: nothing), one CTA a row."""
    h, g = _check_qkv(qkv, meta)
    ring_g, defines = _check_kv(k_ring, v_ring)
    if ring_g != g or k_ring.shape[1] != meta.ring_rows or k_ring.device != qkv.device:
        raise ValueError(f"rings must be [slots, {meta.ring_rows}, {g}, {HEAD_DIM}] on {qkv.device}")
    _kernel("prefill_qkv.cu", "prefill_kv_copy_bf16", defines).launch(
        (src.shape[0],), (COPY_THREADS,), [k_ring, v_ring, qkv, src, dst, I32(h), I32(g)], pdl=pdl,
        device=qkv.device.index)


def _check_qkv(qkv: torch.Tensor, meta: PrefillMetadata) -> tuple[int, int]:
    """(H, G) of a q/k/v buffer [T, (H + 2G) * 128], H = 8 G, T = meta.num_tokens."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 2 or not qkv.is_cuda:
        raise ValueError("qkv must be a CUDA tensor [tokens, (H + 2G) * 128]")
    heads, rest = divmod(qkv.shape[1], HEAD_DIM)
    g = heads // (GROUP + 2)
    if rest or heads != g * (GROUP + 2) or not 1 <= g <= MAX_KV_HEADS:
        raise ValueError(f"qkv width {qkv.shape[1]} is not (8G + 2G) * {HEAD_DIM} for 1 <= G <= {MAX_KV_HEADS}")
    check_tensor(qkv, "qkv", torch.bfloat16, (meta.num_tokens, qkv.shape[1]), qkv.device)
    if meta.entries.device != qkv.device:
        raise ValueError(f"metadata is on {meta.entries.device}, qkv on {qkv.device}")
    return GROUP * g, g
