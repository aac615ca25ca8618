"""Static device memory of the CUDA executor: what must outlive one launch or one graph segment.

Intermediates (normed rows, q/k/v, expert activations) are allocated per step with torch.empty, from
the graphs' private pool when captured. What stays: the hidden state handed between graph segments,
the logits and greedy tokens the host reads, and the kernels' workspaces whose tickets reset
themselves (zeroed once, then left to the kernels).
"""

from __future__ import annotations

import torch

from flint_sched.config import FlintConfig
from flint_sched.kernels import attention as attn
from flint_sched.kernels.grouped_moe import moe_routing_workspace
from flint_sched.kernels.linear import MAX_TOKENS
from flint_sched.kernels.moe import router_workspace
from flint_sched.kernels.sampling import argmax_workspace, pick_workspace


class Workspaces:
    """Sized for decode graphs of up to `max_rows` rows; `max_seqs` rows of logits may be sampled
    in a prompt step (one per request)."""

    def __init__(self, config: FlintConfig, max_rows: int, max_seqs: int, device: torch.device,
                 prompt_graph_rows: int = 0):
        c = config
        self.config, self.max_rows = config, max_rows
        self.hidden = torch.zeros(2, max_rows, c.hidden_size, dtype=torch.bfloat16, device=device)
        self.logits = torch.zeros(max_rows, c.vocab_size, dtype=torch.bfloat16, device=device)
        self.next_tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.attention = attn.attention_workspace(device, max_rows, c.num_key_value_heads)
        self.router = router_workspace(c.n_routed_experts, device)
        self.argmax = argmax_workspace(max(max_rows, max_seqs), c.vocab_size, device)
        self.pick = pick_workspace(max(max_rows, max_seqs), device)  # the LM head's own argmax (LM_HEAD_ARGMAX)
        self.moe_routing = self._routing(max_rows, device)
        # The fused steps' MoE sum (kernel_ops.MOE_SPLIT_MAX_ROWS; moe_split takes at most MAX_TOKENS rows):
        # zeros between layers (each norm clears it).
        self.moe_acc = torch.zeros(min(max_rows, MAX_TOKENS), c.hidden_size, dtype=torch.int64, device=device)
        # Prompt steps replayed from graphs (up to prompt_graph_rows rows) share one, kept for good:
        # the graphs hold its addresses.
        self.prompt_graph_rows = prompt_graph_rows
        self.prompt_graph_routing = self._routing(prompt_graph_rows, device) if prompt_graph_rows > max_rows else None
        self._prompt_routing = None      # grown to the longest prompt step seen (eager steps only)
        # Persistent decode steps (kernel_ops.PERSISTENT) by (rows, layers, buffers): their task lists
        # and pointer tables, read by every replay of the graphs that launch them.
        self.decode_steps: dict[tuple, object] = {}
        self._q_slots: torch.Tensor | None = None

    def q_slots(self, max_rows: int, max_keys: int) -> torch.Tensor:
        """The attention CTAs' q slots (kernel_ops.FUSE_QK_ATTENTION) for fused steps of up to max_rows
        rows over up to max_keys keys: made on first use (a graph's eager first run) and kept, since
        graphs hold its address."""
        if self._q_slots is None:
            n = attn.q_slots_elements(max_rows, max_keys, self.config.num_key_value_heads)
            self._q_slots = torch.empty(n, dtype=torch.bfloat16, device=self.hidden.device)
        return self._q_slots

    def routing_for(self, rows: int):
        """The grouped MoE's routing workspace for `rows` tokens: the static one of the decode graphs,
        the prompt graphs' one, or, for a prompt step longer than any graph, one kept across prompt
        steps and grown when a longer one comes (steps run one at a time; its ticket resets itself)."""
        if rows <= self.max_rows:
            return self.moe_routing
        if rows <= self.prompt_graph_rows:
            return self.prompt_graph_routing
        if self._prompt_routing is None or self._prompt_routing.max_tokens < rows:
            self._prompt_routing = self._routing(rows, self.hidden.device)
        return self._prompt_routing

    def _routing(self, rows: int, device: torch.device):
        c = self.config
        return moe_routing_workspace(rows, c.n_routed_experts, c.num_experts_per_tok, device, c.hidden_size,
                                     c.moe_intermediate_size)
