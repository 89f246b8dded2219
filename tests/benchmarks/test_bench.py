"""Benchmark harness: metrics arithmetic on a hand-made trace, gold/validity checks, a resumable
run on a tiny random model with a 3-item synthetic JSONL, report format."""

from __future__ import annotations

import json

import pytest
from tiny import tiny_model

from benchmarks import runner as runner_mod
from benchmarks.cli import bench_main
from benchmarks.cost import curve_from_points, projected_speedup, steps_cost
from benchmarks.data import gold_output_text, load_stream, select_items
from benchmarks.datasets import dev_set
from benchmarks.metrics import call_metrics, first_mismatch, observed_cost, summarize
from benchmarks.report import build_report, build_runs, prior_tool_calls
from benchmarks.runner import RunConfig, Runner, run_pairs
from toolspec_core.drafters import methods as methods_mod
from toolspec_core.model.target import from_model

# --------------------------------------------------------------------------- hand-made trace


def rec(item, method, gen, acc, drafted, decode_s, prefill_s, labels=None, has_call=False, lib=None):
    return {
        "item": item,
        "benchmark": "b",
        "index": 0 if item == "A" else 1,
        "method": method,
        "library": lib,
        "generated_tokens": gen,
        "forwards": len(acc),
        "mat": (gen - 1) / len(acc),
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "accepted_per_step": acc,
        "drafted_per_step": drafted,
        "step_labels": labels or ["none"] * len(acc),
        "label_drafted": {},
        "label_accepted": {},
        "exact_match": True,
        "has_call": has_call,
        "valid": has_call,
        "gold_name_match": has_call,
        "gold_match": False,
        "calls": [{"name": "t", "arguments": {}}] if has_call else [],
    }


@pytest.fixture
def trace():
    # item A: 11 tokens (10 decoded); greedy 10 steps in 1.0 s, method 4 steps [3,3,0,0] in 0.5 s
    # item B: 5 tokens (4 decoded); greedy 4 steps in 0.4 s, method 2 steps [2,0] in 0.4 s
    ar = {
        "A": rec("A", "ar", 11, [0] * 10, [0] * 10, 1.0, 0.5, has_call=True),
        "B": rec("B", "ar", 5, [0] * 4, [0] * 4, 0.4, 0.3),
    }
    me = [
        rec("A", "m", 11, [3, 3, 0, 0], [4, 4, 2, 0], 0.5, 0.5, ["x", "x", "y", "none"], True),
        rec("B", "m", 5, [2, 0], [2, 1], 0.4, 0.3, ["x", "y"]),
    ]
    return ar, me


def test_metrics_hand_computed(trace):
    ar, me = trace
    linear = [0.0] + [float(k) for k in range(1, 65)]  # c(k) = k
    s = summarize(me, ar, {"linear": linear, "flat": curve_from_points({1: 1, 64: 1})})
    assert s["items"] == 2
    assert s["mat"] == pytest.approx(14 / 6)  # (10 + 4) decoded / (4 + 2) forwards
    assert s["decode_speedup"] == pytest.approx(1.4 / 0.9)  # total-time ratio
    assert s["mean_item_speedup"] == pytest.approx((2.0 + 1.0) / 2)
    assert s["geomean_item_speedup"] == pytest.approx(2**0.5)
    assert s["e2e_speedup"] == pytest.approx((1.5 + 0.7) / (1.0 + 0.7))
    assert s["exact_match"] == 1.0 and s["validity"] == 1.0 and s["gold_name_agreement"] == 0.5
    # projected: greedy 14 steps of c(1)=1; method trees 4,4,2,0,2,1 -> c(5)+c(5)+c(3)+c(1)+c(3)+c(2)=19
    assert s["projected_speedup"]["linear"] == pytest.approx(14 / 19)
    assert s["projected_speedup"]["flat"] == pytest.approx(14 / 6)
    assert steps_cost([0, 3], linear) == 5.0
    assert s["per_state"]["x"]["steps"] == 3 and s["per_state"]["x"]["mean_accepted"] == pytest.approx(8 / 3)
    assert s["per_state"]["y"]["mean_accepted"] == 0.0
    ar_s = summarize(list(ar.values()), ar)
    assert ar_s["mat"] == 1.0 and ar_s["decode_speedup"] == 1.0


def test_observed_cost_hand_computed():
    """Verify cost as paid: step seconds over the same item's median plain-greedy step, median per
    forward-size bucket; records without per-step timings (older runs) are skipped."""
    a = {"drafted_per_step": [0, 3, 15, 40], "verify_per_step": [0.1, 0.2, 0.3, 0.8], "ar_step_s": 0.1}
    b = {"drafted_per_step": [0, 2, 16], "verify_per_step": [0.2, 0.3, 0.6], "ar_step_s": 0.2}
    old = {"drafted_per_step": [5], "ar_decode_s": 1.0}
    got = observed_cost([a, b, old])
    assert list(got) == ["1", "2-3", "4-8", "9-16", "17-32", "33-64"]
    assert got["1"] == {"steps": 2, "median_rows": 1, "cost": 1.0}
    assert got["2-3"]["cost"] == pytest.approx(1.5) and got["4-8"]["cost"] == pytest.approx(2.0)  # 0.3/0.2, 0.2/0.1
    assert got["9-16"] == {"steps": 1, "median_rows": 16, "cost": pytest.approx(3.0)}
    assert got["17-32"]["cost"] == pytest.approx(3.0) and got["33-64"]["median_rows"] == 41


def test_build_runs_subsets(trace):
    ar, me = trace
    runs = build_runs(list(ar.values()) + me, ar, {"flat": curve_from_points({1: 1, 64: 1})})
    got = {(r["method"], r["subset"]): r for r in runs}
    assert set(got) == {(m, s) for m in ("ar", "m") for s in ("all", "calls", "prose")}
    calls = got[("m", "calls")]
    assert (
        calls["items"] == 1 and calls["mat"] == pytest.approx(10 / 4) and calls["decode_speedup"] == pytest.approx(2.0)
    )
    prose = got[("m", "prose")]  # item B: no call in plain greedy output
    assert (
        prose["items"] == 1 and prose["mat"] == pytest.approx(4 / 2) and prose["decode_speedup"] == pytest.approx(1.0)
    )
    assert projected_speedup([ar["A"]], [me[0]], curve_from_points({1: 1, 64: 1})) == pytest.approx(2.5)
    # in seconds with host time: greedy 10 steps x 0.01 s + 0.02 s host; method 4 x 0.01 + 0.04 + 0.01
    host_ar, host_me = dict(ar["A"], draft_s=0.02), dict(me[0], draft_s=0.04, commit_s=0.01)
    flat = curve_from_points({1: 1, 64: 1})
    assert projected_speedup([host_ar], [host_me], flat, step_s=0.01) == pytest.approx(0.12 / 0.09)
    s = summarize(
        [host_me], {"A": host_ar}, {"flat": flat, "linear": [0.0] + [float(k) for k in range(1, 65)]}, {"flat": 0.01}
    )
    assert s["projected_speedup_with_host"] == {"flat": pytest.approx(0.12 / 0.09)}  # only curves with seconds
    assert s["host_ms_per_step"] == pytest.approx(1000 * 0.05 / 4)
    assert prior_tool_calls(ar, {"B": "t"}) == {"A": 0, "B": 1}


def test_call_metrics_and_gold():
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"properties": {"a": {}, "b": {}}, "required": ["a"]}},
        }
    ]
    item = {"tools": tools, "gold_calls": [{"name": "f", "arguments": {"a": 1}}]}
    m = call_metrics('```json\n{"name": "f", "arguments": {"a": 1.0}}\n```', item)
    assert m["has_call"] and m["valid"] and m["complete"] and m["gold_name_match"] and m["gold_match"]
    m = call_metrics('<tool_call>\n{"name": "f", "arguments": {"c": 1}}\n</tool_call>', item)
    assert m["has_call"] and not m["valid"] and m["gold_name_match"] and not m["gold_match"]
    assert not call_metrics("no call here", item)["has_call"]
    bfcl = {**item, "gold_alternatives": [{"name": "f", "arguments": {"a": [1, 2], "b": ["", "x"]}}]}
    assert call_metrics('{"name": "f", "arguments": {"a": 2}}', bfcl)["gold_match"]
    assert not call_metrics('{"name": "f", "arguments": {"a": 3}}', bfcl)["gold_match"]
    assert (
        first_mismatch([1, 2, 3], [1, 2, 3]) is None
        and first_mismatch([1, 5], [1, 2, 3]) == 1
        and first_mismatch([1], [1, 2]) == 1
    )


# --------------------------------------------------------------------------- tiny end-to-end run


class AsciiTokenizer:
    """Character tokenizer (vocab 128) with a minimal chat template."""

    eos_token_id = None
    unk_token_id = None

    def __len__(self):
        return 128

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 128 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(int(i)) for i in ids)

    def convert_tokens_to_ids(self, tok):
        return None

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True, **kw):
        text = "[" + ",".join(t["function"]["name"] for t in tools or []) + "]"
        for m in messages:
            text += f"<{m['role'][0]}>{m.get('content') or ''}" + "".join(
                json.dumps(tc["function"]) for tc in m.get("tool_calls") or []
            )
        text += "<a>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def _item(i, bench="syn", tool="get_x"):
    tools = [{"type": "function", "function": {"name": tool, "parameters": {"properties": {"q": {"type": "string"}}}}}]
    return {
        "id": f"{bench}-{i}",
        "benchmark": bench,
        "tools": tools,
        "messages": [{"role": "user", "content": f"abcabc {i} abcabc"}],
        "gold_calls": [{"name": tool, "arguments": {"q": str(i)}}],
    }


@pytest.fixture(scope="module")
def tiny():
    return from_model(tiny_model(vocab=128), AsciiTokenizer(), name="tiny-qwen2")


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "syn.jsonl"
    path.write_text("".join(json.dumps(_item(i)) + "\n" for i in range(3)))
    warm = tmp_path / "warm.jsonl"
    warm.write_text("".join(json.dumps(_item(i)) + "\n" for i in (2, 7, 8)))  # syn-2 is evaluated: dropped
    return path, warm


def _cfg(data, tmp_path, **kw):
    path, warm = data
    base = dict(
        data=[str(path)],
        out=str(tmp_path / "run"),
        methods=["ar", "pld", "suffix", "token_recycling", "toolspec"],
        libraries=["cold", "online", "warm"],
        warm_files=[str(warm)],
        max_new_tokens=12,
        cost="reference",
        retrieval_key="hidden",
    )
    return RunConfig(**{**base, **kw})


def test_resumable_run_and_report(tiny, data, tmp_path, monkeypatch):
    monkeypatch.setitem(methods_mod.REGISTRY, "toolspec", "toolspec_core.no_such_module:X")  # unavailable -> skipped
    calls = []
    real = runner_mod.decode_record
    monkeypatch.setattr(runner_mod, "decode_record", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = _cfg(data, tmp_path)
    pairs = run_pairs(cfg)
    assert pairs[0] == ("ar", None) and len(pairs) == 1 + 1 + 3 + 3 + 1  # ar, pld, 3 libs x 2 history methods, toolspec
    first = Runner(cfg, tiny)
    first.run(max_items=2)  # "interrupted" after two items
    per_item = len(pairs) - 1  # toolspec skipped cleanly
    assert len(calls) == 2 * per_item and "toolspec" in first.pool.unavailable
    with open(tmp_path / "run" / "items.jsonl", "a") as f:
        f.write('{"item": "syn-2", "meth')  # torn line from a kill mid-write
    warm = first.warm_docs("syn")
    assert [r.prompt_ids for r, _, _ in warm] and len(warm) == 2  # syn-2 excluded
    assert warm[0][2] == '```json\n{\n  "name": "get_x",\n  "arguments": {\n    "q": "7"\n  }\n}\n```'

    calls.clear()
    second = Runner(cfg, tiny)
    second.run()
    assert len(calls) == per_item  # only the third item was decoded
    recs = list(second.store.records.values())
    assert len(recs) == 3 * per_item and all(r["exact_match"] for r in recs)
    assert {r["library"] for r in recs if r["method"] == "suffix"} == {"cold", "online", "warm"}
    assert {r["library"] for r in recs if r["method"] == "pld"} == {None}
    assert all(
        r["tokens"] == next(a["tokens"] for a in recs if a["method"] == "ar" and a["item"] == r["item"]) for r in recs
    )

    results = tmp_path / "results"
    rep = build_report(tmp_path / "run", "tiny", results)
    assert (
        set(rep) >= {"model", "hardware", "runs"} and rep["model"] == "tiny-qwen2" and isinstance(rep["hardware"], str)
    )
    for r in rep["runs"]:
        assert r["benchmark"] == "syn" and r["subset"] in ("all", "calls", "prose") and r["items"] == 3
        assert r["method"] in ("ar", "pld", "suffix", "token_recycling") and r["library"] in (
            None,
            "cold",
            "online",
            "warm",
        )
        assert isinstance(r["mat"], float) and isinstance(r["decode_speedup"], float) and r["exact_match"] == 1.0
        assert {"flat", "run", "cpu_reference"} <= set(r["projected_speedup"])
    assert not rep["mismatches"]
    assert rep["observed_cost"] and all(v["steps"] > 0 and v["cost"] > 0 for v in rep["observed_cost"].values())
    on_disk = json.loads((results / "tiny.json").read_text())
    assert on_disk["runs"] == json.loads(json.dumps(rep["runs"]))
    md = (results / "tiny.md").read_text()
    assert "| syn | suffix/online |" in md
    assert (results / "tiny_plots" / "speedup.png").stat().st_size > 1000
    assert (results / "tiny_plots" / "accepted_by_state.png").exists()
    # the report subcommand rebuilds without decoding
    calls.clear()
    assert (
        bench_main(
            ["report", "--out", str(tmp_path / "run"), "--name", "again", "--results-dir", str(results), "--no-plots"]
        )
        == 0
    )
    assert not calls and json.loads((results / "again.json").read_text())["runs"] == on_disk["runs"]
    # a run made on another machine (a GPU's): its config's data paths are not here; --data re-points them
    import benchmarks.report as report_mod

    read = []
    monkeypatch.setattr(report_mod, "_gold_tools", lambda paths: read.append(list(paths)) or {})
    assert (
        bench_main(
            ["report", "--out", str(tmp_path / "run"), "--name", "x", "--results-dir", str(results), "--no-plots"]
        )
        == 0
    )
    assert (
        bench_main(
            [
                "report",
                "--out",
                str(tmp_path / "run"),
                "--name",
                "y",
                "--results-dir",
                str(results),
                "--no-plots",
                "--data",
                "/here/a.jsonl",
                "--data",
                "/here/b.jsonl",
            ]
        )
        == 0
    )
    assert read == [cfg.data, ["/here/a.jsonl", "/here/b.jsonl"]]


def test_resume_with_new_methods_retimes_plain_greedy(tiny, data, tmp_path, monkeypatch):
    """Methods added on a resume are timed against plain greedy decoded again in the same
    run (the machine's speed drifts between runs), not against the stored time."""
    calls = []
    real = runner_mod.decode_record
    monkeypatch.setattr(
        runner_mod, "decode_record", lambda t, p, m, *a, **k: calls.append(m.name) or real(t, p, m, *a, **k)
    )
    Runner(_cfg(data, tmp_path, methods=["ar", "pld"], libraries=["online"]), tiny).run(max_items=2)
    assert calls == ["ar", "pld"] * 2
    calls.clear()
    resumed = Runner(_cfg(data, tmp_path, methods=["ar", "pld", "suffix"], libraries=["online"]), tiny)
    resumed.run()
    assert calls == ["ar", "suffix"] * 2 + ["ar", "pld", "suffix"]  # items 0-1: re-timed ar + suffix
    recs = resumed.store.records
    stored_ar = {r["item"]: r for r in recs.values() if r["method"] == "ar"}
    for r in recs.values():
        if r["method"] == "suffix":
            assert r["exact_match"] and r["reference_retimed"] == (r["index"] < 2)
            if r["index"] < 2:  # its own reference time, not the stored ar record's
                assert r["ar_decode_s"] != stored_ar[r["item"]]["decode_s"]
                assert r["speedup"] == pytest.approx(r["ar_decode_s"] / r["decode_s"])
    assert all(not r["reference_retimed"] for r in recs.values() if r["method"] == "pld")
    # summarize uses each record's own reference time
    ar = {i: dict(a, decode_s=9.0) for i, a in stored_ar.items()}
    sfx = [r for r in recs.values() if r["method"] == "suffix"]
    s = summarize(sfx, ar)
    assert s["decode_speedup"] == pytest.approx(sum(r["ar_decode_s"] for r in sfx) / sum(r["decode_s"] for r in sfx))
    assert (
        Runner(
            _cfg(data, tmp_path, methods=["ar", "pld", "suffix"], libraries=["online"], retime_reference=False), tiny
        ).retime_reference(None, None, None, {})
        is None
    )


def test_online_replay_on_resume(tiny, data, tmp_path):
    """A resumed online run rebuilds history by replaying observe() with recorded outputs."""
    cfg = _cfg(data, tmp_path, methods=["ar", "suffix"], libraries=["online"])
    Runner(cfg, tiny).run(max_items=2)
    resumed = Runner(cfg, tiny)
    resumed.run()
    hist = resumed.pool.instances[("syn", "suffix", "online")].history
    assert hist.tokens("default") > 0  # items 0 and 1 replayed (+ item 2 observed)


def test_text_retrieval_key_runs_the_service_library(tiny, data, tmp_path):
    """A text key: library methods draft from a retrieval_service store keyed by the request text
    (as the Retrieval deployment keys it), the run stays exact, and the key is recorded."""
    from retrieval_service.embedding import query_text
    from retrieval_service.library import ServiceLibrary
    from toolspec_core.drafters.methods import RequestInfo

    cfg = _cfg(data, tmp_path, methods=["ar", "toolspec"], libraries=["online"], retrieval_key="lexical")
    runner = Runner(cfg, tiny)
    runner.run()
    method = runner.pool.instances[("syn", "toolspec", "online")]
    assert isinstance(method.library, ServiceLibrary) and method.library.keyer.name == "lexical"
    recs = list(runner.store.records.values())
    assert len(recs) == 6 and all(r["exact_match"] for r in recs)
    assert {r["retrieval_key"] for r in recs if r["method"] == "toolspec"} == {"lexical"}
    assert json.loads((tmp_path / "run" / "config.json").read_text())["retrieval_key"] == "lexical"
    # what the method stores is found again by the next request's text
    item = _item(5)
    key = query_text(item["messages"], item["tools"])
    req = RequestInfo(prompt_ids=[1, 2], tools=item["tools"], embedding=key)
    method.observe(req, [7, 8, 9], '<tool_call>\n{"name": "get_x", "arguments": {"q": "5"}}\n</tool_call>')
    hits = method.library.search("default", key, ["get_x"], 3)
    assert hits and hits[0]["tool_name"] == "get_x" and hits[0]["token_ids"] == [7, 8, 9]
    rep = build_report(tmp_path / "run", "lex", tmp_path / "results", plots=False)
    assert rep["retrieval"]["key"] == "lexical" and rep["retrieval"]["keyed_requests"] == 3
    assert "retrieval key: lexical" in (tmp_path / "results" / "lex.md").read_text()


def test_cli_max_items_stops_early_and_resumes(tiny, data, tmp_path, monkeypatch):
    """`--max-items N`: only the first N items of the stream (an interrupted run, resumable)."""
    import toolspec_core.model.target as target_mod

    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: tiny)
    out = tmp_path / "cli-run"
    args = [
        "--data",
        str(data[0]),
        "--out",
        str(out),
        "--methods",
        "ar,pld",
        "--cost",
        "reference",
        "--max-new-tokens",
        "8",
        "--no-report",
        "--seed",
        "-1",
    ]
    assert bench_main(args + ["--max-items", "2"]) == 0
    items = [json.loads(line)["item"] for line in (out / "items.jsonl").read_text().splitlines()]
    assert items == ["syn-0", "syn-0", "syn-1", "syn-1"]
    assert bench_main(args) == 0  # the rest
    assert len((out / "items.jsonl").read_text().splitlines()) == 6


def test_stream_selection(data, tmp_path):
    path, _ = data
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(_item(i, bench="oth")) + "\n" for i in range(2)))
    assert [it["id"] for it in load_stream([str(path), str(other)], None, None)] == [
        "syn-0",
        "oth-0",
        "syn-1",
        "oth-1",
        "syn-2",
    ]
    items = [_item(i) for i in range(10)]
    picked = select_items(items, 4, seed=0)
    assert len(picked) == 4 and picked == sorted(picked, key=lambda it: int(it["id"].split("-")[1]))
    assert select_items(items, 4, seed=None) == items[:4]
    assert gold_output_text(AsciiTokenizer(), _item(1), "template").startswith('{"name": "get_x"')


def test_bench_cost_on_tiny_hf_dir(tmp_path):
    """`toolspec bench-cost` on a saved tiny model: writes a curve the projections can load."""
    from benchmarks.cost import load_curves, main

    tiny_model(vocab=128).save_pretrained(str(tmp_path / "tiny"))
    out = tmp_path / "res" / "cost-cpu-tiny.json"
    assert (
        main(
            [
                "--model",
                str(tmp_path / "tiny"),
                "--device",
                "cpu",
                "--ks",
                "1,2,4",
                "--repeats",
                "1",
                "--prefix-len",
                "32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    d = json.loads(out.read_text())
    assert d["points"]["1"] == 1.0 and set(d["points"]) == {"1", "2", "4"} and d["device"] == "cpu"
    assert d["via"] == "engine" and set(d["seconds"]) == {"1", "2", "4"} and all(v > 0 for v in d["seconds"].values())
    curves, step_seconds = load_curves(out.parent)
    assert {"cpu_reference", "flat", "cpu-tiny"} <= set(curves) and len(curves["cpu-tiny"]) == 65
    assert step_seconds == {}  # host-time projections only for accelerator curves
    gpu = dict(d, device="cuda")
    (out.parent / "cost-h200-x.json").write_text(json.dumps(gpu))
    (out.parent / "cost-broken.json").write_text("[]")  # not a curve: skipped
    curves, step_seconds = load_curves(out.parent)
    assert "h200-x" in curves and "broken" not in curves and step_seconds == {"h200-x": d["seconds"]["1"]}


def test_bench_cost_named_shape_random_bf16(tmp_path, monkeypatch):
    """A named shape is built from its config with random weights (here a tiny one, bf16 on CPU)."""
    from benchmarks import cost
    from toolspec_core.model.shapes import shape

    monkeypatch.setitem(cost.SHAPES, "test-tiny", shape(64, 128, 2, 4, 2, 256, False))
    out = tmp_path / "c.json"
    assert (
        cost.main(
            [
                "--model",
                "test-tiny",
                "--device",
                "cpu",
                "--dtype",
                "bfloat16",
                "--ks",
                "1,8",
                "--repeats",
                "1",
                "--prefix-len",
                "16",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    d = json.loads(out.read_text())
    assert (
        d["random_weights"]
        and d["dtype"] == "bfloat16"
        and d["shape"] == "test-tiny"
        and set(d["points"]) == {"1", "8"}
    )


def test_markdown_bound_states_and_repeated_calls(trace):
    """The report's extra sections: MAT vs the dev sets' bound, steps per FSM state, repeated-call curve."""
    from benchmarks.report import MAT_BOUND, markdown

    ar, me = trace
    for r in list(ar.values()) + me:
        r["benchmark"] = "api_bank"
    me = [dict(r, method="toolspec_schema") for r in me]
    runs = build_runs(list(ar.values()) + me, ar, {})
    calls = next(r for r in runs if r["method"] == "toolspec_schema" and r["subset"] == "calls")
    assert calls["mat_of_bound"] == pytest.approx([2.5 / b for b in MAT_BOUND["api_bank"]])
    report = {
        "name": "t",
        "model": "m",
        "hardware": "h",
        "projection_curves": [],
        "mismatches": [],
        "headline": [],
        "runs": runs,
        "mat_vs_prior_calls": {"toolspec_schema": {"0": {"items": 1, "mat": 2.5}, "1": {"items": 1, "mat": 2.0}}},
    }
    md = markdown(report)
    assert "| api_bank | toolspec_schema | 2.50 | 4.1 / 5.1 | 49% – 61% |" in md
    assert (
        "| api_bank | toolspec_schema | x | 2 | 50% | 3.00 |" in md
    )  # item A: steps x,x,y,none: x twice, 3 accepted each
    assert "| toolspec_schema | 2.50 (1) | 2.00 (1) |" in md
    assert "(subset `prose`)" in md


def test_tried_nodes_are_those_whose_parent_was_accepted():
    """``tree.tried`` (what acceptance rates and the replay's calibration count): a node counts when
    its parent was accepted or it hangs off the root; a child of a rejected node is left out."""
    from toolspec_core.spec.tree import DraftTree, tried

    tree = DraftTree()
    a = tree.add(-1, 10, 0.9, "schema")
    b = tree.add(a, 11, 0.8, "schema")
    tree.add(b, 12, 0.5, "suffix")  # its parent b is rejected below
    c = tree.add(a, 13, 0.3, "suffix")
    d = tree.add(-1, 14, 0.1, "value")
    assert tried(tree.parents, [a]) == [a, b, c, d]  # a accepted, then the target wrote neither child
    assert tried(tree.parents, []) == [a, d]


# --------------------------------------------------------------------------- structured outputs


def test_structured_items_come_from_the_dev_sets_gold_calls():
    from benchmarks.data import load_items, response_schema, structured_item

    path = dev_set("api_bank")
    items = load_items(path)
    made = load_items(path, structured=True)
    assert 0 < len(made) <= len(items)
    first = made[0]
    src = next(it for it in items if f"structured-{it['id']}" == first["id"])
    assert structured_item(src) == first and first["benchmark"] == "structured_api_bank" and first["tools"] == []
    fn = next(t["function"] for t in src["tools"] if t["function"]["name"] == src["gold_calls"][0]["name"])
    assert response_schema(first) == fn["parameters"] and first["gold_answer"] == src["gold_calls"][0]["arguments"]
    assert first["messages"][0]["role"] == "system" and fn["name"] in first["messages"][0]["content"]


def test_answer_metrics_check_json_against_the_schema():
    from benchmarks.metrics import answer_metrics

    item = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object", "required": ["city"]}},
        },
        "gold_answer": {"city": "Paris"},
    }
    assert answer_metrics('{"city": "Paris"}', item)["gold_match"] is True
    ok = answer_metrics('{"city": "Lima"}', item)
    assert ok["valid"] and not ok["gold_match"]
    assert not answer_metrics('{"town": "Lima"}', item)["valid"]
    assert answer_metrics('{"city": ', item)["problems"][0].startswith("not JSON")


def test_structured_run_is_exact_under_the_answer_grammar(tmp_path):
    """`toolspec bench --structured` on a tiny random Qwen2 (real tokenizer, so grammars apply):
    every method decodes under the answer's grammar and equals plain greedy."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    target = from_model(Qwen2ForCausalLM(cfg).eval(), tok, "tiny-qwen")
    data = dev_set("toolalpaca")
    run_cfg = RunConfig(
        data=[str(data)],
        out=str(tmp_path / "run"),
        methods=["ar", "toolspec_schema"],
        limit=2,
        max_new_tokens=24,
        cost="reference",
        structured=True,
    )
    runner = Runner(run_cfg, target)
    runner.run()
    recs = list(runner.store.records.values())
    assert len(recs) == 4 and {r["benchmark"] for r in recs} == {"structured_toolalpaca"}
    assert all(r["exact_match"] for r in recs) and all(r["forced_tokens"] > 0 for r in recs)
    assert all(set(r) >= {"valid", "gold_match", "answer"} for r in recs)
