"""The server's garbage-collector settings: the start-up heap frozen, long collections logged."""

import gc
import logging

from flint_sched.api.gc_pauses import PauseWatch, freeze_startup_heap


def test_freeze_startup_heap_takes_every_live_object_out_of_collections():
    try:
        kept = [[n] for n in range(1000)]                # containers the collector tracks
        frozen = freeze_startup_heap()
        assert frozen >= 1000 and gc.get_freeze_count() == frozen
        assert not any(gc.is_tracked(x) and any(x is y for y in gc.get_objects()) for x in kept[:3])
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


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
