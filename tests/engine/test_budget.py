"""The cost model: the measured curve and its calibration from real steps."""

from __future__ import annotations

import pytest
from scripted import tiny as tiny


def test_measured_cost_curve_is_relative_and_monotone(tiny):
    from toolspec_core.engine.cost_probe import measure_cost_model

    cm = measure_cost_model(tiny, prefix_len=32, max_nodes=15, repeats=2)
    assert cm.points[1] == 1.0 and set(cm.points) == {1, 2, 3, 4, 6, 8, 12, 16}
    assert all(a <= b + 1e-12 for a, b in zip(cm.curve[1:], cm.curve[2:]))  # never cheaper for more tokens
    assert cm.step_cost(0) == cm.curve[1] == 1.0


def test_cost_model_calibrates_from_real_steps():
    """observe(): the curve follows what steps really cost, relative to 1-token steps; buckets
    decoding never used keep their start-up value; off unless asked."""
    from toolspec_core.engine.budget import CostModel

    fixed = CostModel({1: 1.0, 4: 1.2, 16: 1.5, 64: 3.0})
    fixed.observe(16, 9.0)
    assert fixed.points[16] == 1.5
    cm = CostModel({1: 1.0, 4: 1.2, 16: 1.5, 64: 3.0}, calibrate=True)
    for _ in range(12):  # refits every 16 steps once 8 one-token steps are in
        cm.observe(1, 0.1)
        cm.observe(12, 0.25 * 1.4 / 1.5)  # bucket k=16 (9..16 rows), scaled along the curve: c(16) / c(12)
        cm.observe(16, 0.25)
    assert cm.points[16] == pytest.approx(2.5) and cm.points[4] == 1.2 and cm.points[64] == 3.0
    assert cm.curve[16] == pytest.approx(2.5) and cm.curve[10] > 1.2  # re-interpolated
    assert cm.step_cost(15) == pytest.approx(2.5)


def test_calibration_without_one_row_steps_anchors_on_the_busiest_bucket():
    """A batch rarely runs a 1-row forward: the bucket most steps fall in keeps its point and the
    others are scaled to it by their measured time ratios."""
    from toolspec_core.engine.budget import CostModel

    cm = CostModel({1: 1.0, 8: 1.1, 16: 1.5, 32: 2.4, 64: 4.0}, calibrate=True, max_rows=64)
    for _ in range(20):
        cm.observe(8, 0.20)  # bucket 8: the anchor (most steps), stays 1.1
        cm.observe(8, 0.20)
        cm.observe(14, 0.33 * 1.4 / 1.5)  # bucket 16, scaled by c(16) / c(14): 0.33 / 0.20 * 1.1 = 1.815
    assert cm.points[8] == 1.1 and cm.points[1] == 1.0 and cm.points[32] == 2.4
    assert cm.points[16] == pytest.approx(1.815)
    assert cm.curve[16] == pytest.approx(1.815)


def test_calibration_learns_steps_that_carry_a_prefill_chunk():
    """ensure_rows adds points past the measured ones (on the same line: the curve is unchanged);
    steps of a prefill chunk + decode rows are observed, scaled to their bucket along the curve,
    so the curve at that size follows what they cost under load."""
    from toolspec_core.engine.budget import CostModel

    cm = CostModel({1: 1.0, 16: 2.0, 64: 4.0}, calibrate=True)
    before = list(cm.curve)
    cm.ensure_rows(600)
    assert max(cm.points) == 600 and len(cm.points) > 4
    assert cm.curve[: len(before)] == pytest.approx(before)
    assert cm.curve[600] == pytest.approx(4.0 + (600 - 64) * 2.0 / 48)
    k = min(p for p in cm.points if p >= 530)  # the bucket of a 512-row chunk + 18 decode rows
    for _ in range(16):
        cm.observe(1, 0.1)
        cm.observe(530, 4.0)  # 40x a one-row step: contention made big steps dearer than the probe said
    assert before[64] == 4.0 and 4.0 + (530 - 64) * 2.0 / 48 < 24  # what the probe's line says at 530 rows
    assert cm.points[k] > 30 and cm.curve[530] > 30
    assert cm.points[16] == 2.0  # a bucket no step fell in keeps its value


def test_a_noisy_probe_point_is_pooled_with_its_neighbours_not_flattened_to():
    """A probe point above its right neighbour (c(12) > c(16), the f4f2699 replica's start-up
    curve) is pooled with it into one knot at their mean (centred isotonic regression): the curve
    still rises through 12..16, so rows there are never free (a running maximum made them so, and
    the budget filled trees to 16). A point below one row's cost joins the exact anchor c(1) = 1;
    a curve already in order is interpolated as it is."""
    from toolspec_core.engine.budget import CPU_REFERENCE_CURVE, centered_isotonic, interpolate

    measured = {1: 1.0, 2: 0.891, 3: 1.098, 4: 1.052, 6: 1.085, 8: 1.355, 12: 1.737, 16: 1.597, 17: 2.172, 24: 2.519}
    knots = dict(centered_isotonic(measured))
    assert knots[1.0] == 1.0 and 2 not in knots  # c(2) < c(1) joins the anchor, which keeps its place
    assert knots[14.0] == pytest.approx((1.737 + 1.597) / 2) and knots[3.5] == pytest.approx((1.098 + 1.052) / 2)
    curve = interpolate(measured, 24)
    assert all(a < b for a, b in zip(curve[1:], curve[2:]))  # strictly rising: no row is free
    assert curve[1] == 1.0 and curve[12] < curve[14] < curve[16] < curve[17] == pytest.approx(2.172)
    reference = interpolate(CPU_REFERENCE_CURVE, 64)
    assert [reference[k] for k in CPU_REFERENCE_CURVE] == pytest.approx(list(CPU_REFERENCE_CURVE.values()))
    assert reference[3] == pytest.approx((2.2 + 2.4) / 2)
