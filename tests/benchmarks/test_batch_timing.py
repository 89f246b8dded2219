"""``benchmarks.batch_timing`` runs a tiny shape on the CPU through the scheduler and writes every case it promises."""

from __future__ import annotations

import json

from benchmarks.batch_timing import best_mode, main


def test_step_curve_on_a_tiny_shape_writes_every_case(tmp_path):
    out = tmp_path / "curve.json"
    argv = ["--model", "tiny", "--batches", "1,3", "--drafts", "0,3", "--context", "24", "--repeats", "1"]
    assert main(argv + ["--modes", "default,nonsense+x,tp1:ragged", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["tool"] == "benchmarks.batch_timing" and rep["context"] == 24 and rep["dtype"] == "float32"
    assert rep["model"] == "tiny" and rep["hardware"]
    modes = {m["mode"]: m["errors"] for m in rep["modes"]}
    assert modes["default"] == [] and modes["tp1:ragged"] == []  # tp1: the TP rank's path, in process
    assert modes["nonsense+x"] and "ValueError" in modes["nonsense+x"][0]["error"]  # recorded, the run went on
    cases = {(c["mode"], c["batch"], c["drafts"]): c for c in rep["cases"]}
    assert set(cases) == {(m, b, t) for m in ("default", "tp1:ragged") for b in (1, 3) for t in (0, 3)}
    for (_, b, t), c in cases.items():
        assert c["rows"] == b * (1 + t)
        assert c["step_ms"] > 0 and c["forward_ms"] > 0 and c["host_ms"] >= 0
        assert ("plain_tokens_per_s" in c) == (t == 0) and ("break_even_mat" in c) == (t > 0)


def test_best_mode_is_the_cleanly_run_one_with_the_least_step_time():
    def case(mode, b, ms):
        return {"mode": mode, "batch": b, "drafts": 0, "step_ms": ms}

    rep = {
        "modes": [{"mode": "a", "errors": []}, {"mode": "b", "errors": []}, {"mode": "c", "errors": [{"batch": 4}]}],
        "cases": [case("a", 1, 5.0), case("a", 4, 9.0), case("b", 1, 6.0), case("b", 4, 7.0), case("c", 1, 1.0)],
    }
    assert best_mode(rep) == "b"  # c is faster where it ran, but it failed at B = 4
    rep["cases"] = rep["cases"][:1] + rep["cases"][2:3]  # only B = 1 is common
    assert best_mode(rep) == "a"
    assert best_mode({"modes": [{"mode": "c", "errors": ["x"]}], "cases": []}) is None
