"""Faults through the real Ray Serve app: an engine replica killed in the middle of a stream, an
app restarted over its persisted library. Each test deploys an app of its own, so the shared apps
of the other serve tests are not touched."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from serve_fixtures import TOOLS, client, deploy, wait_until

pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]

MSGS = [{"role": "user", "content": "weather in Quito please"}]


def _actor(ray, fragment: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if fragment in a["name"]:
            return ray.get_actor(a["name"], namespace=a["namespace"])
    return None


def _ok(c, model: str) -> bool:
    try:
        r = c.chat.completions.create(model=model, messages=MSGS, max_tokens=4, temperature=0)
    except Exception:
        return False
    return r.choices[0].finish_reason in ("stop", "length")


def test_an_engine_replica_killed_mid_stream_ends_the_stream_and_is_replaced(serve_port, tiny_model_dir, ray_cluster):
    """The client gets an error event or a closed stream -- not a hang -- and once Serve has started
    a new replica the next request succeeds."""
    url = deploy(
        "faultkill", {"model": tiny_model_dir, "method": "toolspec", "retrieval": {"enabled": False}}, serve_port
    )
    c = client(url, timeout=120)
    assert _ok(c, "faultkill")
    stream = c.chat.completions.create(model="faultkill", messages=MSGS, max_tokens=1500, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)  # the role chunk: the request is in the replica
    replica = _actor(ray_cluster, "faultkill#Replica")
    assert replica is not None
    ray_cluster.kill(replica, no_restart=True)
    t0, failed, finished = time.time(), None, None
    try:
        for ch in chunks:
            finished = next((c.finish_reason for c in ch.choices if c.finish_reason), finished)
    except Exception as exc:  # an in-band error event or a dropped connection
        failed = type(exc).__name__
    assert time.time() - t0 < 90, "the stream hung after its replica died"
    assert failed is not None or finished is None, "the stream ended as if nothing had happened"
    assert wait_until(lambda: _ok(c, "faultkill"), timeout=240, every=2.0)


def test_an_app_restarted_over_its_embedded_library_still_holds_its_calls(serve_port, tiny_model_dir, tmp_path):
    """The embedded (Qdrant edge) library is on disk: after the app is deleted and deployed again,
    its calls are counted and drafted from (a retrieval hit on the same request)."""
    from ray import serve

    from retrieval_service.embedding import query_text

    args = {
        "model": tiny_model_dir,
        "method": "toolspec",
        "retrieval": {"store": {"backend": "edge", "path": str(tmp_path / "library")}, "key": "qwen", "timeout_s": 5.0},
    }
    url = deploy("restart", args, serve_port)
    base = url[: -len("/v1")]
    emb = query_text(MSGS, TOOLS)  # the deployment keys the request text with its encoder
    text = '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Quito"}}\n</tool_call>'
    handle = serve.get_deployment_handle("Retrieval", app_name="restart")
    handle.add.remote("default", "get_current_weather", "", text, [1, 2, 3], {"city": "Quito"}, emb).result()

    def stats():
        r = httpx.get(base + "/v1/toolspec/library/default/stats", timeout=60)
        return r.json()["records"] if r.status_code == 200 else None

    def hits():
        r = client(url).chat.completions.create(
            model="restart", messages=MSGS, tools=TOOLS, max_tokens=4, temperature=0
        )
        return r.model_extra["toolspec"]["retrieval"]

    assert stats() == 1 and hits()["hits"] >= 1
    serve.delete("restart")
    url = deploy("restart", args, serve_port)
    assert wait_until(lambda: stats() == 1, timeout=180, every=2.0)
    after = hits()
    assert after["status"] in ("ok", "cache") and after["hits"] >= 1, json.dumps(after)
