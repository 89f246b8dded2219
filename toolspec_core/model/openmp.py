"""OpenMP thread teams of this process: one for the thread that steps the model.

GNU OpenMP (the runtime torch's CPU wheels load) gives every thread that starts a parallel region
a team of its own worker threads, kept until that thread exits. Its workers wait for the next
region by spinning, but only while the runtime manages no more threads than the process has cores;
past that they sleep after ~100 spins, and every parallel region (hundreds a forward) then wakes
them through the kernel. A replica that loads its model on one thread and steps it on another
has two teams: on a 2-core machine one decode step of the embedded model took ~20% longer
(in process, ``benchmarks.studies.openmp_teams``: 98 ms a token on a second thread beside the
loading thread's team, 81 once that team is handed back or on the loading thread alone). So the
thread that loads and warms the model hands its team back (:func:`release_team`) before the
engine thread steps it.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("toolspec.model")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings


@functools.lru_cache(maxsize=1)
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process loaded (torch's libgomp), or None where there is none."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libgomp" in line and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    return None


def release_team() -> bool:
    """Hand back the calling thread's OpenMP worker threads (``omp_pause_resource_all``), so the
    team of the thread that steps the model is the only one and its workers keep spinning between
    parallel regions. False where the runtime is not GNU OpenMP or refused (called inside a
    parallel region). A later parallel region on this thread makes a new team."""
    import torch  # noqa: F401  (loads the runtime this looks for)

    lib = _runtime()
    if lib is None:
        return False
    ok = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not ok:
        log.debug("OpenMP kept this thread's team (omp_pause_resource_all refused)")
    return ok
