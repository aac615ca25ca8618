"""Python's garbage collector and the serving loop: the start-up heap frozen, long pauses logged.

A full (generation 2) collection walks every object the collector tracks, and while it runs neither
the engine's step loop nor the HTTP side moves. Right after start-up that is the whole heap of the
loaded server: ~390,000 objects for flint-tiny, 217 ms for one full collection on the 2-core CI
machine. As vLLM does, the server collects once when it has started and freezes what is left
(`gc.freeze`: those objects are never walked again; they are still freed when their last reference
goes). Collections that still take PAUSE_WARNING_S or longer are logged with their generation, so a
latency spike under load can be told from a slow step.

Then the thresholds are raised (GC_THRESHOLDS). Python's default (700, 10, 10) starts a young
collection whenever 700 more tracked objects are alive than at the last one, and a step of 256
streams makes and frees more than that in one burst (outputs, text pieces, events): ~3 young
collections a step, a full one every ~100 steps (each walks every object not frozen; the server
logged pauses of 50 ms and more under load). Objects freed by their reference counts never need the
collector, so only cyclic garbage waits longer with the higher thresholds. Measured on the CI machine
(scripted executor, 256 streams x 512 tokens, RESULTS.md session 11): server CPU 133 -> 104-123 µs a
token, P99 time between tokens 143-151 -> 36-39 ms.
"""

from __future__ import annotations

import gc
import logging
import time

PAUSE_WARNING_S = 0.05
GC_THRESHOLDS = (50_000, 20, 100)
logger = logging.getLogger("flint_sched.api")


def freeze_startup_heap() -> int:
    """Collect once, freeze every object still alive and raise the collection thresholds
    (GC_THRESHOLDS); returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
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
