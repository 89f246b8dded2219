"""The replica's torch threads (deployments/engine_host.py): every usable core for a CPU model
unless ``threads`` says otherwise -- Ray starts actors with OMP_NUM_THREADS=1."""

from __future__ import annotations

import os

from deployments.config import ServeAppConfig
from deployments.engine_host import serving_threads


def test_cpu_replica_uses_every_core_it_may_run_on(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray gives an actor of num_cpus < 2
    cores = len(os.sched_getaffinity(0))
    assert serving_threads(ServeAppConfig(device="cpu")) == cores
    assert serving_threads(ServeAppConfig(device="cpu", threads=1)) == 1
    assert serving_threads(ServeAppConfig(device="cpu", model="scripted")) is None
    assert serving_threads(ServeAppConfig(device="cuda")) is None
