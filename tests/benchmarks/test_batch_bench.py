"""``toolspec bench --batch``: groups decoded together, exact against single-stream greedy, resumable, reported."""

from __future__ import annotations

import argparse
import json

import pytest
from test_bench import AsciiTokenizer, _item
from tiny import tiny_model

from benchmarks.batch import BatchRun, build_report, markdown, summarize
from toolspec_core.model.target import from_model


@pytest.fixture(scope="module")
def tiny():
    return from_model(tiny_model(vocab=128), AsciiTokenizer(), name="tiny-qwen2")


def _args(tmp_path, data, **kw):
    base = dict(
        data=[str(p) for p in data],
        out=str(tmp_path / "run"),
        limit=None,
        seed=0,
        methods=["ar", "suffix", "toolspec"],
        batch=[1, 2, 4],
        max_new_tokens=10,
        cost="reference",
        calibrate=True,
        model=None,
        threads=None,
        dtype="float32",
        device="cpu",
    )
    return argparse.Namespace(**{**base, **kw})


def test_batch_run_is_exact_resumable_and_reported(tiny, tmp_path, monkeypatch):
    import toolspec_core.drafters.toolcall.drafter as drafter_mod
    from toolspec_core.spec.proposer import Proposer

    # the drafters' prompt-side work is done before the first step, never inside a step's drafting
    scans, in_step = [], [False]
    numbers, propose = drafter_mod.context_numbers, Proposer.propose

    def scan(text):
        scans.append(in_step[0])
        return numbers(text)

    def stepping(drafters, ctxs):
        in_step[0] = True
        try:
            return propose(drafters, ctxs)
        finally:
            in_step[0] = False

    monkeypatch.setattr(drafter_mod, "context_numbers", scan)
    monkeypatch.setattr(Proposer, "propose", staticmethod(stepping))
    paths = []
    for bench in ("syn", "two"):
        p = tmp_path / f"{bench}.jsonl"
        p.write_text("".join(json.dumps(_item(i, bench)) + "\n" for i in range(5)))
        paths.append(p)
    args = _args(tmp_path, paths)
    run = BatchRun(args, tiny)
    run.run()
    lines = (tmp_path / "run" / "batch.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 3 * (5 + 3 + 2)  # benchmarks x methods x groups of B = 1, 2, 4
    assert scans and not any(scans)
    for rec in map(json.loads, lines):  # timed apart from the steps' host time
        if rec["method"] in ("ar", "toolspec"):
            assert (rec["prompt_side_s"] > 0) == (rec["method"] == "toolspec"), rec["method"]
    with (tmp_path / "run" / "batch.jsonl").open("a") as f:
        f.write('{"benchmark": "syn", "meth')  # a run stopped while writing a record
    again = BatchRun(args, tiny)
    again.run()  # nothing left to do: every group is on file
    assert (tmp_path / "run" / "batch.jsonl").read_text().splitlines() == lines
    rep = build_report(tmp_path / "run", "batch-tiny", tmp_path / "results", "test box", "tiny-qwen2")
    runs = rep["runs"]
    assert {(r["benchmark"], r["method"], r["batch"]) for r in runs} >= {("pooled", "toolspec", 4), ("syn", "ar", 1)}
    for r in runs:
        assert set(r) >= {"benchmark", "method", "batch", "items", "decode_tokens_per_s", "speedup_vs_ar", "mat"}
        assert r["exact_match"] == 1.0 and r["complete"]
        assert r["items"] == (10 if r["benchmark"] == "pooled" else 5)
        if r["method"] == "ar":
            assert r["speedup_vs_ar"] == pytest.approx(1.0) and r["mat"] == pytest.approx(1.0)
            assert r["prompt_side_ms_per_request"] == 0
    four = next(r for r in runs if (r["benchmark"], r["method"], r["batch"]) == ("syn", "ar", 4))
    assert four["rows_per_step"] > 1  # the group's sequences shared forwards
    # the compiled tool-set cache of each (benchmark, B)'s stream: one lookup a request
    sets = {(r["benchmark"], r["method"], r["batch"]): r for r in rep["tool_sets"]}
    assert set(sets) == {(b, "toolspec", n) for b in ("syn", "two") for n in (1, 2, 4)}
    assert all(r["hits"] + r["misses"] == 5 and r["misses"] >= 1 and r["bytes"] > 0 for r in sets.values())
    md = (tmp_path / "results" / "batch-tiny.md").read_text()
    assert md.count("| syn |") == 9 + 3 and "## Compiled tool sets" in md
    assert (tmp_path / "results" / "batch-tiny.png").stat().st_size > 0


# the step counts and times of a group, the same in every record here
_STEPS = dict(steps=3, rows=6, forward_s=0.5, host_s=0.1)


def _rec(bench, method, b, group, ids, toks, decode_s=1.0):
    """A batch.jsonl record of one group: ``toks`` the items' output tokens."""
    outs = {i: {"tokens": t, "text": "", "forwards": len(t), "mat": 1.0} for i, t in zip(ids, toks)}
    run = dict(benchmark=bench, method=method, batch=b, group=group)
    return run | dict(items=ids, decode_s=decode_s, generated=sum(map(len, toks)), outputs=outs) | _STEPS


def test_summary_marks_partial_runs_and_pools_only_complete_benchmarks():
    recs = [
        _rec("a", "ar", 1, 0, ["a0"], [[1, 2]]),
        _rec("a", "ar", 1, 1, ["a1"], [[3]]),
        _rec("a", "ar", 2, 0, ["a0", "a1"], [[1, 2], [3, 9]]),  # a1 differs from its single-stream output
        _rec("b", "ar", 1, 0, ["b0"], [[5]]),
        _rec("b", "ar", 1, 1, ["b1"], [[6]]),
        _rec("b", "ar", 1, 2, ["b2"], [[7]]),  # b has no B = 2 run yet
    ]
    runs = {(r["benchmark"], r["method"], r["batch"]): r for r in summarize(recs)}
    assert ("pooled", "ar", 1) not in runs  # one complete benchmark: nothing to pool
    assert runs[("a", "ar", 2)]["exact_match"] == 0.5 and runs[("a", "ar", 2)]["mismatched_items"] == ["a1"]
    assert runs[("a", "ar", 2)]["decode_tokens_per_s"] == 4.0 and runs[("a", "ar", 2)]["complete"]
    recs.append(_rec("b", "ar", 2, 0, ["b0", "b1"], [[5], [6]]))  # one of b's two groups at B = 2: partial
    runs = {(r["benchmark"], r["method"], r["batch"]): r for r in summarize(recs)}
    assert not runs[("b", "ar", 2)]["complete"] and ("pooled", "ar", 2) not in runs


def test_without_single_stream_runs_each_batch_is_compared_with_plain_greedy_at_its_own_b():
    recs = [
        _rec("a", "ar", 2, 0, ["a0", "a1"], [[1, 2], [3]]),
        _rec("a", "toolspec", 2, 0, ["a0", "a1"], [[1, 2], [3, 4]]),
        _rec("a", "ar", 4, 0, ["a0", "a1"], [[1, 2], [3, 4]]),  # plain greedy itself differs at B = 4 (rounding)
        _rec("a", "toolspec", 4, 0, ["a0", "a1"], [[1, 2], [3, 4]]),
    ]
    runs = {(r["method"], r["batch"]): r for r in summarize(recs)}
    assert runs[("toolspec", 2)]["mismatched_items"] == ["a1"] and runs[("toolspec", 4)]["exact_match"] == 1.0
    assert all(r["complete"] for r in runs.values())
    report = {
        "name": "n",
        "model": "m",
        "hardware": "h",
        "exact_reference": "ar at the same B",
        "runs": list(runs.values()),
    }
    assert "against plain greedy at the same B" in markdown(report)


@pytest.mark.parametrize(
    "flags, want",
    [
        ([], {}),
        (["--attention", "ragged"], {"attention": "ragged"}),
        (["--attention", "per_sequence", "--cuda-graphs"], {"attention": "per_sequence", "cuda_graphs": True}),
    ],
)
def test_engine_flags_reach_load_target_only_when_given(tmp_path, monkeypatch, flags, want):
    from benchmarks.cli import bench_main
    from toolspec_core.model import target as target_mod

    seen = {}

    class Loaded(Exception):
        pass

    def fake_load_target(path=None, **kw):
        seen.update(kw)
        raise Loaded

    monkeypatch.setattr(target_mod, "load_target", fake_load_target)
    data = tmp_path / "syn.jsonl"
    data.write_text(json.dumps(_item(0)) + "\n")
    with pytest.raises(Loaded):
        bench_main(["--batch", "2", "--data", str(data), "--out", str(tmp_path / "run")] + flags)
    assert {k: v for k, v in seen.items() if k in ("attention", "cuda_graphs")} == want


def test_ragged_batch_run_decodes_from_a_pool_and_stays_exact(tmp_path, monkeypatch):
    """The groups decode from the run's block pool, where each prompt was prefilled once (untimed)
    and every method's sequences find it in the prefix cache; the timed steps carry no prompt
    rows (the rest of each prompt past its cached blocks is prefilled before the clock starts),
    every step runs ragged, every block comes back, and every output still equals single-stream
    plain greedy."""
    import benchmarks.prompts as prompts_mod

    target = from_model(tiny_model(vocab=128), AsciiTokenizer(), name="tiny-qwen2", attention="ragged")
    p = tmp_path / "syn.jsonl"
    p.write_text("".join(json.dumps(_item(i, "syn")) + "\n" for i in range(4)))
    run = BatchRun(_args(tmp_path, [p], batch=[1, 4], methods=["ar", "toolspec"]), target)
    prefills, started = [], []
    real_prefill, real_start = prompts_mod.prefill, prompts_mod.PromptPool.start
    monkeypatch.setattr(prompts_mod, "prefill", lambda *a, **k: prefills.append(a[1]) or real_prefill(*a, **k))

    def start(self, seqs, cost, limits):
        out = real_start(self, seqs, cost, limits)
        started.append((out.sched, len(out.sched.steps), seqs))
        return out

    monkeypatch.setattr(prompts_mod.PromptPool, "start", start)
    pools = []
    real = run._prompt_pool
    run._prompt_pool = lambda items: pools.append(real(items)) or pools[-1]
    run.run()
    assert len(pools) == 1 and len(prefills) == 4  # one pool; each prompt prefilled once
    pool = pools[0].pool
    assert pool.stats().used_blocks == 0  # every sequence gave its blocks back, every prompt unpinned
    for sched, first, seqs in started:
        assert all(s.stats.cached_tokens > 0 for s in seqs)  # found in the prefix cache
        assert all(step.prefill_rows == 0 for step in sched.steps[first:])  # the timed phase decodes only
    assert target.runner(pool).steps["ragged"] > 0 and target.runner(pool).steps["per_sequence"] == 0
    rep = build_report(tmp_path / "run", "batch-ragged", tmp_path / "results", "test box", "tiny-qwen2")
    assert rep["runs"] and all(r["exact_match"] == 1.0 for r in rep["runs"])
