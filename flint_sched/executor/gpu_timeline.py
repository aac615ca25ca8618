"""How busy the GPU is under load: each launched step's GPU time and the GPU's idle time before it.

A step records a timing event before its first GPU work and one after its last (the read-back's);
once the step is collected, busy += start -> end and idle += (previous step's end) -> start: the time
the GPU waited for the host between two steps. The engine breaks the chain when it runs out of work
(`break_chain`), so a quiet server does not count as idle. Steps are collected in launch order, on
one thread.
"""

from __future__ import annotations

import torch


class GpuTimeline:
    def __init__(self):
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.steps = 0
        self._previous_end = None

    @staticmethod
    def begin() -> torch.cuda.Event:
        """An event at the start of a step's GPU work (on the current stream)."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def collected(self, start, end) -> None:
        """A step whose `end` event has completed: add its GPU time and the gap before it."""
        self.busy_s += start.elapsed_time(end) / 1e3
        if self._previous_end is not None:
            self.idle_s += max(0.0, self._previous_end.elapsed_time(start)) / 1e3
        self._previous_end = end
        self.steps += 1

    def break_chain(self) -> None:
        """The engine has no work: the gap before the next step is not the GPU waiting for the host."""
        self._previous_end = None

    @property
    def idle_share(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total else 0.0
