"""Tests of the studies (not collected by the suite: ``pytest benchmarks/studies``). They reuse the
suite's helpers (tiny models, tool fixtures) from ``tests/`` (this folder's conftest.py)."""

from __future__ import annotations

import pytest
from test_bench import _cfg
from test_bench import data as data
from test_bench import tiny as tiny
from toolcall_cases import TOOLS
from toolcall_cases import qwen_tok as qwen_tok

from benchmarks.runner import Runner
from toolspec_core.drafters.toolcall.fsm import CallTracker, ToolIndex


def test_mat_by_key_replay_matches_the_decoded_run(tiny, data, tmp_path):
    """``benchmarks.studies.mat_by_key``: the online replay along the recorded greedy output gives the MAT
    the run decoded with the same key."""
    from benchmarks.studies import mat_by_key
    from benchmarks.studies.offline_sim import _cost

    cfg = _cfg(data, tmp_path, methods=["ar", "toolspec"], libraries=["online"], retrieval_key="lexical")
    Runner(cfg, tiny).run()
    raw = tmp_path / "run"
    recs = mat_by_key.stream_records(raw, 2)
    assert [it["id"] for it, _ in recs] == ["syn-0", "syn-1"]
    ks = mat_by_key.keyers(["lexical", "hidden"], None)
    got = mat_by_key.replay_key("lexical", recs, tiny.tokenizer, _cost(raw, "run"), ks["lexical"], {})
    meas = mat_by_key.measured(raw, {"syn-0", "syn-1"})
    assert got["rows"]["syn/all"]["items"] == meas["syn/all"]["items"] == 2
    assert got["rows"]["syn/all"]["mat"] == pytest.approx(meas["syn/all"]["mat"])

    # two replicas: the items go to them in turn, each with its own history (so with no library
    # each item is drafted as if alone) and one shared library (the second sees the first's call)
    alone = [mat_by_key.replay_key("none", [r], tiny.tokenizer, _cost(raw, "run"), None, {}) for r in recs]
    two = mat_by_key.replay_key("none", recs, tiny.tokenizer, _cost(raw, "run"), None, {}, replicas=2)
    for field in ("tokens", "steps"):
        assert two["rows"]["syn/all"][field] == sum(a["rows"]["syn/all"][field] for a in alone)
    assert two["rows"]["syn/all"]["items_with_candidates"] == 0
    calls = []  # the same items, as if the target had written a call of their first tool
    for item, ar in recs:
        name = item["tools"][0]["function"]["name"]
        text = f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'
        ids = tiny.tokenizer.encode(text)
        calls.append((item, {**ar, "text": text, "tokens": ids, "calls": [{"name": name}], "has_call": True}))
    for key, replicas, seen in (("none", 2, 0), ("lexical", 2, 1), ("lexical", 1, 1)):
        got = mat_by_key.replay_key(key, calls, tiny.tokenizer, _cost(raw, "run"), ks.get(key), {}, replicas=replicas)
        assert got["rows"]["syn/all"]["items_with_candidates"] == seen, (key, replicas)


def test_region_split_hand_computed():
    """``benchmarks.studies.regions``: a step writing tokens in two regions is shared by its tokens; steps'
    seconds add up to the record's decode time (drafting/commit time shared evenly)."""
    from benchmarks.studies.regions import split_steps, step_seconds

    # the call object is tokens [2, 5); token 0 comes from prefill. Step 1 writes tokens 1-3 (one
    # before, two in the call), step 2 token 4, step 3 tokens 5-8 (after).
    out = split_steps([2, 0, 3], [0.3, 0.1, 0.4], (2, 5))
    assert out["before"] == pytest.approx([1 / 3, 1, 0.1])
    assert out["call"] == pytest.approx([1 / 3 * 2 + 1, 3, 0.3])
    assert out["after"] == pytest.approx([1, 4, 0.4])
    assert step_seconds({"verify_per_step": [0.3, 0.1, 0.4], "decode_s": 0.83}) == pytest.approx([0.31, 0.11, 0.41])


def test_replay_region_costs_hand_computed():
    """``offline_sim.region_costs``: a replayed step's price is the curve's cost of its tree (root +
    nodes), shared by the tokens it writes like measured seconds."""
    from benchmarks.studies.offline_sim import region_costs
    from toolspec_core.engine.budget import CostModel

    cost = CostModel({1: 1.0, 4: 1.3, 8: 2.0}, max_nodes=7)  # trees of 3 / 0 / 6 nodes: 4 / 1 / 7 rows
    trace = [(1, 3, 2, "schema"), (4, 0, 0, None), (5, 6, 3, "suffix")]  # (done, tree size, accepted, label)
    out = region_costs(trace, (2, 5), cost)
    c7 = 1.3 + 3 * (2.0 - 1.3) / 4
    assert out["before"] == pytest.approx([1 / 3, 1, 1.3 / 3])
    assert out["call"] == pytest.approx([2 / 3 + 1, 3, 1.3 * 2 / 3 + 1.0])
    assert out["after"] == pytest.approx([1, 4, c7])


def test_region_split_by_label_hand_computed():
    """``regions.split_by_label``: the same split keyed by the label of the step that wrote each
    token; summed over labels it is ``split_steps``."""
    from benchmarks.studies.regions import split_by_label, split_steps

    acc, sec, bounds = [2, 0, 3], [0.3, 0.1, 0.4], (2, 5)
    out = split_by_label(acc, sec, ["suffix", "schema", "suffix"], bounds)
    assert set(out) == {("before", "suffix"), ("call", "suffix"), ("call", "schema"), ("after", "suffix")}
    assert out[("before", "suffix")] == pytest.approx([1 / 3, 1, 0.1])
    assert out[("call", "suffix")] == pytest.approx([2 / 3, 2, 0.2])
    assert out[("call", "schema")] == pytest.approx([1, 1, 0.1])
    assert out[("after", "suffix")] == pytest.approx([1, 4, 0.4])
    whole = split_steps(acc, sec, bounds)
    for reg in whole:
        parts = [v for (r, _), v in out.items() if r == reg]
        assert [sum(col) for col in zip(*parts)] == pytest.approx(whole[reg])


def test_region_summary_hand_computed():
    """``regions.summarize_regions``: the best baseline is the fastest in total; the call object's
    speed the target would need follows from the time left once the rest is paid as it is."""
    from benchmarks.studies.regions import summarize_regions

    def regs(before, call, after):
        return {"before": [1.0, 1, before], "call": [2.0, 10, call], "after": [1.0, 1, after]}

    out = summarize_regions(
        {"ar": regs(2, 10, 4), "pld": regs(2, 8, 3), "suffix": regs(2, 6, 2), "toolspec": regs(2, 4, 2)}
    )
    assert out["best_baseline"] == "suffix"
    ts = out["methods"]["toolspec"]
    assert (
        ts["over_best"] == pytest.approx(10 / 8, abs=1e-3)
        and ts["call"]["over_best"] == 1.5
        and ts["call"]["speedup"] == 2.5
    )
    # 1.5x over 10 s leaves 10 / 1.5 - 4 s (before + after) for a call the baseline writes in 6 s
    assert ts["call_over_best_for_target"] == pytest.approx(6 / (10 / 1.5 - 4), abs=0.01)
    assert ts["call"]["mat"] == 5.0 and ts["call"]["share"] == 0.5


def test_copy_bound_hand_computed():
    """``copy_bound``: the oracle's copy lengths (sources, this output so far, the context anchor), a
    recorded decode's steps by start position, and the least-cost chain lengths under a curve."""
    from benchmarks.studies.copy_bound import best_chains, copy_lengths, recorded_trace

    text_of = lambda ids: "".join(chr(97 + t) for t in ids)  # token t is the letter a+t
    a, b, c, d, x = 0, 1, 2, 3, 23
    assert copy_lengths([a, b, c, d, x], text_of, "bcd") == [0, 3, 2, 1, 0]
    assert copy_lengths([a, b, c, d, x], text_of, "bcd", anchor=1) == [0, 0, 2, 1, 0]  # "ab" is in no source
    assert copy_lengths([a, b, a, b, a], text_of, "") == [0, 0, 2, 2, 1]  # copies of the output itself
    rec = {"method": "suffix", "drafted_per_step": [4, 2, 3], "accepted_per_step": [2, 0, 1]}
    assert recorded_trace(rec) == [
        (1, 4, 2, "suffix"),
        (4, 2, 0, "suffix"),
        (5, 3, 1, "suffix"),
    ]  # the first token: prefill
    assert best_chains([0, 3, 2, 1, 0], lambda j: 1 + 0.1 * j) == [(1, 3)]  # one step drafts 3, writes 4: cost 1.3
    # a steep curve (1, 1.3, 2.2, 3.7) splits it: two chains of one (1.3 + 1.3) beat the whole chain (3.7),
    # one of two then none (2.2 + 1), and four plain steps (4)
    assert best_chains([0, 3, 2, 1, 0], lambda j: 1 + 0.3 * j * j) == [(1, 1), (3, 1)]


def test_call_end_feeds_each_token_once(qwen_tok):
    """``regions.call_bounds`` decodes token by token (multi-byte characters split across tokens
    included) and ends at the token that completes the first call -- the same answer as re-decoding
    every prefix."""
    from benchmarks.studies.regions import call_bounds

    def by_prefix(tokens):
        for i in range(len(tokens)):
            t = CallTracker(ToolIndex.from_tools(TOOLS))
            t.feed(qwen_tok.decode(tokens[: i + 1], skip_special_tokens=True).rstrip("\ufffd"))
            if t.calls:
                return i + 1
        return None

    for text in [
        'Sure — 天气 ☀️ first.\n{"name": "get_time", "arguments": {"tz": "東京"}}\n{"result": "ok"}',
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Zürich"\n  }\n}\n```\nDone.',
        "No call here, only prose 🙂",
    ]:
        tokens = qwen_tok.encode(text)
        bounds = call_bounds(qwen_tok, TOOLS, tokens)
        assert (bounds[1] if bounds else None) == by_prefix(tokens)


def test_call_bounds_start_at_the_token_that_opens_the_call_object(qwen_tok):
    """``call_bounds``: the call region starts at the token holding the object's ``{`` (a fence
    opener before it is text)."""
    from benchmarks.studies.regions import call_bounds

    for text in [
        'Here you go:\n```json\n{\n  "name": "get_time",\n  "arguments": {"tz": "UTC"}\n}\n```\nDone.',
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n{"result": 1}',
    ]:
        tokens = qwen_tok.encode(text)
        start, end = call_bounds(qwen_tok, TOOLS, tokens)
        assert "{" not in qwen_tok.decode(tokens[:start]) and qwen_tok.decode(tokens[: start + 1]).count("{") == 1
        assert start < end
    assert call_bounds(qwen_tok, TOOLS, qwen_tok.encode("No call here")) is None


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
