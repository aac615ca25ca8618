"""How busy the GPU is under load: each launched step's GPU time and the GPU's idle time before it.

A step records a timing event before its first GPU work and one after its last (the read-back's);
once the step is collected, busy += start -> end and idle += (previous step's end) -> start: the time
the GPU waited for the host between two steps. The engine breaks the chain when it schedules nothing
(`break_chain`): the next gap counts as stalled (it held requests) or quiet (it had none), not as
idle. Steps are collected in launch order, on one thread.
"""

from __future__ import annotations

import torch


class GpuTimeline:
    def __init__(self):
        self.busy_s = 0.0          # GPU time of the steps
        self.prompt_busy_s = 0.0   # of which steps with prompt rows
        self.idle_s = 0.0          # gaps between steps while the engine had work: the host's
        self.stalled_s = 0.0       # gaps while the engine had requests but scheduled nothing
        self.quiet_s = 0.0         # gaps while the engine had no request
        self.steps = 0
        self._previous_end = None
        self._gap = "idle"

    @staticmethod
    def begin() -> torch.cuda.Event:
        """An event at the start of a step's GPU work (on the current stream)."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def collected(self, start, end, prompt: bool = False) -> None:
        """A step whose `end` event has completed: add its GPU time and the gap before it."""
        busy = start.elapsed_time(end) / 1e3
        self.busy_s += busy
        self.prompt_busy_s += busy if prompt else 0.0
        if self._previous_end is not None:
            gap = max(0.0, self._previous_end.elapsed_time(start)) / 1e3
            if self._gap == "stalled":
                self.stalled_s += gap
            elif self._gap == "quiet":
                self.quiet_s += gap
            else:
                self.idle_s += gap
        self._previous_end, self._gap = end, "idle"
        self.steps += 1

    def break_chain(self, has_requests: bool = False) -> None:
        """The engine scheduled nothing (`has_requests`: though it holds requests, else it has none):
        the gap before the next step is not the GPU waiting for the host."""
        self._gap = "stalled" if has_requests else "quiet"

    def lose_track(self) -> None:
        """A step without timing events ran: the next gap is unknown."""
        self._previous_end = None

    @property
    def idle_share(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total else 0.0
