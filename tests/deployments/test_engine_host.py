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


def test_done_carries_where_the_first_token_waited():
    """Asked for (``toolspec.timeline``), the replica's Done event says where a request's time went before its first token
    (``timeline``: wall-clock marks in the order the request passed them) and what its first
    steps carried (``early_steps``), for load studies (benchmarks.studies.ttft_breakdown)."""
    import asyncio

    from deployments.engine_host import EngineHost
    from deployments.events import Done
    from deployments.protocol import engine_request, parse_request

    host = EngineHost.build(
        ServeAppConfig(model="scripted", method="ar", cost_model="none", retrieval={"enabled": False})
    )
    try:
        body = {"model": host.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        asked = {**body, "toolspec": {"timeline": True}}  # first: its whole prompt is prefilled
        done = asyncio.run(host.generate(engine_request(parse_request(asked, host.name, 4096))))
        plain = asyncio.run(host.generate(engine_request(parse_request(body, host.name, 4096))))
    finally:
        host.close()
    assert "timeline" not in plain.extra and "early_steps" not in plain.extra  # only when asked
    assert isinstance(done, Done) and done.completion_tokens > 0
    t = done.extra["timeline"]
    order = ["replica_in", "prepared", "searched", "submitted", "queued", "admitted", "prefill_start"]
    order += ["first_token", "first_text"]
    assert [t[k] for k in order] == sorted(t[k] for k in order)
    steps = done.extra["early_steps"]
    assert (
        steps[0]["kind"] == "prefill"
        and sum(s["own_rows"] for s in steps if s["kind"] == "prefill") == done.prompt_tokens
    )
    assert "times" not in done.stats and "early_steps" not in done.stats
