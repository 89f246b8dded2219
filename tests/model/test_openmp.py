"""The OpenMP team hand-back: a thread that ran torch's parallel regions gives its workers back."""

import os
import threading

import pytest
import torch

from toolspec_core.model import openmp


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


needs_gomp = pytest.mark.skipif(
    not os.path.exists("/proc/self/task") or openmp._runtime() is None, reason="GNU OpenMP on Linux only"
)


@needs_gomp
def test_a_thread_that_ran_a_parallel_region_hands_its_team_back():
    """A fresh thread's first parallel region makes a team of its own (the process gains worker
    threads); release_team on that thread ends them, and the next region makes a new one."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    x = torch.randn(512, 512)  # [512, 512]: large enough for torch to split the product
    seen = {}

    def body():
        start = _threads()
        (x @ x).sum()
        seen["with_team"] = _threads() - start
        seen["released"] = openmp.release_team()
        seen["after"] = _threads() - start
        (x @ x).sum()
        seen["again"] = _threads() - start
        openmp.release_team()

    try:
        t = threading.Thread(target=body)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert seen["with_team"] >= 1
    assert seen["released"] is True
    assert seen["after"] == 0
    assert seen["again"] == seen["with_team"]


def test_release_team_is_false_without_gnu_openmp(monkeypatch):
    monkeypatch.setattr(openmp, "_runtime", lambda: None)
    assert openmp.release_team() is False
