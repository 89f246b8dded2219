"""The replica's garbage collections counted and timed (``deployments.gc_clock``)."""

from __future__ import annotations

import gc

from deployments.gc_clock import GcClock, gc_clock


def test_a_full_collection_is_counted_and_timed():
    clock = gc_clock()
    assert gc_clock() is clock and gc.callbacks.count(clock) == 1  # once per process
    before = clock.snapshot()
    garbage = [[i] for i in range(20000)]
    for a, b in zip(garbage, garbage[1:]):
        a.append(b)  # a chain the collector walks
    del garbage
    gc.collect(2)
    after = clock.snapshot()
    assert after["collections"][2] >= before["collections"][2] + 1  # other threads may collect too
    assert after["seconds"][2] > before["seconds"][2] and after["longest_ms"][2] > 0
    assert after["thresholds"] == list(gc.get_threshold())
    last = after["recent_full"][-1]
    assert last["ms"] > 0 and last["frozen_objects"] == gc.get_freeze_count() and last["at"] > 0
    assert len(after["recent_full"]) <= GcClock.RECENT


def test_a_stop_without_its_start_is_not_counted():
    clock = GcClock()
    clock("stop", {"generation": 2})  # installed while a collection ran
    assert clock.collections == [0, 0, 0]
    clock("start", {"generation": 1})
    clock("stop", {"generation": 1})
    assert clock.collections == [0, 1, 0] and clock.seconds[1] >= 0
