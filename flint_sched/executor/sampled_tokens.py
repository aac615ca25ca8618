"""The tokens a step sampled, kept on the device for the next step and copied back to the host.

Async scheduling (engine/async_engine.py) launches step N+1 before step N's tokens reach the host;
a decode of N+1 then carries PLACEHOLDER_TOKEN and its input is taken from `values` here, which
step N filled on the device (stream order puts N's write before N+1's read). The read-back of each
step goes to its own pinned buffer (two, used in turn: a step's buffer is reused two steps later,
after the engine has collected it), with an event that `collect` waits on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flint_sched.core.plan import PLACEHOLDER_TOKEN, ScheduledRequest, StepResult


def one_token_each(request_ids: list[str], tokens: list[int]) -> StepResult:
    """The StepResult of one sampled token per request."""
    return StepResult({rid: [t] for rid, t in zip(request_ids, tokens, strict=True)})


@dataclass
class LaunchedStep:
    """A launched step: its result when the host already has it, or where its tokens will land."""

    result: StepResult | None = None
    request_ids: list[str] | None = None
    host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    start: torch.cuda.Event | None = None    # before the step's first GPU work (executor/gpu_timeline.py)
    prompt: bool = False                      # the step has prompt rows (the timeline's prompt share)

    def collect(self) -> StepResult:
        if self.result is not None:
            return self.result
        self.done.synchronize()
        return one_token_each(self.request_ids, self.host.tolist())


class SampledTokens:
    def __init__(self, size: int, device: torch.device):
        self.values = torch.zeros(size, dtype=torch.int32, device=device)
        self.row_of: dict[str, int] = {}
        pinned = device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0

    def sources(self, entries: list[ScheduledRequest]) -> list[int]:
        """Per entry, the row of `values` its first token comes from, or -1 (a known token)."""
        out = []
        for e in entries:
            if e.token_ids[0] != PLACEHOLDER_TOKEN:
                out.append(-1)
            elif (row := self.row_of.get(e.request_id)) is None:
                raise RuntimeError(f"request {e.request_id!r} is fed a token that the previous step did not "
                                   "sample (plans must run in the order they were made)")
            else:
                out.append(row)
        return out

    def resolve(self, token_ids: torch.Tensor, rows: list[int], sources: list[int]) -> None:
        """token_ids[rows[i]] = values[sources[i]] (eager steps; graphs do it in DecodeInputs)."""
        if rows:
            index = torch.tensor(rows, dtype=torch.long).to(token_ids.device, non_blocking=True)
            source = torch.tensor(sources, dtype=torch.long).to(token_ids.device, non_blocking=True)
            token_ids.index_copy_(0, index, self.values.index_select(0, source).to(token_ids.dtype))

    def record(self, entries: list[ScheduledRequest], tokens: torch.Tensor | None,
               result: StepResult | None = None) -> LaunchedStep:
        """The step's sampled tokens (device `tokens` in entry order, or a host `result`): keep them
        for the next step and start their copy to the host."""
        n = len(entries)
        if n > self.values.numel():
            raise ValueError(f"{n} sampled tokens, room for {self.values.numel()}")
        self.row_of = {e.request_id: i for i, e in enumerate(entries)}
        if result is not None:
            host = [result.sampled_token_ids[e.request_id][-1] for e in entries]
            self.values[:n].copy_(torch.tensor(host, dtype=torch.int32))
            return LaunchedStep(result=result)
        self.values[:n].copy_(tokens)
        if self.values.device.type != "cuda":
            return LaunchedStep(result=one_token_each([e.request_id for e in entries], tokens.tolist()))
        host = self._host[self._turn][:n]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)   # timed: the GPU timeline's end of the step
        done.record()
        return LaunchedStep(request_ids=[e.request_id for e in entries], host=host, done=done)
