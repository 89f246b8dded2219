"""The replica's torch threads (deployments/engine_host.py): every usable core for a CPU model
unless ``threads`` says otherwise -- Ray starts actors with OMP_NUM_THREADS=1. The KV pool's
size: on the CPU ``kv_cpu_gib``, bounded by the memory left and by one context window."""

from __future__ import annotations

import os

from deployments import engine_host
from deployments.config import ServeAppConfig
from deployments.engine_host import cpu_pool_tokens, kv_pool_tokens, serving_threads


def scripted_host(**cfg):
    """An EngineHost over the scripted target (plain greedy, no retrieval unless ``cfg`` says)."""
    from deployments.engine_host import EngineHost

    return EngineHost.build(
        ServeAppConfig(
            **{"model": "scripted", "method": "ar", "cost_model": "none", "retrieval": {"enabled": False}, **cfg}
        )
    )


def record_submits(host) -> list:
    """The sequences ``host`` hands its engine, in order (the engine still runs them)."""
    submit, queued = host.engine.submit, []

    def recording_submit(seq, loop=None):
        queued.append(seq)
        return submit(seq, loop)

    host.engine.submit = recording_submit
    return queued


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

    from deployments.events import Done
    from deployments.protocol import parse_request

    host = scripted_host()
    queued = record_submits(host)
    try:
        body = {"model": host.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        asked = {**body, "toolspec": {"timeline": True}}  # first: its whole prompt is prefilled
        done = asyncio.run(host.generate(parse_request(asked, host.name, 4096)))
        plain = asyncio.run(host.generate(parse_request(body, host.name, 4096)))
    finally:
        host.close()
    assert "timeline" not in plain.extra and "early_steps" not in plain.extra  # only when asked
    assert len(queued[0].stats.early_steps) > 0 and queued[1].stats.early_steps is None  # nor kept unasked
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


def test_cpu_pool_is_sized_by_memory_not_by_one_context_window():
    per_token = 24576  # the embedded 0.5B model in float32: 2 x 24 layers x 2 KV heads x 64 x 4 bytes
    gib = 2**30
    assert cpu_pool_tokens(4.0, per_token, None, 32768) == 4 * gib // per_token  # ~175k tokens
    assert cpu_pool_tokens(4.0, per_token, 2 * gib, 32768) == gib // per_token  # half of what is left
    assert cpu_pool_tokens(4.0, per_token, 64 * 2**20, 32768) == 32768  # never below one context window
    assert cpu_pool_tokens(4.0, 8, None, 64) == engine_host.CPU_POOL_MAX_TOKENS  # a toy model's KV


def test_replica_pool_follows_the_config_on_the_cpu(monkeypatch):
    """The default pool of a CPU replica is ``kv_cpu_gib`` of the target's own KV bytes a token;
    ``kv_pool_tokens`` overrides it."""
    from deployments.scripted import scripted_target
    from toolspec_core.model.block_pool import kv_bytes_per_token

    target = scripted_target(context=256)
    per_token = kv_bytes_per_token(target.model.config, target.dtype)
    monkeypatch.setattr(engine_host, "available_memory", lambda: 1 << 40)
    cfg = ServeAppConfig(device="cpu", kv_cpu_gib=0.001)
    assert kv_pool_tokens(cfg, target, 32) == max(int(0.001 * 2**30) // per_token, 256 + 32)
    monkeypatch.setattr(engine_host, "available_memory", lambda: 0)  # no memory left: one context + tree
    assert kv_pool_tokens(cfg, target, 32) == 256 + 32
    assert kv_pool_tokens(ServeAppConfig(device="cpu", kv_pool_tokens=4096), target, 32) == 4096


def test_available_memory_reads_this_machine():
    left = engine_host.available_memory()
    assert left is None or 0 < left < 2**50


def test_a_client_that_leaves_while_its_request_is_prepared_is_counted_once():
    """The client goes away while a worker still builds its job (built and queued in one worker
    call): the sequence queued after it is cancelled and the host counts the request as
    cancelled, once."""
    import asyncio
    import threading
    import time

    from serve_fixtures import chat_request

    host = scripted_host()
    entered, release = threading.Event(), threading.Event()
    job, queued = host.job, record_submits(host)

    def slow_job(req, *caller):
        entered.set()
        release.wait(30)
        return job(req, *caller)

    host.job = slow_job
    req = chat_request([{"role": "user", "content": "hi"}], max_tokens=1000, temperature=0.0)

    async def leave_while_prepared():
        async def consume():
            async for _ in host.stream(req):
                pass

        task = asyncio.ensure_future(consume())
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(leave_while_prepared())
        release.set()
        deadline = time.time() + 30
        while not (queued and queued[0].cancelled) and time.time() < deadline:
            time.sleep(0.01)
        assert queued and queued[0].cancelled  # the sequence queued after the client left ends
        assert host.stats.cancelled == 1
    finally:
        release.set()
        host.close()


class RecordingRetrieval:
    """A Retrieval client stand-in that records every search and finds nothing."""

    loop = None  # the library files no calls without one

    def __init__(self):
        self.searches: list[list[str]] = []

    async def search(self, tenant, embedding, tool_names):
        self.searches.append(list(tool_names))
        return [], {"status": "ok"}


def test_every_request_takes_the_one_call_way_in_and_only_one_with_tools_searches():
    """Under a method that drafts from the library, every request's job is built, its drafter
    built and its sequence queued in one worker call; a request that offers no tools the model
    may call (none, or ``tool_choice`` "none") searches nothing, one that offers tools searches
    the library once."""
    import asyncio

    from serve_fixtures import chat_request

    from deployments.engine_host import EngineHost
    from deployments.events import Done

    retrieval = RecordingRetrieval()
    host = EngineHost.build(
        ServeAppConfig(model="scripted", method="toolspec", cost_model="none", retrieval={"key": "lexical"}),
        retrieval,
    )
    assert host.retrieval is retrieval
    launch, started = host._launch, []

    def recording_launch(req, *rest):
        started.append(req)
        return launch(req, *rest)

    host._launch = recording_launch
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    hi = [{"role": "user", "content": "hi"}]
    plain = chat_request(hi, max_tokens=4, temperature=0.0)
    quiet = chat_request(hi, tools=[tool], tool_choice="none", max_tokens=4, temperature=0.0)
    calls = chat_request(hi, tools=[tool], tool_choice="auto", max_tokens=4, temperature=0.0)
    try:
        for req in (plain, quiet):
            done = asyncio.run(host.generate(req))
            assert isinstance(done, Done) and done.completion_tokens > 0
            assert done.extra["retrieval"] == {"status": "disabled"}
        assert started == [plain, quiet] and retrieval.searches == []
        done = asyncio.run(host.generate(calls))
        assert isinstance(done, Done) and done.completion_tokens > 0
        assert started == [plain, quiet, calls] and retrieval.searches == [["get_weather"]]
    finally:
        host.close()


def test_the_text_held_back_for_a_stop_string_comes_in_the_last_event():
    """A stop string that never appears holds the output's last characters back while it streams:
    they come in the last ``Text`` event, so the deltas spell the final text, timeline or not."""
    import asyncio

    from serve_fixtures import chat_request

    from deployments.events import Done, Text

    host = scripted_host()
    req = chat_request(
        [{"role": "user", "content": "hi"}], max_tokens=12, temperature=0.0, stop=["\x00never\x00 in it"]
    )

    async def events(timeline):
        return [ev async for ev in host.stream(req, timeline=timeline)]

    try:
        for timeline in (False, True):
            evs = asyncio.run(events(timeline))
            assert isinstance(evs[-1], Done) and len(evs[-1].text) > 0
            assert "".join(e.delta for e in evs if isinstance(e, Text)) == evs[-1].text, timeline
    finally:
        host.close()


def test_build_hands_back_the_building_threads_openmp_team(monkeypatch):
    """The thread that loads and warms the model gives its OpenMP workers back before the engine
    thread steps it (toolspec_core/model/openmp.py says why: two teams on two cores made a decode
    step ~25% slower), after everything that runs the model on the building thread."""
    import threading

    from toolspec_core.model import openmp

    calls = []
    monkeypatch.setattr(openmp, "release_team", lambda: calls.append(threading.current_thread()) or True)
    warm = engine_host.warm_replica_graphs
    monkeypatch.setattr(engine_host, "warm_replica_graphs", lambda *a: calls.append("warm") or warm(*a))
    host = scripted_host()
    try:
        assert calls == ["warm", threading.current_thread()]
    finally:
        host.close()


def test_health_info_names_the_draft_budgets_cost_curve():
    """/health says which cost curve prices the drafts (a start-up probe's differs run to run)."""
    host = scripted_host(cost_model="reference")
    try:
        cost = host.info()["cost_model"]
        assert cost["source"] == "reference" and cost["points"]["1"] == 1.0 and cost["points"]["64"] == 6.6
    finally:
        host.close()
    host = scripted_host()
    try:
        assert host.info()["cost_model"] is None  # cost_model: none, no budget
    finally:
        host.close()
