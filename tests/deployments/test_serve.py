"""End to end: the real Ray Serve app (one shared cluster), called with the official openai client.

Most tests use the tiny random model (fast); the embedded Qwen2.5-Coder-0.5B is used where a
real tool call is needed. The retrieval-kill test runs last: its library comes back empty.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import socket
import time

import httpx
import pytest
from serve_fixtures import TOOLS, WEATHER_MESSAGES, client, wait_until

from toolspec_core.drafters.toolcall.parse import ToolCall, validate_call

pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]


def calls_of(resp) -> list[tuple[str, dict]]:
    return [(t.function.name, json.loads(t.function.arguments)) for t in resp.choices[0].message.tool_calls or []]


def reassemble(stream) -> dict:
    content, calls, finish, extra = "", {}, None, None
    for ch in stream:
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
        extra = (ch.model_extra or {}).get("toolspec", extra)
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish, "toolspec": extra}


# ---------------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def weather_call(real_app):
    return client(real_app).chat.completions.create(
        model="real", messages=WEATHER_MESSAGES, tools=TOOLS, temperature=0, max_tokens=96
    )


def test_real_tool_call_comes_back_parsed(weather_call):
    choice = weather_call.choices[0]
    assert choice.finish_reason == "tool_calls"
    ((name, args),) = calls_of(weather_call)
    assert name == "get_current_weather" and args["city"] == "Paris"
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"
    stats = weather_call.model_extra["toolspec"]
    assert stats["method"] == "toolspec" and stats["forwards"] > 0 and stats["mat"] >= 1.0
    assert weather_call.usage.prompt_tokens > 100 and weather_call.usage.completion_tokens > 5


def test_streamed_deltas_reassemble_to_the_same_call(real_app, weather_call):
    stream = client(real_app).chat.completions.create(
        model="real", messages=WEATHER_MESSAGES, tools=TOOLS, temperature=0, max_tokens=96, stream=True
    )
    got = reassemble(stream)
    assert got["finish"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == calls_of(weather_call)
    assert [c["arguments"] for c in got["calls"]] == [
        t.function.arguments for t in weather_call.choices[0].message.tool_calls
    ]
    assert got["content"] == (weather_call.choices[0].message.content or "")
    assert got["toolspec"]["mat"] >= 1.0


def test_server_greedy_equals_engine_greedy_real(real_app, weather_call):
    """The served (speculative) output is exactly the target's plain greedy output."""
    from toolspec_core.drafters.toolcall.parse import parse_tool_calls
    from toolspec_core.engine.loop import DecodeConfig, generate
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.model.target import load_target
    from toolspec_core.spec.proposer import NoDrafter

    target = load_target("embedded")
    ids = render_prompt(target.tokenizer, WEATHER_MESSAGES, TOOLS)
    ref = generate(target, ids, NoDrafter(), DecodeConfig(max_new_tokens=96))
    parsed = parse_tool_calls(ref.text)
    assert [(c.name, c.arguments) for c in parsed.calls] == calls_of(weather_call)
    assert weather_call.usage.completion_tokens == len(ref.tokens)


@pytest.mark.parametrize(
    "tool_choice,want",
    [("required", None), ({"type": "function", "function": {"name": "send_email"}}, "send_email")],
    ids=["required", "named"],
)
def test_required_and_named_tool_choice_yield_a_valid_call(real_app, tool_choice, want):
    msgs = [{"role": "user", "content": "Tell Bob (bob@example.com) that the meeting moved to 3pm."}]
    r = client(real_app).chat.completions.create(
        model="real", messages=msgs, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=96
    )
    assert r.choices[0].finish_reason == "tool_calls"
    if importlib.util.find_spec("toolspec_core.engine.grammar") is not None:
        assert r.model_extra["toolspec"]["constrained"] is True
    calls = calls_of(r)
    assert calls, r.choices[0].message.content
    for name, args in calls:
        assert validate_call(ToolCall(name, args), TOOLS) == [], (name, args)
    if want:
        assert calls[0][0] == want


def test_finished_calls_reach_the_shared_library(real_app, weather_call):
    """The replica sends completed calls to the Retrieval deployment without awaiting them."""
    from ray import serve

    lib = serve.get_deployment_handle("Retrieval", app_name="real")
    assert wait_until(lambda: lib.stats.remote().result()["records"] >= 1, timeout=30)

    def settled() -> bool:  # earlier requests' adds (keyed by the deployment's encoder) have all landed
        adds = lib.stats.remote().result()["adds"]
        time.sleep(2.0)
        return lib.stats.remote().result()["adds"] == adds

    assert wait_until(settled, timeout=60)
    before = lib.stats.remote().result()
    client(real_app).chat.completions.create(
        model="real",
        messages=WEATHER_MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=96,
        extra_body={"toolspec": {"remember": False}},
        user="private",
    )
    time.sleep(1.0)
    after = lib.stats.remote().result()
    assert after["records"] == before["records"] and after["adds"] == before["adds"]  # never even sent


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_engine_replicas_share_one_library(serve_port):
    """Two engine replicas, one Retrieval deployment keying request text with its own Qwen encoder:
    a call finished on one replica is retrieved and drafted from on the other; output unchanged."""
    from ray import serve
    from serve_fixtures import deploy

    from toolspec_core.drafters.toolcall.parse import parse_tool_calls
    from toolspec_core.engine.loop import DecodeConfig, generate
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.model.target import load_target
    from toolspec_core.spec.proposer import NoDrafter

    url = deploy(
        "pair",
        {
            "model": "embedded",
            "num_replicas": 2,
            "max_tokens_default": 96,
            "retrieval": {"store": {"backend": "memory"}, "key": "qwen", "timeout_s": 10.0},
        },
        serve_port,
    )
    msgs = [{"role": "user", "content": "What's the weather like in Lima right now?"}]

    def ask():
        r = client(url).chat.completions.create(
            model="pair", messages=msgs, tools=TOOLS, temperature=0, max_tokens=96, user="acme"
        )
        return r, r.model_extra["toolspec"]

    try:
        assert wait_until(lambda: httpx.get(url + "/models", timeout=10).status_code == 200, timeout=600, every=5)
        first, info = ask()
        home = info["replica"]
        lib = serve.get_deployment_handle("Retrieval", app_name="pair")
        assert wait_until(lambda: lib.stats.remote().result()["records"] >= 1, timeout=60)
        other = None
        for _ in range(30):  # Serve routes to either replica: ask until the other one answers
            r, info = ask()
            if info["replica"] != home:
                other = r
                break
        assert other is not None, "every request went to one replica"
        assert info["retrieval"]["status"] == "ok" and info["retrieval"]["hits"] >= 1
        assert info["acceptance"].get("retrieval", {}).get("accepted", 0) > 0, info["acceptance"]
        assert lib.stats.remote().result()["key"].startswith("qwen")
        target = load_target("embedded")
        ref = generate(
            target, render_prompt(target.tokenizer, msgs, TOOLS), NoDrafter(), DecodeConfig(max_new_tokens=96)
        )
        want = [(c.name, c.arguments) for c in parse_tool_calls(ref.text).calls]
        assert calls_of(first) == calls_of(other) == want and other.usage.completion_tokens == len(ref.tokens)
    finally:
        serve.delete("pair")


# ---------------------------------------------------------------------------------------- tiny model


def test_server_greedy_equals_engine_greedy_tiny(tiny_app, tiny_model_dir):
    from toolspec_core.engine.loop import DecodeConfig, generate
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.model.target import load_target
    from toolspec_core.spec.proposer import NoDrafter

    target = load_target(tiny_model_dir)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write anything."}]
    want = generate(
        target, render_prompt(target.tokenizer, msgs, None), NoDrafter(), DecodeConfig(max_new_tokens=24)
    ).text
    c = client(tiny_app)
    for _ in range(2):  # the second request reuses the cached system-prompt KV
        r = c.chat.completions.create(model="tiny", messages=msgs, temperature=0, max_tokens=24)
        assert r.choices[0].message.content == want
    assert r.model_extra["toolspec"]["prefix_cached_tokens"] > 0


def test_concurrent_requests_complete_with_independent_outputs(tiny_app):
    c = client(tiny_app)
    prompts = [
        [
            {"role": "system", "content": "Shared system prompt."},
            {"role": "user", "content": f"request {i}: " + "go " * i},
        ]
        for i in range(6)
    ]

    def one(i):
        r = c.chat.completions.create(
            model="tiny", messages=prompts[i], tools=TOOLS, temperature=0, max_tokens=20, user=f"t{i % 2}"
        )
        return (
            r.choices[0].message.content,
            [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []],
            r.usage.completion_tokens,
        )

    single = [one(i) for i in range(len(prompts))]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, range(len(prompts))))
    assert together == single
    assert len({str(s) for s in single}) == len(single)


def test_concurrent_streams_each_equal_single_stream_greedy(tiny_app, tiny_model_dir):
    """Six streamed requests at once through the real app share engine steps and KV blocks (one
    system prompt, so cached blocks too) and each streams exactly its plain greedy text."""
    from toolspec_core.engine.loop import DecodeConfig, generate
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.model.target import load_target
    from toolspec_core.spec.proposer import NoDrafter

    target = load_target(tiny_model_dir)
    system = {"role": "system", "content": "You are a careful assistant who answers in one line. " * 3}
    prompts = [[system, {"role": "user", "content": f"stream {i}: " + "more " * i}] for i in range(6)]
    want = [
        generate(target, render_prompt(target.tokenizer, m, None), NoDrafter(), DecodeConfig(max_new_tokens=20)).text
        for m in prompts
    ]
    c = client(tiny_app)

    def one(m):
        chunks = list(
            c.chat.completions.create(
                model="tiny",
                messages=m,
                temperature=0,
                max_tokens=20,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        return reassemble(chunks)["content"], chunks[-1].usage

    first = one(prompts[0])  # leaves the system prompt's blocks in the pool
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert first[0] == want[0] and [g[0] for g in got] == want
    assert all(u.prompt_tokens_details.cached_tokens >= 16 for _, u in got)  # the system prompt's blocks
    with httpx.Client(timeout=60) as http:
        m = http.get(tiny_app[: -len("/v1")] + "/metrics").text
    assert "toolspec_kv_pool_usage{" in m and "toolspec_prefix_cache_hit_rate{" in m


def test_bad_input_is_4xx_openai_error_and_the_replica_keeps_serving(tiny_app):
    url = tiny_app + "/chat/completions"
    good = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bad = [
        (b'{"messages": [}', None),
        (None, {**good, "temperature": "hot"}),
        (None, {**good, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}),
        (None, {**good, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        (None, {**good, "messages": [{"role": "user", "content": "token " * 2100}]}),
        (None, {**good, "max_tokens": 100000}),
        (None, {**good, "max_tokens": -3}),
    ]
    with httpx.Client(timeout=120) as http:
        for raw, body in bad:
            r = (
                http.post(url, content=raw, headers={"content-type": "application/json"})
                if raw
                else http.post(url, json=body)
            )
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert (
                err["type"] == "invalid_request_error"
                and err["message"]
                and set(err) == {"message", "type", "param", "code"}
            )
        ok = http.post(url, json=good)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_models_health_metrics_over_http(tiny_app):
    root = tiny_app[: -len("/v1")]
    with httpx.Client(timeout=60) as http:
        assert http.get(tiny_app + "/models").json()["data"][0]["id"] == "tiny"
        h = http.get(root + "/health").json()
        assert h["status"] == "ok" and h["engine"]["method"] == "toolspec"
        m = http.get(root + "/metrics").text
    for name in (
        "toolspec_requests_total",
        "toolspec_request_latency_seconds_bucket",
        "toolspec_mean_accepted_tokens_bucket",
        "toolspec_acceptance_rate",
        "toolspec_retrieval_fallbacks_total",
    ):
        assert name in m


def _log_sizes(logs) -> dict:
    return {p: p.stat().st_size for p in logs.rglob("*") if p.is_file() and p.suffix in (".log", ".err", ".out")}


def test_a_client_that_disconnects_is_cancelled_quietly(tiny_app, ray_cluster):
    """Clients that leave -- mid-stream, or before the first event -- are normal: their sequences
    leave the engine's batch and give their KV blocks back, and no process logs an error or a
    traceback for them (Serve cancels the ingress and the replica call)."""
    from pathlib import Path

    logs = Path(ray_cluster._private.worker._global_node.get_logs_dir_path())
    root = tiny_app[: -len("/v1")]
    body = {"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 1500, "stream": True}
    before = _log_sizes(logs)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", tiny_app + "/chat/completions", json=body) as r:
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n >= 6:
                    break  # leave mid-stream
        url = httpx.URL(tiny_app + "/chat/completions")
        payload = json.dumps(body).encode()
        head = f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        with socket.create_connection((url.host, url.port)) as sock:  # leave before the first event
            sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

        def drained():
            engine = http.get(root + "/health").json()["engine"]["engine"]
            return engine["running"] == 0 and engine["waiting"] == 0 and engine["kv_pool"]["used_blocks"] == 0

        assert wait_until(drained, timeout=120, every=0.5)
        ok = http.post(tiny_app + "/chat/completions", json={**body, "max_tokens": 4, "stream": False})
        assert ok.status_code == 200
    time.sleep(2)  # let the processes flush their logs
    new = ""
    for p, size in _log_sizes(logs).items():
        with open(p, "rb") as f:
            f.seek(before.get(p, 0))
            new += f.read().decode("utf-8", "replace")
    for marker in ("unhandled error", "stream failed", "Traceback", "TaskCancelledError", "ExceptionGroup"):
        assert marker not in new, new[max(0, new.find(marker) - 2000) : new.find(marker) + 2000]


def _retrieval_actor(ray):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if "tiny#Retrieval" in a["name"]:
            return ray.get_actor(a["name"], namespace=a["namespace"])
    return None


def test_retrieval_killed_mid_run_requests_still_succeed(tiny_app, ray_cluster):
    """Kill the Retrieval replica while requests are in flight; every request must succeed."""
    ray = ray_cluster
    c = client(tiny_app)

    def one(i):
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": f"weather in city number {i}"}]
        r = c.chat.completions.create(
            model="tiny", messages=msgs, tools=TOOLS, temperature=0, max_tokens=12, user="acme"
        )
        return r.model_extra["toolspec"]["retrieval"]["status"], r.choices[0].finish_reason

    assert one(0)[0] in ("ok", "cache")
    actor = _retrieval_actor(ray)
    assert actor is not None
    with cf.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(one, i) for i in range(1, 4)]
        ray.kill(actor, no_restart=True)
        after = [pool.submit(one, i) for i in range(4, 8)]
        results = [f.result() for f in futures + after]
    assert all(finish in ("length", "stop", "tool_calls") for _, finish in results)
    assert any(status == "fallback" for status, _ in results), results
    metrics = httpx.get(tiny_app[: -len("/v1")] + "/metrics", timeout=30).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("toolspec_retrieval_fallbacks_total"))
    assert float(line.split()[-1]) >= 1
    # Serve replaces the dead Retrieval replica: retrieval comes back by itself
    tries = iter(range(100, 1000))
    assert wait_until(lambda: one(next(tries))[0] == "ok", timeout=240, every=3.0)
