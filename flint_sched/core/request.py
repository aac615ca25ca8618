"""One request's token state, as the scheduler sees it.

Invariants: all_token_ids == prompt_token_ids + output_token_ids, and
0 <= num_computed_tokens <= len(all_token_ids) <= max_num_tokens, where
max_num_tokens = min(len(prompt) + max_tokens, max_model_len). Only the scheduler mutates a Request.

With async scheduling a plan may be made while earlier ones run: `num_in_flight_tokens` counts the
tokens of plans scheduled and not yet updated, `num_pending_outputs` the tokens those plans will
sample (known to the executor, not yet to the scheduler).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from flint_sched.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """The OpenAI `finish_reason` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
}
_REASON_OF_STATUS = {status: reason for reason, status in _STATUS_OF_REASON.items()}


class Request:
    """A prompt, what was generated so far, and how much of it has KV written."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_index",
        "max_num_tokens",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_pending_outputs",
        "num_preemptions",
        "num_cached_tokens",
        "block_keys",
        "num_keyed_blocks",
        "shared_prefix_position",
        "restored_snapshot_key",
        "status",
        "stop_reason",
        "_stop_eos_ids",
        "_stop_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        arrival_index: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_index = arrival_index
        self.max_num_tokens = len(self.prompt_token_ids) + sampling_params.max_tokens
        if max_model_len is not None:
            self.max_num_tokens = min(self.max_num_tokens, max_model_len)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_pending_outputs = 0
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None   # prompt tokens the first admission found cached
        self.block_keys: list[bytes] = []           # prefix-cache keys of full blocks (block_hash.py)
        self.num_keyed_blocks = 0                   # leading blocks of the table that are cached
        self.shared_prefix_position = 0             # D of prefix_cache.py: a snapshot where others' blocks end
        self.restored_snapshot_key: bytes | None = None  # the snapshot its rings came from, until it takes one
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self._stop_eos_ids = frozenset() if sampling_params.ignore_eos else self.eos_token_ids
        self._stop_token_ids = frozenset(sampling_params.stop_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _REASON_OF_STATUS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASON_OF_STATUS.get(self.status)

    def append_output_token(self, token_id: int) -> FinishReason | None:
        """Record a sampled token; return why the request must finish now, or None.

        A stop token (eos unless ignore_eos, or one of stop_token_ids) ends it once min_tokens
        are out; it is checked before the length cap, so an eos at the last allowed place says
        "stop". stop_reason is set to the token id when one of stop_token_ids ended it.
        """
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.output_token_ids) >= self.sampling_params.min_tokens:
            if token_id in self._stop_eos_ids:
                return FinishReason.STOP
            if token_id in self._stop_token_ids:
                self.stop_reason = token_id
                return FinishReason.STOP
        if len(self.all_token_ids) >= self.max_num_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self, reason: FinishReason) -> None:
        self.status = _STATUS_OF_REASON[reason]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
