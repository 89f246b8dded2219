"""Tests of the studies (not collected by the suite: ``pytest benchmarks/studies``)."""

from __future__ import annotations

import json

import pytest


def test_engine_check_all_drafters_equal_plain_greedy_in_fp32():
    """The accelerator check's own logic on the CPU: in float32 every drafter reproduces plain greedy,
    and the oracle / branching drafts really are accepted (the check would see a broken commit)."""
    import torch

    from benchmarks.studies.gpu_engine_check import check

    run = check("cpu", torch.float32, n_prompts=3, new_tokens=20, seed=1, vocab=128, hidden=64, layers=2)
    for name, row in run["methods"].items():
        assert row["decodes"] == 3 and row["equal"] == 3 and not row["divergences"], name
    assert run["methods"]["oracle"]["mean_accepted_per_step"] > 5
    assert run["methods"]["branching"]["mean_accepted_per_step"] > 3


def test_loadtest_local_app_specs():
    from benchmarks.studies.loadtest_local import app_config

    name, cfg = app_config("toolspec-c128=toolspec+chunk128", "/tmp/lib")
    assert name == "toolspec-c128" and cfg["prefill_chunk_tokens"] == 128 and cfg["method"] == "toolspec"
    assert cfg["retrieval"]["store"]["path"] == "/tmp/lib/toolspec-c128"  # a library of its own
    name, cfg = app_config("ar=ar", "/tmp/lib")
    assert cfg == {"method": "ar", "retrieval": {"enabled": False}}
    _, cfg = app_config("nocache=toolspec+nocache", "/tmp/lib")
    assert cfg["prefix_caching"] is False
    _, cfg = app_config("t1=toolspec+threads1", "/tmp/lib")
    assert cfg["threads"] == 1
    _, cfg = app_config("g=ar+graphs", "/tmp/lib")
    assert cfg["cuda_graphs"] is True and cfg["method"] == "ar"
    for removed in ("x=toolspec+fast", "x=toolspec+threads", "x=toolspec+threads0"):
        with pytest.raises(SystemExit):
            app_config(removed, "/tmp/lib")


def test_rss_sampler_reads_only_its_own_replicas(tmp_path):
    """The soak's memory series counts this run's engine replicas only (descendants of the
    driver), never another Ray instance's replicas on the same machine."""
    import json
    import subprocess
    import sys
    import time

    import psutil

    from benchmarks.studies.loadtest_local import RssSampler, is_vllm_engine

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    mine = subprocess.Popen([*sleeper, "ray::ServeReplica:mine:Replica"])
    # a process that is not ours: started by a shell that exits at once (re-parented away)
    tag = f"ray::ServeReplica:other{mine.pid}:Replica"
    subprocess.run(["sh", "-c", " ".join([*(repr(a) for a in sleeper), tag, ">/dev/null 2>&1 &"])], check=True)
    others = []
    try:
        deadline = time.time() + 10
        while not others and time.time() < deadline:
            others = [p for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])]
            time.sleep(0.05)
        assert others, "the stranger process did not start"
        sampler = RssSampler(0.1)
        time.sleep(0.5)
        sampler.stop(str(tmp_path / "rss.json"))
        series = json.loads((tmp_path / "rss.json").read_text())["series"]
        assert series and {p for s in series for p in s["pids"]} == {mine.pid}
        engine = [subprocess.Popen([*sleeper, f"VLLM::{title}"]) for title in ("EngineCore", "Worker")]
        try:
            time.sleep(0.3)
            sampler = RssSampler(0.1, is_vllm_engine)
            time.sleep(0.5)
            sampler.stop(str(tmp_path / "vllm.json"))
        finally:
            for p in engine:
                p.kill()
        series = json.loads((tmp_path / "vllm.json").read_text())["series"]
        # vLLM's engine and worker summed in each sample, not the replica
        assert series and all(sorted(s["pids"]) == sorted(p.pid for p in engine) for s in series)
    finally:
        mine.kill()
        for p in others:
            p.kill()


def test_loadtest_local_vllm_command_line(tmp_path):
    """The vLLM apps' specs, the server command line (float32, hermes tool parsing, suffix
    decoding only with +suffix) and both thread placements."""
    import json

    from benchmarks.studies.loadtest_local import is_vllm, vllm_app, vllm_command, vllm_env

    assert is_vllm("v=vllm+suffix") and is_vllm("vllm") and not is_vllm("ar=ar")
    assert vllm_app("v2=vllm+suffix+allcores") == ("v2", {"suffix": True, "allcores": True})
    assert vllm_app("vllm") == ("vllm", {"suffix": False, "allcores": False})
    with pytest.raises(SystemExit):
        vllm_app("v=vllm+eagle")
    venv = str(tmp_path / "venv")
    cmd = vllm_command(venv, "/m/qwen", 8123, "Qwen", suffix=False)
    assert cmd[:3] == [f"{venv}/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-auto-tool-choice" in cmd
    at = {a: cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a.startswith("--")}
    assert at["--model"] == "/m/qwen" and at["--dtype"] == "float32" and at["--port"] == "8123"
    assert at["--served-model-name"] == "Qwen" and at["--tool-call-parser"] == "hermes"
    assert "--speculative-config" not in cmd
    assert "--enable-prompt-tokens-details" in cmd  # its cached prompt tokens: the report's prefix-cached share
    bf16 = vllm_command(venv, "/m/qwen", 8123, "Qwen", suffix=False, dtype="bfloat16")
    assert bf16[bf16.index("--dtype") + 1] == "bfloat16"
    spec = vllm_command(venv, "/m/qwen", 8123, "Qwen", suffix=True)
    config = json.loads(spec[spec.index("--speculative-config") + 1])
    assert config["method"] == "suffix" and config["num_speculative_tokens"] > 0
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    base = {"PYTHONPATH": "/src/project", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    default = vllm_env(venv, allcores=False, base=base)
    assert default["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in default
    assert default["HF_HUB_OFFLINE"] == "1" and default["LD_PRELOAD"].endswith("libiomp5.so")
    assert "PYTHONPATH" not in default and default["VLLM_CPU_KVCACHE_SPACE"].isdigit()
    every = vllm_env(venv, allcores=True, base=base)
    assert every["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-") and every["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_loadtest_local_skips_vllm_cleanly_when_absent(tmp_path, monkeypatch, capsys):
    """Without vLLM's venv every vLLM app is skipped with a note and nothing is started."""
    from benchmarks.studies import loadtest_local

    monkeypatch.setenv("TOOLSPEC_VLLM_VENV", str(tmp_path / "none"))
    assert "vllm_setup.sh" in loadtest_local.vllm_missing(str(tmp_path / "none"))
    site = tmp_path / "v" / "lib" / "python3.11" / "site-packages"
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").write_text("")
    (site / "vllm").mkdir(parents=True)
    assert "dist-info" in loadtest_local.vllm_missing(str(tmp_path / "v"))
    (site / "vllm-0.32.0+cpu.dist-info").mkdir()
    assert loadtest_local.vllm_missing(str(tmp_path / "v")) is None
    assert "ArcticInference" in loadtest_local.vllm_missing(str(tmp_path / "v"), suffix=True)

    def never(*a, **k):
        raise AssertionError("nothing may start")

    monkeypatch.setattr(loadtest_local, "VllmServer", never)
    rc = loadtest_local.main(["--apps", "vllm=vllm,s=vllm+suffix", "--out", str(tmp_path / "out")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "skipping vllm=vllm" in out and "skipping s=vllm+suffix" in out and "nothing to run" in out


def test_loadtest_compares_fenced_calls_in_content_with_tool_calls(tmp_path):
    """A server that leaves the model's fenced call in ``content`` and one that returns it as a
    tool call have the same text digest (not the same response digest); a different argument
    does not."""
    import json

    from benchmarks.loadtest.client import output_digest, text_digest
    from benchmarks.studies.loadtest_local import compare_outputs

    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "days": 2}\n}\n```'
    call = [{"function": {"name": "get_weather", "arguments": '{"days": 2, "city": "Paris"}'}}]
    other = [{"function": {"name": "get_weather", "arguments": '{"days": 3, "city": "Paris"}'}}]
    assert text_digest(fenced, []) == text_digest(None, call) != text_digest(None, other)
    assert output_digest(fenced, []) != output_digest(None, call)
    assert text_digest("plain words", []) == text_digest("plain words ", []) != text_digest("other", [])

    def rec(i, tokens, content, calls):
        return {
            "index": i,
            "ok": True,
            "completion_tokens": tokens,
            "tool_calls": len(calls),
            "digest": output_digest(content, calls),
            "text_digest": text_digest(content, calls),
        }

    lines = [
        {
            "endpoint": "toolspec",
            "level_no": 0,
            "summary": {"concurrency": 1},
            "records": [rec(0, 30, None, call), rec(1, 5, "hi", [])],
        },
        {
            "endpoint": "vllm",
            "level_no": 0,
            "summary": {"concurrency": 1},
            "records": [rec(0, 30, fenced, []), rec(1, 6, "hi!", [])],
        },
    ]
    path = tmp_path / "run.partial.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows = {r["endpoint"]: r for r in compare_outputs(str(path), ["toolspec", "vllm"])["levels"]}
    assert rows["vllm"]["compared"] == 2 and rows["vllm"]["same_token_count"] == 1
    assert rows["vllm"]["same_text"] == 1 and rows["vllm"]["same_response"] == 0
    assert rows["vllm"]["output_tokens"] == 36 and rows["toolspec"]["tool_calls"] == 1


def test_loadtest_local_serves_without_ray_as_one_process_per_app(tmp_path, monkeypatch):
    """--no-ray: each ToolSpec app is ``benchmarks.studies.serve_noray`` with the app's keys (no
    call-library deployment, no Ray port or prefix), ready when its /health answers; vLLM is
    served in the apps' dtype (``auto`` as a CPU replica resolves it)."""
    import json
    import subprocess

    from benchmarks.studies import loadtest_local

    started = {}

    class Proc:
        pid, returncode = 12345, None

        def poll(self):
            return None

    def popen(cmd, **kw):
        started.update(cmd=cmd, env=kw["env"], session=kw["start_new_session"])
        return Proc()

    monkeypatch.setattr(subprocess, "Popen", popen)
    server = loadtest_local.NorayServer(
        {"model": "/m", "port": 8000, "route_prefix": "/x", "method": "toolspec", "retrieval": {"store": {}}},
        8123,
        str(tmp_path / "log"),
    )
    cmd = started["cmd"]
    assert cmd[1:3] == ["-m", "benchmarks.studies.serve_noray"] and cmd[-2:] == ["--port", "8123"]
    cfg = json.loads(cmd[cmd.index("--config") + 1])
    assert cfg == {"model": "/m", "method": "toolspec", "retrieval": {"enabled": False}}
    assert server.url == "http://127.0.0.1:8123" and server.ready_path == "/health" and started["session"]
    assert loadtest_local.is_noray_engine(" ".join(cmd))
    server.log.close()
    from toolspec_core.model import target as target_mod

    monkeypatch.setattr(target_mod, "cpu_has_bf16", lambda: True)
    assert loadtest_local.vllm_dtype({"dtype": "auto"}) == "bfloat16"
    assert loadtest_local.vllm_dtype({}) == "float32"


def test_serve_noray_refuses_the_call_library():
    from benchmarks.studies import serve_noray

    with pytest.raises(SystemExit, match="retrieval.enabled false"):
        serve_noray.main(["--config", '{"model": "scripted", "method": "ar"}'])


def test_prefill_forward_parts_of_profiler_operators():
    from benchmarks.studies.prefill_forward import part_of

    assert part_of("mkldnn::_linear_pointwise") == "linears"
    assert part_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert part_of("aten::index_copy_") == "kv_cache"
    assert part_of("aten::silu") == "elementwise"
    assert part_of("aten::empty") == "other ops"


def test_loadtest_local_saves_each_apps_health_with_its_cost_curve(tmp_path):
    """After an app's levels its /health goes beside the report (the draft budget's cost curve,
    probed at start-up, decides how much each step drafts); an app without JSON there writes
    nothing and does not fail the run."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from benchmarks.studies.loadtest_local import save_health

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"cost_model": {"source": "measured", "points": {"1": 1.0}}}).encode()
            ok = self.path == "/toolspec/health"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(body if ok else b"")

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        path = tmp_path / "run.toolspec.health.json"
        assert save_health(f"{base}/toolspec", str(path))
        assert json.loads(path.read_text())["cost_model"]["points"] == {"1": 1.0}
        missing = tmp_path / "run.other.health.json"
        assert not save_health(f"{base}/other", str(missing)) and not missing.exists()
    finally:
        srv.shutdown()


def test_drafting_parts_are_timed_on_the_replay_and_put_back(tmp_path):
    """``draft_profile --parts``: every part of a drafter's step timed per drafted sequence-step on
    the replay, the expansion's candidate objects counted against those it returns, and the
    drafting functions it wrapped put back afterwards."""
    from benchmarks.replay import RECORDING
    from benchmarks.studies import draft_profile
    from toolspec_core.drafters.toolcall import drafter

    before = (drafter.SchemaDrafter._draft, drafter.candidates_to_tree, drafter.continuations)
    out = tmp_path / "parts.json"
    assert (
        draft_profile.main(
            ["--parts", "--batch", "2", "--limit", "2", "--max-new-tokens", "32", "--out", str(tmp_path / "run")]
            + ["--data", str(RECORDING.parent / "toolalpaca.dev.jsonl.gz"), "--json", str(out)]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["drafted_sequence_steps"] > 0
    ms = res["ms_per_drafted_sequence_step"]
    assert {name for _, name in draft_profile.PARTS} >= set(ms) and ms[draft_profile.PARTS[0][1]] > 0
    assert ms[draft_profile.PARTS[0][1]] >= ms["schema candidates (continuations)"]
    assert res["candidate_objects_per_expansion"] >= res["candidates_returned_per_expansion"] > 0
    assert (drafter.SchemaDrafter._draft, drafter.candidates_to_tree, drafter.continuations) == before


def test_expansion_equal_finds_a_difference_and_passes_on_equal_code(monkeypatch):
    """The study compares for real: against this tree's own module it passes; with one branch
    factor of the other side changed it reports the first difference."""
    from benchmarks.studies import expansion_equal as ee

    old = ee.load_revision("HEAD")
    assert ee.compare(old, 1)["positions_checked"] > 1000
    monkeypatch.setattr(old, "MORE_OPTIONAL", old.MORE_OPTIONAL * 0.5)
    with pytest.raises(AssertionError, match="differs"):
        ee.compare(old, 1)


def test_tool_set_cache_study_streams_sets_and_measures_their_memory():
    """Resent tool sets hit; the bytes the cache's bound counts are no fewer than a compiled set holds."""
    from benchmarks.studies import tool_set_cache as tsc

    def tool(name):
        props = {"q": {"type": "string"}, "n": {"enum": [1, 2, 3]}}
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}

    items = [{"tools": [tool("a")]}, {"tools": [tool("b")]}, {"tools": [tool("a")]}, {"tools": [tool("a")]}]
    st = tsc.stream_stats(items, None, 1 << 20)
    assert (st["items"], st["hits"], st["misses"]) == (4, 2, 2)
    mem = tsc.measured_bytes(items)
    assert mem["sets"] == 2 and mem["measured_bytes_mean"] > 0 and mem["estimate_over_measured_min"] >= 1.0


def test_token_miss_kinds_say_where_a_candidates_tokens_are_its_own():
    """``split`` exactly where the candidate tokenized after the tail equals its text tokenized alone."""
    import regex
    from transformers import AutoTokenizer

    from benchmarks.studies.tool_set_cache import miss_kind
    from toolspec_core.drafters.toolcall.boundary import QWEN2_SPLIT, BoundaryTokenizer
    from toolspec_core.model.embedded import embedded_model_dir

    bt = BoundaryTokenizer(AutoTokenizer.from_pretrained(str(embedded_model_dir())))
    pattern = regex.compile(QWEN2_SPLIT)
    cases = [
        ('{"name": "get', 'Weather", "arguments": {'),  # a word run on: BPE may merge across
        ('{"city": "Paris', '", "days": 3}}'),
        ('{"city":', ' "Paris"'),  # ' "' would merge
        ('{"n": 1', "2, "),  # digits are pieces of their own
        ('{"city": "Paris",', ' "days": '),
        ("<tool_call>\n", '{"name": "'),
    ]
    kinds = []
    for context, text in cases:
        tail = tuple(bt.tok.encode(context, add_special_tokens=False))[-3:]
        kind = miss_kind(bt, pattern, tail, ((text, "x"),))
        kinds.append(kind)
        own = tuple(bt.continuation(tail, text)) == tuple(bt._encode(text))
        assert kind != "split" or own, (context, text)
    assert "split" in kinds and "nosplit" in kinds
    # a piece ends at the boundary, yet the head alone is cut otherwise (a, '  ' against a, ' ', ' ', 1)
    spaced = tuple(bt.tok.encode("a  ", add_special_tokens=False))
    assert bt._encode("a  ") == spaced and miss_kind(bt, pattern, spaced, (("1", "x"),)) == "nosplit"
    assert miss_kind(bt, pattern, (1, 2, 3), (("a", "x"), ((7,), "end"), ("b", "x"))) == "runs"
