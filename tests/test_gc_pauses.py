"""The server's garbage-collector settings: the start-up heap frozen, long collections logged."""

import gc
import logging

from flint_sched.api.gc_pauses import GC_THRESHOLDS, PauseWatch, freeze_startup_heap


def test_freeze_startup_heap_takes_every_live_object_out_of_collections():
    thresholds = gc.get_threshold()
    try:
        kept = [[n] for n in range(1000)]                # containers the collector tracks
        frozen = freeze_startup_heap()
        # a frozen object that dies leaves the count (another test's thread may drop some): at most
        assert frozen >= 1000 and gc.get_freeze_count() <= frozen
        assert not any(gc.is_tracked(x) and any(x is y for y in gc.get_objects()) for x in kept[:3])
        assert gc.get_threshold() == GC_THRESHOLDS
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    assert gc.get_freeze_count() == 0


def test_a_step_sized_burst_of_objects_starts_no_collection():
    """A burst of ~10,000 short-lived containers (a step's outputs at 256 streams) under the server's
    thresholds leaves the collector alone; under Python's default it collected."""
    thresholds = gc.get_threshold()
    try:
        for setting, expect_collections in ((GC_THRESHOLDS, False), ((700, 10, 10), True)):
            gc.set_threshold(*setting)
            gc.collect()
            before = gc.get_stats()[0]["collections"]
            burst = [[n] for n in range(10_000)]
            del burst
            assert (gc.get_stats()[0]["collections"] > before) == expect_collections, setting
    finally:
        gc.set_threshold(*thresholds)


def test_pause_watch_logs_collections_over_its_threshold_only(caplog):
    slow, quiet = PauseWatch(threshold_s=0.0), PauseWatch(threshold_s=3600.0)
    slow.install()
    quiet.install()
    try:
        with caplog.at_level(logging.WARNING, logger="flint_sched.api"):
            gc.collect()
    finally:
        slow.remove()
        quiet.remove()
    assert slow.num_long_pauses >= 1 and quiet.num_long_pauses == 0
    assert "garbage collector paused the server" in caplog.text and "generation 2" in caplog.text
    assert "tracked in the oldest generation" in caplog.text
    assert slow not in gc.callbacks and quiet not in gc.callbacks
    slow.remove()                                         # removing twice is harmless
