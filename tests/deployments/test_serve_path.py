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
