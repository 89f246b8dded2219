"""The load test's arithmetic (issue 31) on hand-made traces: every number is checked exactly."""

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from benchmarks.datasets import CONVERSATIONS, dev_set
from benchmarks.loadtest import client, metrics, schedule, workloads

MULTI_TURN = dev_set(CONVERSATIONS)


def _rec(index, *, ok=True, ttft=None, tpot=None, itl=(), e2e=None, out=None, prompt=None, error=None, **extra):
    rec = {
        "index": index,
        "ok": ok,
        "error": error,
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "itl_ms": list(itl),
        "e2e_ms": e2e,
        "completion_tokens": out,
        "prompt_tokens": prompt,
        "tool_calls": 0,
        "tool_call_problem": None,
        "gold_name_match": None,
        "mat": None,
        "digest": None,
    }
    rec.update(extra)
    return rec


def test_request_timings_on_a_hand_made_trace():
    # sent at 10.0 s; chunks at +200, +300, +500, +600 ms; done at +700 ms; 7 output tokens
    t = metrics.request_timings(10.0, [10.2, 10.3, 10.5, 10.6], 10.7, 7)
    assert t["e2e_ms"] == pytest.approx(700)
    assert t["ttft_ms"] == pytest.approx(200)
    assert t["tpot_ms"] == pytest.approx(500 / 6)  # (E2E - TTFT) / (tokens - 1)
    # 6 tokens after the first chunk over 3 later chunks: 2 per chunk, each gap / 2
    assert t["itl_ms"] == pytest.approx([50, 100, 50])
    # no usage: every chunk is one token
    t = metrics.request_timings(0.0, [0.1, 0.2, 0.4], 0.5, None)
    assert t["tpot_ms"] == pytest.approx(200) and t["itl_ms"] == pytest.approx([100, 200])
    # one token: no TPOT, no ITL
    t = metrics.request_timings(0.0, [0.1], 0.15, 1)
    assert t["tpot_ms"] is None and t["itl_ms"] == [] and t["ttft_ms"] == pytest.approx(100)
    # not streamed: only E2E
    t = metrics.request_timings(1.0, None, 1.25, 9)
    assert (t["ttft_ms"], t["tpot_ms"], t["itl_ms"], t["e2e_ms"]) == (None, None, [], pytest.approx(250))


def test_distribution_matches_numpy():
    xs = [12.0, 3.0, 7.0, 250.0, 41.0, 8.0, 9.5]
    d = metrics.distribution(xs + [None])
    assert d["mean"] == pytest.approx(np.mean(xs))
    for q in (50, 90, 95, 99):
        assert d[f"p{q}"] == pytest.approx(np.percentile(xs, q))
    assert metrics.distribution([]) == {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}


def test_slo_parsing_and_goodput_rule():
    assert metrics.parse_slo("ttft:200,tpot:50,e2e:1000") == {"ttft": 200.0, "tpot": 50.0, "e2e": 1000.0}
    for bad in ("ttft=200", "itl:5", "ttft:fast"):
        with pytest.raises(Exception):
            metrics.parse_slo(bad)
    slo = {"ttft": 100.0, "e2e": 500.0}
    assert metrics.meets_slo(_rec(0, ttft=100, e2e=500), slo)  # the limit itself is met
    assert not metrics.meets_slo(_rec(0, ttft=101, e2e=100), slo)
    assert not metrics.meets_slo(_rec(0, ttft=None, e2e=100), slo)  # unknown TTFT cannot be shown to meet it
    assert not metrics.meets_slo(_rec(0, ok=False, error="timeout"), slo)


def test_level_summary_on_a_hand_made_level():
    recs = [
        _rec(
            0,
            ttft=100,
            tpot=10,
            itl=[10, 10],
            e2e=200,
            out=11,
            prompt=100,
            mat=2.0,
            drafted_tokens=8,
            accepted_tokens=6,
        ),
        _rec(1, ttft=300, tpot=20, itl=[20], e2e=500, out=11, prompt=100, mat=3.0, drafted_tokens=2, accepted_tokens=2),
        _rec(2, ttft=200, tpot=30, itl=[30, 60], e2e=800, out=21, prompt=200, tool_calls=1, tool_call_problem=None),
        _rec(3, ok=False, error="http_500"),
        _rec(4, ok=False, error="timeout"),
        _rec(
            5, ttft=50, tpot=5, itl=[5], e2e=100, out=2, prompt=10, tool_calls=2, tool_call_problem="unknown_argument"
        ),
    ]
    run = {"records": recs, "duration_s": 2.0, "nodes": ["n"], "timed_out": False, "unsent": 0}
    lv = metrics.summarize("ep", "http://127.0.0.1/v1", 4, None, run, {"ttft": 200.0, "e2e": 600.0})
    assert (lv["requests"], lv["ok"], lv["errors"]) == (6, 4, 2)
    assert lv["error_kinds"] == {"http_500": 1, "timeout": 1}
    assert lv["requests_per_s"] == pytest.approx(4 / 2.0)
    assert lv["output_tokens_per_s"] == pytest.approx(45 / 2.0)
    assert lv["total_tokens_per_s"] == pytest.approx((45 + 410) / 2.0)
    assert lv["goodput_rps"] == pytest.approx(2 / 2.0)  # records 0 and 5 meet ttft <= 200 and e2e <= 600
    assert lv["ttft_ms"] == pytest.approx({"mean": 162.5, "p50": 150.0, "p90": 270.0, "p95": 285.0, "p99": 297.0})
    assert lv["tpot_ms"]["mean"] == pytest.approx(16.25) and lv["tpot_ms"]["p50"] == pytest.approx(15.0)
    itl = [10, 10, 20, 30, 60, 5]  # every gap of every request is one sample
    assert lv["itl_ms"]["mean"] == pytest.approx(np.mean(itl))
    assert lv["itl_ms"]["p99"] == pytest.approx(np.percentile(itl, 99))
    assert lv["e2e_ms"]["p90"] == pytest.approx(np.percentile([200, 500, 800, 100], 90))
    assert lv["mat"] == pytest.approx(2.5) and lv["acceptance_rate"] == pytest.approx(8 / 10)
    assert lv["tool_call_responses"] == 2 and lv["tool_call_validity"] == pytest.approx(0.5)
    assert lv["invalid_calls"] == {"unknown_argument": 1}
    assert metrics.summarize("ep", "u", 4, None, run, None)["goodput_rps"] is None


def _timeline(*steps):
    """A server timeline's early steps: (end, forward_s, generated) each."""
    rows = [{"end": e, "forward_s": f, "generated": g, "kind": "decode"} for e, f, g in steps]
    return {"server_timeline": {"http_in": 0.0, "early_steps": rows}}


def test_first_token_gap_from_the_server_timeline(tmp_path):
    from benchmarks.loadtest.report import write_markdown

    # prompt chunks (nothing generated), the first token at 10.0, the next step's forward starts at 10.5
    held = _rec(0, e2e=1, **_timeline((9.0, 1.0, 0), (10.0, 1.0, 1), (11.0, 0.5, 3), (11.2, 0.2, 5)))
    prompt = _rec(1, e2e=1, **_timeline((4.0, 0.5, 1), (4.25, 0.2, 2)))  # at once: 0.05 s
    alone = _rec(2, e2e=1, **_timeline((4.0, 0.5, 1)))  # one step: no gap known
    assert metrics.first_token_gap_ms(held) == pytest.approx(500.0)
    assert metrics.first_token_gap_ms(prompt) == pytest.approx(50.0)
    assert metrics.first_token_gap_ms(alone) is None and metrics.first_token_gap_ms(_rec(3, e2e=1)) is None
    run = {"records": [held, prompt, alone], "duration_s": 1.0, "nodes": [], "timed_out": False, "unsent": 0}
    lv = metrics.summarize("toolspec", "u", 4, None, run, None)
    assert lv["first_token_gap_ms"]["p50"] == pytest.approx(275.0)
    assert lv["first_token_gap_s_total"] == pytest.approx(0.55)
    bare = metrics.summarize("vllm", "u", 4, None, {**run, "records": [_rec(4, e2e=1)]}, None)
    assert bare["first_token_gap_ms"]["p50"] is None and bare["first_token_gap_s_total"] is None
    cfg = {"dataset": ["d"], "seed": 0, "max_tokens": 8, "stream": True, "num_requests": 3, "max_seconds": 9}
    cfg |= {"warmup": 0}
    report = {"name": "r", "workload": "w", "workload_units": 3, "config": cfg, "runner": "local"}
    report |= {"hardware": "h", "endpoints": [], "levels": [{**lv, "level_no": 0}, {**bare, "level_no": 0}]}
    report |= {"speedup": []}
    write_markdown(report, tmp_path / "r.md")
    section = (tmp_path / "r.md").read_text().split("## First token to next step")[1]
    assert "| toolspec | c=4 | 275.0 |" in section and "0.55 |" in section and "vllm" not in section


def test_identical_outputs_against_the_baseline():
    levels = [
        metrics.summarize(
            "a", "u", 1, None, {"records": [], "duration_s": 1, "nodes": [], "timed_out": 0, "unsent": 0}, None
        ),
        metrics.summarize(
            "b", "u", 1, None, {"records": [], "duration_s": 1, "nodes": [], "timed_out": 0, "unsent": 0}, None
        ),
    ]
    records = {
        ("a", 0): [_rec(0, digest="x"), _rec(1, digest="y"), _rec(2, digest="z"), _rec(3, ok=False)],
        ("b", 0): [_rec(0, digest="x"), _rec(1, digest="q"), _rec(2, digest="z"), _rec(3, digest="w")],
    }
    (row,) = metrics.compare(levels, records, "b")
    assert (row["identical_outputs"], row["compared_outputs"]) == (2, 3)
    assert levels[0]["identical_outputs"] == pytest.approx(2 / 3) and levels[1]["identical_outputs"] is None


def test_tool_call_validity_checks_offered_tools_and_argument_names():
    search = {"type": "object", "properties": {"query": {}, "limit": {}}, "required": ["query", "limit"]}
    tool_args = [
        {"type": "function", "function": {"name": "search", "parameters": search}},
        {"function": {"name": "free"}},
    ]
    call = lambda name, args: {"function": {"name": name, "arguments": args}}  # noqa: E731
    assert client.tool_call_problem([call("search", '{"query": "x"}')], tool_args) is None  # incomplete, valid
    assert client.tool_call_problem([call("free", '{"anything": 1}')], tool_args) is None
    assert client.tool_call_problem([call("search", '{"q": "x"}')], tool_args) == "unknown_argument"
    assert client.tool_call_problem([call("other", "{}")], tool_args) == "unknown_tool"
    assert client.tool_call_problem([call("search", "{bad")], tool_args) == "unparsable_arguments"
    assert client.tool_call_problem([call("search", "[1]")], tool_args) == "unparsable_arguments"


def test_poisson_arrivals_have_the_rate_asked_for():
    rate, n = 5.0, 4000
    offsets = schedule.arrival_offsets(n, rate, 1.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = np.diff(offsets)
    # mean gap 1/rate within 4 standard errors (sd of an exponential = its mean)
    assert abs(gaps.mean() - 1 / rate) < 4 * (1 / rate) / math.sqrt(len(gaps))
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.08  # exponential: coefficient of variation 1
    assert abs(np.mean(gaps < 1 / rate) - (1 - math.exp(-1))) < 0.03  # P(gap < mean) = 1 - 1/e
    assert offsets == schedule.arrival_offsets(n, rate, 1.0, seed=0)  # the seed fixes the schedule
    regular = np.diff(schedule.arrival_offsets(n, rate, 4.0, seed=1))
    assert abs(regular.mean() - 1 / rate) < 0.01 and abs(regular.std() / regular.mean() - 0.5) < 0.05
    assert schedule.arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]


def test_open_loop_plan_split_keeps_the_arrivals():
    sessions = [[(i, {"id": i})] for i in range(7)]
    offsets = schedule.arrival_offsets(7, 2.0, seed=3)
    plan = {"concurrency": None, "offsets": offsets, "max_concurrency": 5, "max_seconds": 9, "duration": None}
    parts = schedule.split_plan(sessions, plan, 2)
    assert sorted(o for _, p in parts for o in p["offsets"]) == offsets
    assert sorted(s[0][0] for part, _ in parts for s in part) == list(range(7))
    assert [p["max_concurrency"] for _, p in parts] == [3, 2]
    closed = schedule.split_plan(sessions, dict(plan, offsets=None, concurrency=3), 2)
    assert [p["concurrency"] for _, p in closed] == [2, 1]


def test_merge_ignores_clock_offsets_between_clients():
    """Two actors whose wall clocks differ by an hour: the level lasts as long as the longer slice."""
    a = {"records": [_rec(0, e2e=100, started=5000.0)], "duration_s": 3.0, "node": "a", "timed_out": False, "unsent": 0}
    b = {"records": [_rec(1, e2e=120, started=1400.0)], "duration_s": 2.5, "node": "b", "timed_out": False, "unsent": 1}
    merged = schedule.merge_slices([b, a])
    assert merged["duration_s"] == 3.0 and [r["index"] for r in merged["records"]] == [0, 1]
    lv = metrics.summarize("ep", "u", 2, None, merged, None)
    assert lv["requests_per_s"] == pytest.approx(2 / 3.0) and lv["e2e_ms"]["mean"] == pytest.approx(110)
    assert lv["nodes"] == ["a", "b"] and lv["unsent"] == 1


def test_sessions_cover_the_requests_asked_for():
    units = [[{"id": "a0"}, {"id": "a1"}, {"id": "a2"}], [{"id": "b0"}]]
    sessions, used = workloads.level_sessions(units, 6, offset=1)
    assert [[item["id"] for _, item in s] for s in sessions] == [["b0"], ["a0", "a1", "a2"], ["b0"], ["a0"]]
    assert [i for s in sessions for i, _ in s] == list(range(6)) and used == 4


def test_seed_fixes_the_mixed_order(tmp_path):
    paths = []
    for name in ("x", "y"):
        path = tmp_path / f"{name}.jsonl"
        rows = [{"id": f"{name}{i}", "tools": [], "messages": [{"role": "user", "content": "hi"}]} for i in range(5)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    order = lambda seed: [u[0]["id"] for u in workloads.load_workload("single", paths, None, seed)]  # noqa: E731
    assert order(0) == order(0) and order(0) != order(1) and sorted(order(0)) == sorted(order(1))
    assert len(order(0)) == 10


def test_agent_conversations_replay_the_multi_turn_data():
    rows = workloads.read_rows(MULTI_TURN)
    units = workloads.load_conversations(MULTI_TURN)
    assert len(units) == 97
    assert sum(len(u) for u in units) == len(rows) + sum(len(r["gold_calls"]) for r in rows)  # one step per call + 1
    first_turns = {r["id"]: r["messages"] for r in rows}
    for unit in units:
        for prev, step in zip(unit, unit[1:], strict=False):  # each request extends the one before
            assert step["messages"][: len(prev["messages"])] == prev["messages"]
        for step in unit:
            if step["id"].endswith("-s0"):  # a turn's first request is exactly the dataset row
                assert step["messages"] == first_turns[step["id"].removesuffix("-s0")]
    assert statistics.mean(len(u) for u in units) > 5
    assert Path(workloads.default_datasets("conversations")[0]) == MULTI_TURN


def test_dotted_tool_names_are_sent_as_openai_accepts_them(tmp_path):
    path = tmp_path / "dots.jsonl"
    fn = {"name": "math.gcd", "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}
    call = {"id": "c0", "type": "function", "function": {"name": "math.gcd", "arguments": "{}"}}
    messages = [{"role": "user", "content": "gcd?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    row = {
        "id": "d",
        "tools": [{"type": "function", "function": fn}],
        "messages": messages,
        "gold_calls": [{"name": "math.gcd", "arguments": {}}],
    }
    path.write_text(json.dumps(row) + "\n")
    (item,) = workloads.load_items(path)
    assert (
        item["tools"][0]["function"]["name"] == "math_gcd"
        and "a" in item["tools"][0]["function"]["parameters"]["properties"]
    )
    assert item["messages"][1]["tool_calls"][0]["function"]["name"] == "math_gcd" and item["gold_names"] == ["math_gcd"]
    assert fn["name"] == "math.gcd"  # the dataset row itself is left as it was


def test_reports_are_strict_json_with_an_unbounded_rate():
    from benchmarks.loadtest.report import strict_json

    out = strict_json({"request_rate": math.inf, "levels": [{"x": -math.inf, "y": math.nan, "z": 1.5}]})
    assert out == {"request_rate": "inf", "levels": [{"x": "-inf", "y": "nan", "z": 1.5}]}
    json.dumps(out, allow_nan=False)
