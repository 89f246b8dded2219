"""The app on a local multi-node Ray cluster started from the cpu-cluster overlay's node groups
(deployments/topology.py): the head, two cpu-replicas nodes (resource ``replica``), one retrieval
node (resource ``retrieval``). The app is the overlay's own args with the scripted target (each
step ``scripted_step_s``, so requests stay in flight), a lexical key and an embedded (Qdrant edge)
library on disk. The tests run in order on one cluster: placement, autoscaling with a shared
library, the library across a Retrieval restart, a node lost under load, load clients on every node.
Every wait is on state, with a bound."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from serve_fixtures import TOOLS, free_port, wait_until

pytestmark = [pytest.mark.serve, pytest.mark.cluster, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
APP = "mn"
# Serve's replicas and handles report queue lengths every 0.5 s (default 10 s): scaling a
# short test's load up and down
ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_USAGE_STATS_ENABLED": "0",
}
MSGS = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
# The scripted target writes its 28-token call over and over, from wherever the prompt's length
# puts it in the script: 55 tokens hold exactly one whole call, whatever the start.
CALL_TOKENS = 55
DRAIN_TOKENS = 6000  # a request (~9 s) in flight while Serve removes its replica (graceful shutdown: 20 s)
DRAIN_STAGGER_S = 3.0


def _rayservice():
    sys.path.insert(0, str(ROOT / "k8s"))
    import k8s_render

    docs = k8s_render.render(ROOT / "k8s" / "overlays" / "cpu-cluster")
    return next(d for d in docs if d["kind"] == "RayService")


def _overrides(library: Path) -> dict:
    """The overlay's args, less what needs the cluster's pods (Qdrant, the API key, the encoder)."""
    return {
        "model": "scripted",
        "method": "toolspec",
        "cost_model": "none",
        "served_model_name": APP,
        "scripted_step_s": 0.02,
        "max_tokens_default": CALL_TOKENS,
        "max_tokens_limit": DRAIN_TOKENS,
        "max_ongoing_requests": 8,
        "qdrant_url": None,
        "qdrant_api_key_env": None,
        "api_key_env": None,
        "autoscaling": {
            "target_ongoing_requests": 2,
            "upscale_delay_s": 0,
            "downscale_delay_s": 2,
            "look_back_period_s": 1,
        },
        "retrieval": {"key": "lexical", "store": {"backend": "edge", "path": str(library)}, "timeout_s": 5.0},
    }


@pytest.fixture(scope="module")
def mn(tmp_path_factory):
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.config import ServeAppConfig
    from deployments.topology import LocalCluster, node_groups, rayservice_args

    assert not ray.is_initialized(), "the cluster tests run first (tests/conftest.py orders them)"
    rs = _rayservice()
    groups = node_groups(rs)
    cfg = ServeAppConfig.model_validate(rayservice_args(rs, _overrides(tmp_path_factory.mktemp("library"))))
    lc = LocalCluster(groups, env={**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    try:
        lc.connect()
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}", blocking=False)
        base = f"http://127.0.0.1:{port}/{APP}/v1"
        wait_until(lambda: _running(APP) >= 1 and _status(base) == 200, timeout=240, every=1.0)
        yield SimpleNamespace(lc=lc, groups=groups, cfg=cfg, base=base, chat=base + "/chat/completions", port=port)
    finally:
        lc.shutdown()


def _status(base: str) -> int | None:
    try:
        return httpx.get(base + "/models", timeout=10).status_code
    except httpx.HTTPError:
        return None


def _running(app: str, deployment: str = "Replica") -> int:
    from benchmarks.loadtest.cluster import running_replicas

    return running_replicas(app, deployment)


def _library():
    from ray import serve

    return serve.get_deployment_handle("Retrieval", app_name=APP)


def _load(prefix: str, max_tokens: int = CALL_TOKENS):
    """Load requests: each its own library tenant (user ``<prefix><i>``), a stream every other
    one, one call long unless ``max_tokens`` says otherwise."""

    def body(i: int) -> dict:
        return {
            "model": APP,
            "messages": MSGS,
            "tools": TOOLS,
            "max_tokens": max_tokens,
            "stream": i % 2 == 1,
            **({"stream_options": {"include_usage": True}} if i % 2 else {}),
            "user": f"{prefix}{i}",
        }

    return body


def _ask(chat: str, user: str) -> dict:
    r = httpx.post(chat, json={"model": APP, "messages": MSGS, "tools": TOOLS, "user": user}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["toolspec"]


def _process_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_1_each_deployment_lands_on_the_node_group_the_overlay_gives_it(mn):
    """Where Serve put each actor (the GCS's actor table) is where topology.placement, reading
    the rendered manifests, says it may go; Serve's controller and its one proxy on the head."""
    from deployments.topology import placement

    where = placement(mn.cfg, mn.groups)
    assert where["Replica"] == ["cpu-replicas"] and where["Retrieval"] == ["retrieval"]
    actors = mn.lc.serve_actors(APP)
    assert {a["group"] for a in actors["Retrieval"]} == {"retrieval"}
    assert len(actors["Replica"]) == 1 and actors["Replica"][0]["group"] == "cpu-replicas"
    assert actors["Gate"][0]["group"] in where["Gate"]
    assert {a["group"] for a in mn.lc.actors("SERVE_CONTROLLER_ACTOR")} == {"head"}
    assert {a["group"] for a in mn.lc.actors("SERVE_PROXY_ACTOR")} == {"head"}
    # the overlay's failover ingress: on the head, beside the proxy, never lost with a replica
    assert mn.cfg.ingress == "failover" and where["Ingress"] == ["head"]
    assert [a["group"] for a in actors["Ingress"]] == ["head"]
    # the Ingress relays, the replica's app validates: its OpenAI errors come through as they are
    r = httpx.post(mn.chat, json={"model": APP, "messages": "nope"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    big = b'{"model": "mn", "pad": "' + b"a" * mn.cfg.limits.body_bytes + b'"}'
    chunked = httpx.post(mn.chat, content=iter([big[:1024], big[1024:]]), timeout=60)  # no content-length
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large", chunked.text


def test_1b_a_client_that_leaves_is_cancelled_through_the_ingress(mn):
    """A stream the client leaves after a few chunks: Serve cancels the Ingress's request, the
    cancellation reaches the replica through the handle, and the engine drops the sequence (its
    batch empty, its KV blocks back) long before the request's 6,000 tokens would have ended."""
    body = {"model": APP, "messages": MSGS, "max_tokens": DRAIN_TOKENS, "stream": True}
    health = mn.base[: -len("/v1")] + "/health"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", mn.chat, json=body) as r:
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n >= 6:
                    break  # leave mid-stream

        def drained():
            engine = http.get(health).json()["engine"]["engine"]
            return engine["running"] == 0 and engine["waiting"] == 0 and engine["kv_pool"]["used_blocks"] == 0

        wait_until(drained, timeout=30, every=0.5)  # the request itself would run ~120 s


def test_2_under_load_serve_adds_a_replica_on_the_other_node_they_share_the_library_and_it_drains(mn):
    """Queue length over target: Serve starts the second replica (max_replicas 2) on the other
    cpu-replicas node. A call written through one replica is retrieved as a draft on the other.
    Load falls to two clients of long requests (one replica's worth): Serve removes a replica, the
    request in flight on it finishes there (graceful drain); no request fails on the way up or down."""
    from benchmarks.loadtest.cluster import BackgroundLoad, ReplicaSampler, count

    with ReplicaSampler(APP, every_s=0.2) as sampler:
        with BackgroundLoad(mn.chat, _load("up"), concurrency=8) as heavy:
            wait_until(lambda: _running(APP) == 2, timeout=120, every=0.5)
            replicas = mn.lc.serve_actors(APP)["Replica"]
            assert len({a["node_id"] for a in replicas}) == 2 and {a["group"] for a in replicas} == {"cpu-replicas"}
            home = _ask(mn.chat, "acme")["replica"]
            wait_until(lambda: _library().tenant_stats.remote("default/acme").result()["records"] >= 1, timeout=30)
            other = None
            for _ in range(40):  # Serve routes to either replica: ask until the other one answers
                info = _ask(mn.chat, "acme")
                if info["replica"] != home:
                    other = info
                    break
            assert other is not None, "every request went to one replica"
            assert other["retrieval"]["status"] in ("ok", "cache") and other["retrieval"]["hits"] >= 1, other
        before = {a["pid"] for a in mn.lc.serve_actors(APP)["Replica"]}
        # two clients of long requests, the second half a request later (so Serve's router, which
        # sends a request to the less busy replica, gives each replica one): one replica's worth
        # of queue, and a request in flight on the replica Serve removes
        drain = _load("down", max_tokens=DRAIN_TOKENS)
        with BackgroundLoad(mn.chat, drain, concurrency=2, stagger_s=DRAIN_STAGGER_S) as light:
            wait_until(lambda: _running(APP) == 1, timeout=120, every=0.2)
            down_at = time.time()
            wait_until(lambda: any(r["started"] > down_at for r in light.records), timeout=120, every=0.2)
    counts = [n for _, n in sampler.samples]
    assert max(counts) == 2 and counts[-1] == 1
    for load in (heavy, light):
        assert count(load.records)["failed"] == {}, [r for r in load.records if not r["ok"]][:3]
        assert count(load.records)["completed"] > 0
    # the removed replica's actor ends once its requests have (graceful shutdown)
    wait_until(lambda: len(mn.lc.serve_actors(APP).get("Replica", [])) == 1, timeout=120, every=0.2)
    (removed,) = before - {a["pid"] for a in mn.lc.serve_actors(APP)["Replica"]}
    drained = [
        r
        for r in light.records
        if r["ok"] and r["replica"].endswith(f":{removed}") and r["started"] + r["e2e_ms"] / 1e3 > down_at
    ]
    spans = [
        (r["replica"], round(r["started"] - down_at, 1), round(r["e2e_ms"] / 1e3, 1)) for r in light.records if r["ok"]
    ]
    assert drained, (
        f"no request was in flight on the replica Serve removed (pid {removed}); (replica, start - down, s): {spans}"
    )


def test_3_the_library_survives_its_retrieval_replica_restart(mn):
    """The edge store is on disk, its writes in Qdrant's write-ahead log: a Retrieval actor
    killed and brought back by Serve (on the retrieval node again) still holds every call."""
    import ray

    lib = _library()
    text = '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    lib.add.remote("keep", "get_current_weather", "", text, [1, 2, 3], {"city": "Oslo"}, "weather in Oslo").result()
    before = lib.stats.remote().result()["records"]
    assert lib.tenant_stats.remote("keep").result()["records"] == 1
    (old,) = mn.lc.serve_actors(APP)["Retrieval"]
    ray.kill(ray.get_actor(old["name"], namespace="serve"), no_restart=True)

    def back():
        now = mn.lc.serve_actors(APP).get("Retrieval", [])
        if len(now) != 1 or now[0]["name"] == old["name"] or _running(APP, "Retrieval") != 1:
            return None
        try:
            return now[0], _library().stats.remote().result(timeout_s=10)
        except Exception:
            return None

    new, stats = wait_until(back, timeout=120, every=0.5)
    assert new["group"] == "retrieval"
    assert stats["records"] == before
    assert _library().tenant_stats.remote("keep").result()["records"] == 1
    hits = _library().search.remote("keep", "weather in Oslo", ["get_current_weather"], 5).result()
    assert hits and hits[0]["arguments"] == {"city": "Oslo"}


def test_4_a_node_lost_under_load_costs_only_its_requests(mn):
    """Under load with both replicas up, one cpu-replicas node is killed (its raylet and every
    process on it) and a fresh node of the group joins, as KubeRay replaces a lost pod. The
    overlay's failover ingress answers for the lost replica's requests: one sent to it after it
    died (before its receipt) goes again to the other replica and completes; one it had received
    but not begun to answer gets 503 with Retry-After and code ``replica_lost`` (never run twice);
    a stream already started ends with an error event of that code, then ``[DONE]``. No 500, no cut stream, none hangs, none sent after the kill fails; the rest
    complete; Serve starts the replacement replica on the new node; every call acknowledged by
    a replica on a surviving node is in the library, and no request ran twice."""
    from benchmarks.loadtest.cluster import BackgroundLoad, count

    lib = _library()
    rewrites0, records0 = (lambda s: (s["rewrites"], s["records"]))(lib.stats.remote().result())
    with BackgroundLoad(mn.chat, _load("kill"), concurrency=8) as load:
        wait_until(lambda: _running(APP) == 2 and len(load.records) >= 8, timeout=120, every=0.5)
        replicas = mn.lc.serve_actors(APP)["Replica"]
        victim = replicas[0]
        survivors = {f":{a['pid']}" for a in replicas[1:]}
        mn.lc.remove_node(mn.lc.node(victim["node_id"]))
        # The raylet dies at once; the replica's worker process exits when it sees that, a moment
        # later, and may take a request in between (it then answers replica_lost, as it should).
        # "After the kill" is therefore the moment its process is gone.
        wait_until(lambda: not _process_alive(victim["pid"]), timeout=30, every=0.02)
        killed_at = time.time()
        fresh = mn.lc.add_node("cpu-replicas")

        def replaced():
            now = mn.lc.serve_actors(APP).get("Replica", [])
            return _running(APP) == 2 and any(a["node_id"] == fresh.node_id for a in now)

        wait_until(replaced, timeout=180, every=0.5)
        new_pid = next(a["pid"] for a in mn.lc.serve_actors(APP)["Replica"] if a["node_id"] == fresh.node_id)
        wait_until(lambda: any(r["ok"] and r["replica"].endswith(f":{new_pid}") for r in load.records), timeout=60)
    records = load.records
    tally = count(records)
    failed = [r for r in records if not r["ok"]]
    print("node loss:", json.dumps(tally))
    assert tally["completed"] > 0 and tally["sent"] == tally["completed"] + len(failed)
    assert set(tally["failed"]) <= {"http_503", "stream_replica_lost"}, tally
    for r in failed:
        # only requests in flight on the lost replica when its process went
        assert r["started"] <= killed_at, r
        if r["status"] == 503:
            assert int(r["retry_after"]) >= 0 and json.loads(r["detail"])["error"]["code"] == "replica_lost", r
        else:
            assert r["stream"] and (r["detail"]["type"], r["detail"]["code"]) == ("server_error", "replica_lost"), r
    assert all(r["e2e_ms"] < 30_000 for r in records)  # nothing hung
    # every call a surviving replica acknowledged is in the library, each stored once
    kept = [r for r in records if r["ok"] and any(r["replica"].endswith(p) for p in survivors)]
    assert kept

    def held() -> dict[int, int]:  # each acknowledged call's records in the library
        return {r["index"]: lib.tenant_stats.remote(f"default/kill{r['index']}").result()["records"] for r in kept}

    try:  # a replica's write waits or goes again for up to retrieval.add_deadline_s (120 s)
        wait_until(lambda: set(held().values()) == {1}, timeout=150, every=1.0)
    except TimeoutError:  # say which calls are missing (0) or stored twice (2+), and what the library saw
        odd = {i: n for i, n in held().items() if n != 1}
        msg = f"{len(odd)} of {len(kept)} acknowledged calls not stored exactly once: {odd}"
        pytest.fail(f"{msg}; library stats {lib.stats.remote().result()}")
    stats = lib.stats.remote().result()
    assert stats["records"] - records0 <= tally["sent"]
    # each request is its own tenant, so a call written again on a first try means a request ran
    # twice (a client's resend of a write that had landed counts as resends_held, not here)
    assert stats["rewrites"] - rewrites0 == 0, stats


def test_5_load_clients_on_every_node_add_up(mn, tmp_path):
    """``toolspec loadtest --ray ADDRESS --clients-per-node 1``: one client actor on each of the
    cluster's nodes (0 CPUs each: the replicas hold the workers' CPUs), each record names its
    client's node, the per-node rows add up to the level; Serve's replica count sampled beside."""
    import ray

    from benchmarks.loadtest import main

    data = tmp_path / "calls.jsonl"
    rows = [{"id": f"q{i}", "benchmark": "mini", "tools": TOOLS, "messages": MSGS, "meta": {}} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "lt"
    args = ["--dataset", str(data), "--out", str(out), "--endpoint", f"{APP}={mn.base}", "--concurrency", "4"]
    args += ["--requests-per-level", "8", "--max-tokens", str(CALL_TOKENS), "--stream", "--quiet"]
    args += ["--ray", mn.lc.address, "--clients-per-node", "1", "--ray-actor-cpus", "0", "--serve-app", APP]
    assert main(args) == 0
    report = json.loads(next(out.glob("*.json")).read_text())
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {c["node"] for c in report["clients"]} == alive and len(report["clients"]) == len(alive) == 4
    (lv,) = report["levels"]
    assert lv["requests"] == 8 == lv["ok"]
    assert set(lv["per_node"]) == set(lv["nodes"]) <= alive
    assert sum(row["requests"] for row in lv["per_node"].values()) == lv["requests"]
    assert sum(row["completion_tokens"] for row in lv["per_node"].values()) == lv["completion_tokens"]
    assert lv["over_time"] and all((row["replicas"] or 0) >= 1 for row in lv["over_time"][1:])
    assert list(out.glob("*.replicas.png"))


def test_6_toolspec_serve_attaches_to_the_running_cluster_and_leaves_it_running(mn, tmp_path):
    """``toolspec serve --address HOST:PORT`` starts no Ray of its own: its app's replica runs
    on one of the cluster's nodes, behind the cluster's proxy; SIGTERM takes the app off the
    cluster and leaves the cluster, Serve and the other app up."""
    import signal
    import subprocess

    import ray

    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled")
    cmd = [sys.executable, "-m", "deployments.cli", "serve", "--address", mn.lc.address, "--model", "scripted"]
    cmd += ["--method", "ar", "--cost-model", "none", "--no-retrieval", "--port", str(mn.port)]
    cmd += ["--set", "replica_num_cpus=0", "--set", "served_model_name=attached"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{mn.port}/v1"

        def up():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            return _status(url) == 200 and _running("toolspec") == 1

        wait_until(up, timeout=240, every=1.0)
        (replica,) = mn.lc.serve_actors("toolspec")["Replica"]
        assert replica["group"] is not None  # a node of the cluster, none started for it
        assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == nodes
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        wait_until(lambda: not mn.lc.serve_actors("toolspec"), timeout=60)
        assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == nodes
        assert _status(mn.base) == 200 and _running(APP) >= 1
    finally:
        if proc.poll() is None:
            proc.kill()
