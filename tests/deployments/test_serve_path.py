"""The serving path's shape: which deployments an app runs, what stops with ``toolspec serve``,
limits shared by replicas (the ``Gate``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def deployment_names(app) -> set[str]:
    """Names of every deployment an application composes (the ingress and what it binds)."""
    from ray.serve.deployment import Application

    bound = app._bound_deployment
    out = {bound.name}
    for arg in (*bound.init_args, *bound.init_kwargs.values()):
        if isinstance(arg, Application):
            out |= deployment_names(arg)
    return out


@pytest.mark.parametrize(
    "method, want",
    [("ar", {"Replica", "Gate"}), ("pld", {"Replica", "Gate"}), ("toolspec", {"Replica", "Gate", "Retrieval"})],
)
def test_retrieval_deployment_only_for_methods_that_use_the_library(method, want):
    from deployments.app import build_app

    app = build_app({"model": "scripted", "cost_model": "none", "method": method})
    assert deployment_names(app) == want


def test_a_method_without_the_library_never_searches(tiny_model_dir):
    """Handed a retrieval client anyway, plain greedy's replica drops it: no search, no key."""
    from deployments.config import ServeAppConfig
    from deployments.engine_host import EngineHost

    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"plain greedy touched the library ({name})")

    cfg = ServeAppConfig.model_validate({"model": tiny_model_dir, "method": "ar", "cost_model": "none"})
    host = EngineHost.build(cfg, Boom())
    try:
        assert host.retrieval is None and host.library is None and not host.text_key
    finally:
        host.close()


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@pytest.mark.serve
@pytest.mark.timeout(600)
def test_serve_serves_then_leaves_no_process_after_sigterm(tmp_path):
    """``toolspec serve`` (scripted target, plain greedy): a streamed tool call over HTTP, /health
    says no library; after SIGTERM no process it started (GCS, raylet, workers, Ray's agents) runs."""
    import httpx
    import psutil
    from serve_fixtures import TOOLS, WEATHER_MESSAGES, free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    cmd = [sys.executable, "-m", "deployments.cli", "serve", "--model", "scripted", "--method", "ar"]
    cmd += ["--cost-model", "none", "--port", str(port), "--set", "replica_num_cpus=0"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started = []
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 400
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        body = {"model": "scripted", "messages": WEATHER_MESSAGES, "tools": TOOLS, "max_tokens": 40, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        assert '"name":"get_current_weather"' in text.replace(" ", "") and text.rstrip().endswith("data: [DONE]")
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["engine"]["retrieval"] is None
        started = _descendants(proc.pid)
        assert any("raylet" in " ".join(p.cmdline()) for p in started)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(started, timeout=5)
        assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in started:
            try:
                p.kill()
            except psutil.Error:
                pass


# ---------------------------------------------------------------------------------------- coalescing


@pytest.fixture(scope="module")
def scripted_host():
    from deployments.config import ServeAppConfig
    from deployments.engine_host import EngineHost

    cfg = ServeAppConfig.model_validate({"model": "scripted", "method": "ar", "cost_model": "none"})
    host = EngineHost.build(cfg)
    yield host
    host.close()


def _request(max_tokens: int):
    from serve_fixtures import TOOLS, WEATHER_MESSAGES, chat_request

    return chat_request(WEATHER_MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=max_tokens)


def test_a_slow_reader_gets_coalesced_events_and_the_engine_never_waits(scripted_host):
    """The reader takes the first delta, then sleeps: the engine finishes the sequence meanwhile
    (one token a step), and the next read holds every step since in one event; the deltas are the
    final text, byte for byte."""
    import asyncio

    async def go():
        events = scripted_host.stream(_request(400))
        got = [await events.__anext__()]  # start
        got.append(await events.__anext__())  # the first text
        steps0 = scripted_host.engine.load()["steps"]
        await asyncio.sleep(1.5)
        steps1 = scripted_host.engine.load()["steps"]
        async for ev in events:
            got.append(ev)
        return got, steps0, steps1, scripted_host.engine.load()["steps"]

    got, steps0, steps1, steps2 = asyncio.run(go())
    from deployments.events import Done, Text

    texts = [e for e in got if isinstance(e, Text)]
    done = got[-1]
    assert isinstance(done, Done) and done.completion_tokens == 400
    assert "".join(e.delta for e in texts) == done.text
    assert steps2 == steps1  # the engine finished while nobody read: no step was left for after
    assert len(texts) <= 3  # the first delta, then everything since in one (and a final tail)


def test_one_step_of_five_tokens_is_one_event(scripted_host):
    """``scripted_tokens_per_step`` 5: each step commits five tokens and streams them as one delta."""
    import asyncio

    from deployments.scripted import ScriptedMethod

    method = scripted_host.method
    scripted_host.method = ScriptedMethod(scripted_host.target.script, 5)
    try:

        async def go():
            return [ev async for ev in scripted_host.stream(_request(60))]

        got = asyncio.run(go())
    finally:
        scripted_host.method = method
    from deployments.events import Text

    done = got[-1]
    assert done.completion_tokens == 60 and done.stats["forwards"] <= 13
    texts = [e.delta for e in got if isinstance(e, Text)]
    assert "".join(texts) == done.text and len(texts) <= 13


@pytest.mark.parametrize("seed", range(6))
def test_coalesced_deltas_keep_every_byte_and_the_name_first(seed, scripted_host):
    """Whatever deltas the engine's steps group the text into (one token to many), the chunks
    reassemble to the final text's content and call, and the call's first chunk is its name."""
    import random

    from deployments.events import Done
    from deployments.scripted import SCRIPT
    from deployments.streaming import StreamShaper

    rng = random.Random(seed)
    text = "Let me check. " + SCRIPT + SCRIPT
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    shaper = StreamShaper("m", True)
    chunks = [ch for part in parts for ch in shaper.feed(part)]
    chunks += list(shaper.finish(Done(text, "stop")))
    content, calls = "", {}
    for ch in chunks:
        delta = ch["choices"][0]["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            if tc["index"] not in calls:
                assert tc["function"]["name"] and tc["function"]["arguments"] == ""  # the name comes first
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert "name" not in tc["function"]
                calls[tc["index"]][1] += tc["function"]["arguments"]
    assert not shaper.mismatch
    assert content == "Let me check."
    want = '{"city": "Paris", "unit": "celsius"}'
    assert [tuple(c) for c in calls.values()] == [("get_current_weather", want)] * 2


# ---------------------------------------------------------------------------------------- shared method state


def test_the_method_shared_state_holds_under_threads(scripted_host):
    """Worker threads build drafters and observe outputs (tool sets and tenants past the caches'
    bounds, so entries are evicted all the time) while another thread drafts: nothing raises,
    the caches stay bounded, and every observed call is counted."""
    import sys
    import threading

    from deployments.scripted import SCRIPT
    from toolspec_core.drafters.methods import RequestInfo, make_method
    from toolspec_core.spec.proposer import DraftContext

    tok = scripted_host.target.tokenizer
    method = make_method("toolspec", tok)
    method.MAX_TENANTS = 3
    prompt = tok.encode("hello")
    out_ids = tok.encode(SCRIPT)

    def tools(i: int) -> list[dict]:
        return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}]

    method.tool_sets.max_bytes = 3 * method.tool_sets.get(tools(0), None, tok).nbytes

    errors, per_thread, threads_n = [], 600, 6

    def worker(w: int) -> None:
        try:
            for i in range(per_thread):
                info = RequestInfo(prompt, tools((w + i) % 7), f"t{(w * i) % 5}")
                if i % 10 == 0:
                    d = method.drafter(info)
                    d.propose(DraftContext(prompt + out_ids[: i % 9], len(prompt), 8))
                else:
                    method.rates_for(info.tenant)
                    method._tools(info.tools)
                method.observe(info, out_ids, SCRIPT)
        except Exception as exc:  # noqa: BLE001 -- any error is the test's failure
            errors.append(repr(exc))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    assert method.tool_sets.nbytes <= method.tool_sets.max_bytes and len(method._tenant_rates) <= 3
    assert method.priors.tool_counts["get_current_weather"] == threads_n * per_thread
    assert method.priors.events.tries["call_start"] == threads_n * per_thread


# ---------------------------------------------------------------------------------------- limits across replicas


@pytest.mark.serve
@pytest.mark.timeout(900)
def test_per_key_limits_hold_across_two_replicas(serve_port, tmp_path):
    """Two engine replicas, each serving HTTP: a key's requests_per_minute is one count in the
    app's Gate, so exactly that many of its requests pass whichever replica takes them (an
    unlimited key's requests show both replicas serving); /metrics counts the whole app's."""
    import json

    import httpx
    from ray import serve
    from serve_fixtures import deploy, wait_until

    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps([{"key": "lim", "tenant": "a", "requests_per_minute": 5}, {"key": "free", "tenant": "b"}])
    )
    url = deploy(
        "pair2",
        {"model": "scripted", "method": "ar", "cost_model": "none", "num_replicas": 2, "api_keys_file": str(keys)},
        serve_port,
    )
    body = {"model": "pair2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def ask(key: str) -> httpx.Response:
        return httpx.post(url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    try:
        assert wait_until(lambda: ask("free").status_code == 200, timeout=600, every=3)
        replicas = {ask("free").json()["toolspec"]["replica"] for _ in range(24)}
        assert len(replicas) == 2, replicas  # Serve spreads requests over both replicas
        codes = [ask("lim").status_code for _ in range(12)]
        assert codes.count(200) == 5 and codes.count(429) == 7, codes

        def ok_requests() -> float:
            text = httpx.get(url[: -len("/v1")] + "/metrics", timeout=30).text
            ok = [ln for ln in text.splitlines() if ln.startswith('toolspec_requests_total{status="ok"')]
            return sum(float(ln.split()[-1]) for ln in ok)

        # readiness + 24 + 5 requests, served by both replicas, in one count
        assert wait_until(lambda: ok_requests() >= 30, timeout=30), ok_requests()
    finally:
        serve.delete("pair2")


def test_a_local_ray_instance_runs_serve_on_its_event_loops(monkeypatch):
    """``start_ray`` hands a local instance's processes SERVE_ENV (the handler on the replica's main
    event loop, the router on the proxy's, batched access logs), where the environment does not
    already say otherwise; a remote cluster's environment is its own."""
    import ray

    from deployments import cli

    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda address, **kw: seen.append((address, dict(os.environ))))
    for key in cli.SERVE_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE", "1")  # said otherwise: kept
    cli.start_ray(quiet=True)
    address, env = seen[-1]
    assert address == "local"
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert env["RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"] == "1"
    for key in cli.SERVE_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "ray://elsewhere:10001")
    cli.start_ray(quiet=True)
    assert seen[-1][0] == "ray://elsewhere:10001" and "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" not in seen[-1][1]
