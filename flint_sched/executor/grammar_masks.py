"""Per-request grammar state on the executor side, and the token masks it puts on the logits.

Each constrained request has one llguidance matcher, made from the compiler's cache on its first
sampling step (no output yet: a fresh one, even if a finished request left one under the same id).
A matcher follows the scheduler's record: at every sampling step it first consumes the tokens of
`output_token_ids` it has not seen (the one sampled last step), so it never needs to be told what
was accepted, and preemption changes nothing. A constraint that begins after a token (the end of
the reasoning) leaves the row free until that token has come. The masks are filled on the host
(llguidance, in parallel threads for several rows) while the device still runs the step, then
copied over as bits:

    bitmask [rows, ceil(V / 32)] int32, bit j of word w  <->  token 32 * w + j allowed
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import llguidance
import torch

from flint_sched.core.plan import ScheduledRequest
from flint_sched.structured.compiler import GrammarCompiler
from flint_sched.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class _Grammar:
    matcher: llguidance.LLMatcher
    params: StructuredOutputsParams
    num_consumed: int = 0
    started: bool = True


def constrained(entry: ScheduledRequest) -> bool:
    return entry.sampling_params.structured_outputs is not None


def _bit(j: int) -> int:
    """Bit j of an int32 word, as the signed value torch stores."""
    return (1 << j) - (1 << 32 if j == 31 else 0)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from a bitmask [rows, words] (tokens past 32 * words: not allowed).

    NOTE: read as bytes, token t is bit t % 8 of byte t // 8 on a little-endian host (x86, ARM, and
    a GPU given those bytes); unpacking bytes costs a quarter of unpacking int32 words (CPU: 9 against
    33 ms at 64 rows of 151,552 tokens).
    """
    rows, words = bitmask.shape
    data = bitmask.contiguous().view(torch.uint8)
    bits = (data.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=bitmask.device)) & 1
    allowed = bits.view(rows, words * 32).bool()
    if vocab_size > words * 32:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - words * 32), value=False)
    return allowed[:, :vocab_size]


class GrammarMasks:
    """The matchers of the running constrained requests (see the module docstring)."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.grammars: dict[str, _Grammar] = {}
        self._pool: llguidance.LLExecutor | None = None

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the state of finished requests."""
        for request_id in request_ids:
            self.grammars.pop(request_id, None)

    def fill(self, entries: Sequence[ScheduledRequest]) -> tuple[list[int], torch.Tensor] | None:
        """(rows of `entries` that are constrained, their bitmask on the host), or None if none is."""
        rows = [row for row, e in enumerate(entries) if constrained(e)]
        if not rows:
            return None
        matchers = [self._advanced(entries[row]) for row in rows]
        bitmask = _allocate_bitmask(len(rows), self.compiler.ll_tokenizer.vocab_size)
        active = [(m, i) for i, m in enumerate(matchers) if m is not None]     # the others stay all ones
        words = bitmask.shape[1]
        if len(active) == 1:
            matcher, i = active[0]
            matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), 4 * words)
        elif active:
            if self._pool is None:
                self._pool = llguidance.LLExecutor()
            self._pool.unsafe_compute_mask_ptr(active, bitmask.data_ptr(), 4 * words, len(rows))
        for matcher, i in active:
            if matcher.is_error():           # nothing fits any more: let it end on a stop token
                bitmask[i] = 0
                for token in self.compiler.tokenizer.eos_token_ids:
                    bitmask[i, token // 32] |= _bit(token % 32)
        return rows, bitmask

    def _advanced(self, entry: ScheduledRequest) -> llguidance.LLMatcher | None:
        """The entry's matcher, after the output tokens it has not consumed yet (None: not begun)."""
        params = entry.sampling_params.structured_outputs
        state = self.grammars.get(entry.request_id)
        if state is None or not entry.output_token_ids or state.params != params:
            state = _Grammar(self.compiler.new_matcher(params), params, started=params.begin_after_token is None)
            self.grammars[entry.request_id] = state
        new = entry.output_token_ids[state.num_consumed:]
        if not state.started:
            state.num_consumed += len(new)
            if params.begin_after_token not in new:
                return None
            state.started = True
            new = new[new.index(params.begin_after_token) + 1:]
            state.num_consumed -= len(new)
        if new and not state.matcher.is_error():
            if not state.matcher.consume_tokens(new):
                logger.warning("request %s left its grammar (%s); only stop tokens are allowed now",
                               entry.request_id, state.matcher.get_error().split("\n")[0])
        state.num_consumed += len(new)
        return state.matcher

    def mask(self, logits: torch.Tensor, filled: tuple[list[int], torch.Tensor]) -> torch.Tensor:
        """A copy of logits [B, V] with the disallowed tokens of the constrained rows at -inf."""
        rows, bitmask = filled
        allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
        if len(rows) == logits.shape[0]:                 # every row constrained: one pass
            return torch.where(allowed, logits, float("-inf"))
        index = torch.tensor(rows, device=logits.device)
        masked = logits.clone()
        masked[index] = torch.where(allowed, logits[index], float("-inf"))
        return masked


def _allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """All-ones int32 bitmask rows [rows, ceil(vocab / 32)] on the host, pinned where a GPU is (the
    copy to the device is asynchronous). As llguidance.torch does; that module is not imported: it
    wraps one function in torch.compile at import, which loads torch's compiler stack (~2 s of
    every process start, the server's and the CLI's)."""
    shape = (rows, (vocab_size + 31) // 32)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
