"""The replay target's step model: interpolation as benchmarks/step_model.py documents it, the
committed H200 file, outputs unchanged under it, and reports labelled as projections."""

from __future__ import annotations

import json
import random

import pytest
from scripted import ScriptedDrafter, branching, oracle
from tiny import tiny_target

from benchmarks import replay as replay_mod
from benchmarks.replay import RECORDING, greedy_rows, load_recording, replay_over
from benchmarks.step_model import H200_7B, StepModel, derive
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig
from toolspec_core.engine.scheduler import BatchLimits, Scheduler
from toolspec_core.engine.sequence import Sequence

# batch 1: one point; batch 4: q = 1, 4; batch 16: q = 1, 2, 4
GRID = StepModel(((1, 1, 5.0), (4, 4, 6.0), (4, 16, 9.0), (16, 16, 10.0), (16, 32, 11.0), (16, 64, 15.0)))


def test_measured_points_are_returned_as_measured():
    for b, r, ms in GRID.points:
        assert GRID.forward_ms(b, r) == pytest.approx(ms)


def test_linear_in_rows_per_sequence_within_a_batch():
    assert GRID.forward_ms(4, 8) == pytest.approx(6.0 + 3.0 * (2 - 1) / 3)  # q = 2 between q = 1 and 4
    assert GRID.forward_ms(16, 48) == pytest.approx(13.0)  # q = 3 between q = 2 (11) and 4 (15)
    assert GRID.forward_ms(4, 2) == pytest.approx(6.0)  # below the first point: its time
    assert GRID.forward_ms(4, 32) == pytest.approx(9.0 + 1.0 * 4)  # past the last: its slope (1 ms a q)


def test_a_batch_measured_at_one_point_takes_the_nearest_shaped_batch_s_shape():
    # batch 1 has q = 1 only; batch 4 (nearest with several) is 9 / 6 at q = 4
    assert GRID.forward_ms(1, 4) == pytest.approx(5.0 * 9.0 / 6.0)
    assert GRID.forward_ms(1, 1) == pytest.approx(5.0)


def test_linear_in_batch_between_measured_batches_and_extrapolated_past_them():
    assert GRID.forward_ms(10, 10) == pytest.approx(6.0 + (10.0 - 6.0) * (10 - 4) / 12)  # q = 1
    assert GRID.forward_ms(2, 8) == pytest.approx(  # q = 4, a third of the way from 1 to 4
        GRID.forward_ms(1, 4) + (9.0 - GRID.forward_ms(1, 4)) / 3
    )
    assert GRID.forward_ms(28, 28) == pytest.approx(10.0 + (10.0 - 6.0) * (28 - 16) / 12)  # the last line on
    assert not GRID.measured(28) and GRID.measured(16) and GRID.measured(2)
    assert GRID.forward_ms(3, 0) == 0.0  # no rows, no forward


def test_bad_points_are_refused():
    for pts in ((), ((4, 2, 1.0),), ((1, 1, 0.0),)):
        with pytest.raises(ValueError):
            StepModel(pts)


def test_committed_h200_model_is_the_committed_curve_s_graphed_points():
    """The shipped file is ``derive`` of the committed step curve (ragged + CUDA graphs), the two
    B = 1 drafted points that ran eager left out, and it prices those shapes from B = 4's."""
    data = json.loads(H200_7B.read_text())
    curve = json.loads((H200_7B.parents[2] / data["source"]["file"].split("benchmarks/", 1)[1]).read_text())
    exclude = {(e["batch"], e["rows"]): e["why"] for e in data["excluded"]}
    again = derive(curve, "ragged+graphs", exclude, {k: v for k, v in data["source"].items() if k != "mode"})
    assert again["points"] == data["points"]
    m = StepModel.load(H200_7B)
    assert m.forward_ms(1, 1) == pytest.approx(7.5137) and m.forward_ms(64, 64) == pytest.approx(15.972)
    assert m.forward_ms(1, 4) < 10.0  # not the eager 23 ms


@pytest.fixture(scope="module")
def recorded():
    tiny = tiny_target()
    rng = random.Random(11)
    prompts = [
        [rng.randrange(1, 96) for _ in range(rng.randint(9, 30))] for _ in range(5)
    ]  # 8+: a recording is found by its first 8
    return tiny, greedy_rows(tiny, prompts, 12)


@pytest.mark.parametrize("overlap", [None, False])
def test_replay_with_a_step_model_keeps_plain_greedy_and_sleeps_the_modelled_forward(recorded, overlap, monkeypatch):
    """Every output is the recording's (plain greedy's); every step sleeps at most its modelled
    forward, from the target's own (batch, rows); a step model turns overlap on by default."""
    tiny, rows = recorded
    model = StepModel(((1, 1, 0.2), (4, 4, 0.3), (4, 16, 0.5)))
    replay = replay_over(tiny, rows, model)
    asked: list[float] = []
    shapes: list[tuple[int, int]] = []
    real_sleep, lookup = replay_mod.time.sleep, replay.lookup

    def sleep(s):
        asked.append(s)
        real_sleep(s)

    def noted(req):
        shapes.append((len(req.segments), sum(len(s) for s in req.segments)))
        return lookup(req)

    monkeypatch.setattr(replay_mod.time, "sleep", sleep)
    monkeypatch.setattr(replay, "lookup", noted)
    sched = Scheduler(replay, CostModel.flat(), BatchLimits(max_running=4, prefill_chunk=8), overlap=overlap)
    assert sched.overlap is (overlap is None)
    seqs = [
        sched.add(
            Sequence(
                replay,
                r["prompt_ids"],
                ScriptedDrafter((oracle, branching)[i % 2](r["tokens"])),
                DecodeConfig(max_new_tokens=12),
            )
        )
        for i, r in enumerate(rows)
    ]
    sched.run()
    for s, r in zip(seqs, rows):
        assert s.result.tokens == r["tokens"]
    assert asked and len(asked) <= len(shapes) == len(sched.steps)
    most = max(model.forward_ms(b, n) for b, n in shapes) / 1000
    assert all(0 < s <= most for s in asked)


@pytest.mark.skipif(not RECORDING.exists(), reason="no recording")
def test_a_step_model_run_s_report_is_labelled_a_projection(tmp_path):
    """``bench --batch --target replay --step-model``: outputs the recording's, and the report's
    heading, every table row and every JSON run say projection."""
    from benchmarks.batch import BatchRun, build_report
    from benchmarks.cli import parse

    sm = tmp_path / "step.json"
    sm.write_text(json.dumps({"gpu": "a test GPU", "points": [{"batch": 1, "rows": 1, "forward_ms": 0.1}]}))
    rows = {(r["benchmark"], r["id"]): r["tokens"] for r in load_recording(RECORDING)}
    args = parse(
        ["--batch", "2", "--same-batch-reference", "--target", "replay", "--methods", "ar,toolspec", "--limit", "2"]
        + ["--max-new-tokens", "32", "--cost", "reference", "--out", str(tmp_path / "run")]
        + ["--step-model", str(sm), "--overlap", "on", "--data", str(RECORDING.parent / "toolalpaca.dev.jsonl.gz")]
    )
    run = BatchRun(args)
    run.run()
    for rec in run.store.records.values():
        for item, out in rec["outputs"].items():
            assert out["tokens"] == rows[(rec["benchmark"], item)][:32]
    rep = build_report(tmp_path / "run", "proj", tmp_path / "res", "test", "replay", plots=False)
    assert rep["projection"]["gpu"] == "a test GPU" and rep["projection"]["overlap"] == "on"
    assert rep["runs"] and all(r["kind"] == "projection" for r in rep["runs"])
    md = (tmp_path / "res" / "proj.md").read_text().splitlines()
    assert "PROJECTION" in md[0]
    table = [line for line in md if line.startswith("| ") and not line.startswith("| kind")]
    assert table and all(line.startswith("| projection |") for line in table)
    assert all(r["hidden_share"] is not None for r in rep["runs"])
    ts = [r for r in rep["runs"] if r["method"] == "toolspec"]
    assert ts and all(0 < r["prompt_hidden_ms_per_request"] <= r["prompt_side_ms_per_request"] for r in ts)


def test_prompt_side_work_is_hidden_behind_the_modelled_prefill_only_with_overlap(tmp_path):
    """Where a step model prices the forward and host work runs beside it, each prompt's
    prompt-side work hides behind its prefill's forward (a step of one sequence with the prompt's
    rows) and leaves decode time; without overlap or without a step model nothing is hidden."""
    from benchmarks.batch import BatchRun
    from benchmarks.cli import parse

    sm = tmp_path / "step.json"
    sm.write_text(json.dumps({"gpu": "g", "points": [{"batch": 1, "rows": 1, "forward_ms": 5.0}]}))
    base = ["--batch", "2", "--target", "replay", "--cost", "reference", "--max-new-tokens", "32"]
    base += ["--out", str(tmp_path / "r")]
    prompts = [[1] * 300, [2] * 40]
    on = BatchRun(parse(base + ["--step-model", str(sm), "--overlap", "on"]))
    assert on._prefill_s(prompts) == pytest.approx(2 * 5.0 / 1000)  # a one-row step's time at least each
    assert BatchRun(parse(base + ["--step-model", str(sm), "--overlap", "off"]))._prefill_s(prompts) == 0.0
    assert BatchRun(parse(base))._prefill_s(prompts) == 0.0


def test_step_model_flags_are_checked():
    from benchmarks.cli import parse

    with pytest.raises(SystemExit):
        parse(["--batch", "2", "--step-model", str(H200_7B), "--out", "x"])  # not the replay target
    with pytest.raises(SystemExit):
        parse(["--batch", "2", "--target", "replay", "--cost", "reference", "--step-model", "/no/such", "--out", "x"])
