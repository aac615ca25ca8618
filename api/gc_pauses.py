"""Python's garbage collector and the serving loop: the start-up heap frozen, long pauses logged.

A full (generation 2) collection walks every object the collector tracks, and while it runs neither
the engine's step loop nor the HTTP side moves. Right after start-up that is the whole heap of the
loaded server: ~390,000 objects for flint-tiny, 217 ms for one full collection on the 2-core CI
machine. As vLLM does, the server collects once when it has started and freezes what is left
(`gc.freeze`: those objects are never walked again; they are still freed when their last reference
goes). Collections that still take PAUSE_WARNING_S or longer are logged with their generation, so a
latency spike under load can be told from a slow step.
"""

from __future__ import annotations

import gc
import logging
import time

PAUSE_WARNING_S = 0.05
logger = logging.getLogger("flint_sched.api")


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object still alive; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class PauseWatch:
    """A gc callback: collections of threshold_s or longer are counted and logged."""

    def __init__(self, threshold_s: float = PAUSE_WARNING_S) -> None:
        self.threshold_s = threshold_s
        self.num_long_pauses = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        if took >= self.threshold_s:
            self.num_long_pauses += 1
            logger.warning("Python's garbage collector paused the server for %.0f ms (generation %d, %d objects "
                           "freed, %d tracked in the oldest generation, %d frozen)", 1e3 * took, info["generation"],
                           info["collected"], len(gc.get_objects(2)), gc.get_freeze_count())

    def install(self) -> None:
        gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
