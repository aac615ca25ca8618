"""The plain data between the scheduler and the executor: StepPlan in, StepResult back.

A ScheduledRequest feeds token_ids at positions start_position .. end_position-1, and its
block_table covers exactly positions 0 .. end_position-1 when the plan is made. The list fields
(token_ids aside) are the scheduler's own lists, shared rather than copied: the executor reads them
during execute() and never mutates them; after update() they may have grown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from flint_sched.core.request import FinishReason
from flint_sched.sampling_params import SamplingParams

ExecutionPath = Literal["fused", "grouped"]

# A token the scheduler does not know yet: the one an earlier plan, still running, samples for this
# request (async scheduling). The executor feeds its own record of that token in its place.
PLACEHOLDER_TOKEN = -1


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: a prefill chunk, or the last token for a decode."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    ring_slot: int
    samples: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    is_resumed_after_preemption: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    """What one step runs, in a stable order: running decodes, running prefills, new admissions.

    path is "fused" when every entry is a one-token decode and there are at most
    fused_max_seqs of them, else "grouped". preempted_request_ids and finished_request_ids
    name requests whose executor-side state (ring slot contents, sampler state) must be dropped.
    ring_copies: (source slot, destination slot) copies of whole rings (every sliding layer), done
    in order before the forward: prefix-cache snapshots and restores (core/prefix_cache.py).
    """

    scheduled_requests: list[ScheduledRequest]
    num_tokens: int
    path: ExecutionPath
    preempted_request_ids: list[str]
    finished_request_ids: list[str]
    ring_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no entries and no ring copies."""
        return not self.scheduled_requests and not self.ring_copies

    @property
    def is_decode_only(self) -> bool:
        """Every entry is one token (no prompt chunk in the step)."""
        return self.num_tokens == len(self.scheduled_requests)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of a sampled (or prompt) token and the top alternatives, from the model's logits;
    `rank`: the token's 1-based place among all tokens (prompt logprobs only)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of the prompt tokens at positions first_position, first_position + 1, ... (each given
    the tokens before it), from one prefill chunk."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass(slots=True)
class StepResult:
    """Sampled tokens for every entry with samples=True (a list each, one token for now), and prompt
    logprobs of the chunks whose requests ask for them."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: dict[str, PromptLogprobs] | None = None


@dataclass(slots=True)
class RequestStepOutput:
    """What one step produced for one request: new tokens, and why it finished, if it did."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    logprobs: Any = None
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def fill_placeholders(entries: list[ScheduledRequest], last_tokens: dict[str, int]) -> None:
    """Replace each entry's PLACEHOLDER_TOKEN by the token the previous step sampled for it (an
    executor that reads its results on the host; the CUDA executor does this on the device)."""
    for entry in entries:
        if entry.token_ids and entry.token_ids[-1] == PLACEHOLDER_TOKEN:
            if entry.request_id not in last_tokens:
                raise RuntimeError(f"request {entry.request_id!r} is fed a token that the previous step did not "
                                   "sample (plans must run in the order they were made)")
            entry.token_ids[-1] = last_tokens[entry.request_id]
