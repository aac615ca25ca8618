"""Token choice of decode rows from CUDA graphs: greedy rows keep the step graph's argmax; rows that
sample with temperature / top-k / top-p / min-p (no seed, no logit edits, no logprobs) draw in one
graph per (batch size, masks in use). Everything else samples through executor/sampler.py.
"""

from __future__ import annotations

import numpy as np
import torch

from flint_sched.executor.graphs import padded_batch
from flint_sched.executor.sampler import draw, filter_rows
from flint_sched.kernels.sampling import argmax_workspace, rng_state, sample

HOST_BUFFERS = 4
# Temperature-only batches (no top-k / top-p / min-p) draw with kernels/sampling.py `sample`: one pass
# over the bf16 logits (Gumbel-max) instead of an fp32 copy, a softmax and exponential noise of
# [batch, vocab]; a call at 256 rows of Flint's vocabulary took 225 µs against 648 (H200, session 23),
# and served at 256 streams (temperature 1, bench serve's default) 13,345 -> 15,088 output tok/s with
# the e4m3 cache (session 24). False: the exponential race for these batches too.
GUMBEL_MAX = True


def plain(entry) -> bool:
    """Token choice from the logits as they are: no edits first (grammar mask, allowed ids, bans, bias,
    penalties), no logprobs."""
    p = entry.sampling_params
    return not (p.structured_outputs is not None or p.logit_bias or p.min_tokens > len(entry.output_token_ids)
                or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logprobs is not None
                or p.allowed_token_ids is not None or p.bad_words_token_ids)


class GraphSampler:
    """Temperature / top-k / top-p / min-p sampling of a decode batch from the executor's logits,
    captured in one CUDA graph per (padded batch size, masks in use) (a dozen kernels, a sort unless
    only temperature is set, and no host work; GUMBEL_MAX: one kernel for temperature alone); greedy
    rows of the batch keep the graph's argmax.
    Per-step parameters arrive in one pinned copy. The noise comes from torch's default CUDA
    generator (graph-safe), which the executor seeds; seeded requests and edited logits go through
    executor/sampler.py instead.

    Batches are padded to `batch_sizes` (the step graphs' sizes) and the graphs draw their
    intermediates from `pool` (the step graphs' pool). Before, each distinct batch size had its own
    graph and private pool of [b, vocab] fp32 buffers (~0.5 GB at 256 rows), and serving 256 streams
    ran the GPU out of memory (benchmarks/RESULTS.md, session 5)."""

    def __init__(self, logits: torch.Tensor, greedy_tokens: torch.Tensor, batch_sizes: tuple[int, ...] = (),
                 pool=None):
        self.logits, self.greedy_tokens = logits, greedy_tokens
        self.batch_sizes, self.pool = batch_sizes, pool
        rows, vocab = logits.shape
        self.vocab = vocab
        self.params = torch.zeros(5, rows, dtype=torch.float32, device=logits.device)
        self._padding = np.repeat(np.array([[1.0], [vocab], [1.0], [0.0], [1.0]], dtype=np.float32), rows, axis=1)
        # Pinned buffers in turn, each refilled only once the GPU has run its last copy (its event):
        # a step may sample twice (a mixed step's decode and prompt parts) and the next one is
        # launched while it runs, so four keep the host from waiting.
        self._hosts = [torch.zeros_like(self.params, device="cpu", pin_memory=True) for _ in range(HOST_BUFFERS)]
        self._copied: list[torch.cuda.Event | None] = [None] * HOST_BUFFERS
        self._turn = 0
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=logits.device)
        self.drawn = torch.zeros(rows, dtype=torch.int64, device=logits.device)
        # `sample`'s state (its seed from torch's CUDA generator, which the executor seeds) and scratch
        self.rng = rng_state(logits.device) if logits.is_cuda else None
        self.workspace = argmax_workspace(rows, vocab, logits.device) if logits.is_cuda else None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

    def __call__(self, entries) -> torch.Tensor:
        """The batch's tokens (int64 on the device, in entry order)."""
        turn = self._turn
        self._turn = (turn + 1) % HOST_BUFFERS
        if (copied := self._copied[turn]) is not None:
            copied.synchronize()                     # at once unless the GPU is that far behind
        params_host = self._hosts[turn]
        b, host = len(entries), params_host.numpy()
        rows = padded_batch(b, self.batch_sizes) or b
        # A list per parameter and one numpy write each (a write per row took ~3 µs a row)
        params = [e.sampling_params for e in entries]
        vocab = self.vocab
        host[0, :b] = [1.0 if p.is_greedy else p.temperature for p in params]
        host[1, :b] = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        host[2, :b] = [p.top_p for p in params]
        host[3, :b] = [p.min_p for p in params]
        host[4, :b] = [p.is_greedy for p in params]
        host[:, b:rows] = self._padding[:, b:rows]     # padding: greedy rows, no masks
        self.params.copy_(params_host, non_blocking=True)
        self._copied[turn] = torch.cuda.Event()
        self._copied[turn].record()
        # Masks no row needs stay out of the graph (pure temperature sampling sorts nothing).
        key = (rows, bool((host[1, :b] < self.vocab).any()), bool((host[2, :b] < 1.0).any()), bool(host[3, :b].any()))
        graph = self.graphs.get(key)
        if graph is None:
            self._sample(*key)                       # warm-up outside the capture (sort workspace, kernels)
            graph = self.graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._sample(*key)
        graph.replay()
        return self.tokens[:b]

    def _sample(self, b: int, use_top_k: bool, use_top_p: bool, use_min_p: bool) -> None:
        temperature, top_k, top_p, min_p, greedy = self.params[:, :b]
        if use_top_k or use_top_p or use_min_p or not GUMBEL_MAX:
            logits = filter_rows(self.logits[:b].float(), temperature, top_k, top_p, min_p, use_top_k, use_top_p,
                                 use_min_p)
            drawn = draw(torch.softmax(logits, dim=-1))
        else:
            drawn = sample(self.logits[:b], temperature, self.rng, out=self.drawn[:b], workspace=self.workspace)
        self.tokens[:b] = torch.where(greedy > 0, self.greedy_tokens[:b], drawn)
