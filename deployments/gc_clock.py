"""The replica process's garbage collections, counted and timed (``gc.callbacks``).

Why: a collection stops every thread of the process, the engine's decode thread among them, for
as long as it walks the objects its generation holds. Ray Serve collects and freezes the heap
once a replica's init is done (``RAY_SERVE_FREEZE_GC_ON_STARTUP``: the model, the tokenizer and
the compiled tables are never walked again), so what a full collection walks under load is what
requests left behind: each request's sequence and drafter state, the tool sets' token tables,
the tenants' suffix histories. /health (``engine.gc``) and /metrics report how many collections
each generation ran, the seconds they took and the longest one, so a load test shows whether they
cost a step's worth of time.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import deque


class GcClock:
    """Collections per generation, their seconds and the longest pause, since it was installed.
    The callbacks run on whichever thread a collection starts on, under the GIL, one collection at
    a time, so a start is always followed by its own stop."""

    RECENT = 16  # full collections kept with their time (``recent_full``)

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self.recent_full: deque[tuple[float, float, int]] = deque(maxlen=self.RECENT)  # (wall clock, s, frozen)
        self._started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed while a collection ran
            return
        spent = time.perf_counter() - self._started
        self._started = None
        g = min(max(int(info.get("generation", 0)), 0), 2)
        self.collections[g] += 1
        self.seconds[g] += spent
        self.longest[g] = max(self.longest[g], spent)
        if g == 2:  # when, how long, and whether the heap was frozen yet (a replica's init collects once, then freezes)
            self.recent_full.append((time.time(), spent, gc.get_freeze_count()))

    def snapshot(self) -> dict:
        """What /health reports: per generation 0 / 1 / 2, counts, seconds, the longest pause in
        ms; the last full collections (when, how long, the objects frozen out of them then); the
        objects frozen out of every collection now and the collector's thresholds."""
        return {
            "collections": list(self.collections),
            "seconds": [round(s, 4) for s in self.seconds],
            "longest_ms": [round(1e3 * s, 3) for s in self.longest],
            "recent_full": [
                {"at": round(at, 3), "ms": round(1e3 * spent, 3), "frozen_objects": frozen}
                for at, spent, frozen in self.recent_full
            ],
            "frozen_objects": gc.get_freeze_count(),
            "thresholds": list(gc.get_threshold()),
        }


_CLOCK: GcClock | None = None
_LOCK = threading.Lock()


def gc_clock() -> GcClock:
    """The process's clock, installed in ``gc.callbacks`` on first use (once per process: every
    engine of a process shares the one collector)."""
    global _CLOCK
    with _LOCK:
        if _CLOCK is None:
            _CLOCK = GcClock()
            gc.callbacks.append(_CLOCK)
        return _CLOCK
