"""Hardware-aware draft budget: a measured verify-cost curve and the pruning rule built on it.

``cost(k)`` is the time of one target forward of ``k`` new rows over cached prefixes, relative
to ``k = 1`` (plain decoding of one sequence). A batch's trees are cut together to the node set
maximising expected tokens per unit cost (:func:`toolspec_core.spec.tree.allocate_batch`; one
sequence is the batch of one, :func:`~toolspec_core.spec.tree.prune_to_budget`), so the same
rule applies to every tree method and a step never costs more than it is expected to gain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toolspec_core.spec.tree import Allocation, DraftTree, allocate_batch

# c(k) of Qwen2.5-0.5B in fp32 over a ~500-token prefix on a 2-core x86 CPU through the oneDNN /
# F.linear dispatch: the budget's curve when none is measured (``cost_model: reference``).
CPU_REFERENCE_CURVE = {1: 1.0, 2: 2.2, 4: 2.4, 8: 2.7, 16: 3.5, 32: 4.6, 64: 6.6}


def centered_isotonic(points: dict[int, float], anchor: int = 1) -> list[tuple[float, float]]:
    """(k, cost) knots of the increasing curve nearest to measured ``points``: centred isotonic
    regression (Oron & Flournoy, 2017). Adjacent points out of order are pooled (pool adjacent
    violators) and the pool becomes one knot at its mean k and mean cost, so the curve stays
    strictly increasing through it. Why not a running maximum: a probe's noisy point above its
    right neighbours (c(12) > c(16)) made the curve flat up to them, every row there cost
    nothing, and the budget filled trees to the flat's end -- steps of 16 rows at the same
    acceptance as 12. ``anchor``: the exact point (costs are relative to one row's) -- a pool
    holding it keeps its k and cost."""
    pools: list[list] = []  # [sum k, sum cost, n, holds the anchor]

    def knot(pool: list) -> tuple[float, float]:
        if pool[3]:
            return float(anchor), float(points[anchor])
        return pool[0] / pool[2], pool[1] / pool[2]

    for k in sorted(points):
        pools.append([k, points[k], 1, k == anchor])
        while len(pools) > 1 and knot(pools[-2])[1] > knot(pools[-1])[1]:
            b = pools.pop()
            a = pools[-1]
            a[0], a[1], a[2], a[3] = a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] or b[3]
    return [knot(pool) for pool in pools]


def interpolate(points: dict[int, float], max_k: int) -> list[float]:
    """Dense cost list ``c[0..max_k]`` (c[0] unused = 0) from measured points: linear between the
    knots of :func:`centered_isotonic` (a forward of more rows never costs less), past the last
    one along the last two knots' slope."""
    knots = centered_isotonic(points)
    ks, cs_at = [k for k, _ in knots], [c for _, c in knots]
    xs = np.arange(max_k + 1)
    cs = np.interp(xs, ks, cs_at)
    if len(knots) > 1:  # past the last knot: the last segment's slope
        slope = (cs_at[-1] - cs_at[-2]) / (ks[-1] - ks[-2])
        tail = xs > ks[-1]
        cs[tail] = cs_at[-1] + slope * (xs[tail] - ks[-1])
    cs = np.maximum.accumulate(cs)
    cs[0] = 0.0
    return cs.tolist()


@dataclass
class CostModel:
    points: dict[int, float]
    # nodes one sequence's tree is drafted with (the drafters' hint, ``DraftContext.max_nodes``) and
    # the single-sequence part of the curve; the budget itself keeps whatever pays across the batch
    max_nodes: int = 63
    source: str = "reference"
    calibrate: bool = False  # learn the curve from the steps decoding really pays (observe)
    max_rows: int = 0  # rows of a batched forward the curve covers (0: one sequence, max_nodes + 1)

    def __post_init__(self):
        self.max_rows = max(self.max_rows, self.max_nodes + 1)
        self.curve = interpolate(self.points, self.max_rows)
        self._calibration: Calibration | None = None

    def ensure_rows(self, rows: int) -> None:
        """Extend the curve to forwards of ``rows`` rows (past the last point: its last slope), with
        points every ``LADDER`` x rows up to there -- on the extended line, so the curve is
        unchanged -- for calibration to learn what steps that large (a prefill chunk and the
        decoding sequences' rows) really cost."""
        if rows > self.max_rows:
            self.max_rows = rows
            self.curve = interpolate(self.points, self.max_rows)
        k = max(self.points)
        while k < rows:
            k = min(rows, max(k + 1, int(k * LADDER)))
            self.points.setdefault(k, self.curve[k])

    def allocate(self, trees: list[DraftTree], base_rows: int) -> Allocation:
        """The batch's trees cut together (:func:`~toolspec_core.spec.tree.allocate_batch`):
        ``base_rows`` root rows; a prefill chunk sharing the forward does not shrink them. The
        budget alone decides how many nodes each sequence keeps (the curve covers every row a step
        can have, :meth:`ensure_rows`)."""
        return allocate_batch(trees, self.curve, base_rows)

    def observe(self, rows: int, seconds: float) -> None:
        """One verify forward of ``rows`` tokens took ``seconds``; refits the curve from time to time."""
        if not self.calibrate:
            return
        if self._calibration is None:
            self._calibration = Calibration(sorted(self.points))
        fitted = self._calibration.add(rows, seconds, self.points, self.curve)
        if fitted:
            self.points = {**self.points, **fitted}
            self.curve = interpolate(self.points, self.max_rows)

    def step_cost(self, tree_size: int) -> float:
        return self.curve[min(tree_size + 1, len(self.curve) - 1)]

    def to_dict(self) -> dict:
        return {
            "points": {str(k): v for k, v in self.points.items()},
            "max_nodes": self.max_nodes,
            "max_rows": self.max_rows,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> "CostModel":
        """The inverse of ``to_dict`` (a saved curve)."""
        return cls(
            {int(k): float(v) for k, v in d["points"].items()},
            int(d.get("max_nodes", 63)),
            source or d.get("source", "file"),
            max_rows=int(d.get("max_rows", 0)),
        )

    @classmethod
    def cpu_reference(cls, max_nodes: int = 63) -> "CostModel":
        return cls(dict(CPU_REFERENCE_CURVE), max_nodes, "reference")

    @classmethod
    def flat(cls, max_nodes: int = 63) -> "CostModel":
        """An idealised accelerator: verifying k tokens costs as much as one (upper bound)."""
        return cls({1: 1.0, max_nodes + 1: 1.0}, max_nodes, "flat")


LADDER = 1.5  # spacing of the points ``ensure_rows`` adds past the measured ones


class Calibration:
    """Running verify cost per forward size, from real decode steps.

    A start-up probe can be far off what decoding pays (on a shared CPU its k-token forwards
    came out ~25-40% cheaper relative to one token than real steps did, by the A/B
    ``benchmarks/studies/kernel_ab.py`` in git at ``5afc378``), and an accelerator's curve moves with load -- and so does a CPU's
    when other work shares its cores. Every step counts, those with a prefill chunk too (a
    chunk's rows cost what other rows do in the linears; the steps that carry one are where
    the budget prices draft rows, ``tree.allocate``). Each step's seconds go to the bucket of
    the smallest point k >= rows, scaled to k along the current curve (c(k) / c(rows): a step
    of 520 rows says what one of 768 costs); every ``every`` steps a
    bucket with ``min_steps`` recent steps gets median(bucket) / median(anchor bucket), scaled to
    the anchor's point (see ``add``). Buckets
    decoding never uses keep their start-up value, so a too-cheap one gets tried and corrected.
    Thread-safe: concurrent requests share one model.
    """

    def __init__(self, ks: list[int], window: int = 64, min_steps: int = 8, every: int = 16):
        import collections
        import threading

        self.ks, self.every, self.min_steps = list(ks), every, min_steps
        self.times = {k: collections.deque(maxlen=window) for k in self.ks}
        self.count = 0
        self.lock = threading.Lock()

    def add(
        self, rows: int, seconds: float, points: dict[int, float] | None = None, curve: list[float] | None = None
    ) -> dict[int, float] | None:
        """Record one step; now and then the refitted points (relative costs), else None.
        ``curve``: the current dense curve, to scale a step to its bucket's k.

        Buckets are scaled to the curve through an anchor: the 1-row bucket when it has enough
        steps (plain decoding of one sequence), otherwise the bucket most steps fell in -- a batch
        rarely runs a 1-row forward -- which keeps its current value in ``points``.
        """
        k = next((k for k in self.ks if k >= rows), self.ks[-1])
        if curve is not None and rows < k < len(curve) and curve[rows] > 0:
            seconds *= curve[k] / curve[rows]
        with self.lock:
            self.times[k].append(seconds)
            self.count += 1
            if self.count % self.every:
                return None
            full = {k: t for k, t in self.times.items() if len(t) >= self.min_steps}
            if not full:
                return None
            anchor = 1 if 1 in full else max(full, key=lambda k: len(full[k]))
            scale = (points or {}).get(anchor, 1.0) / float(np.median(full[anchor]))
            return {k: max(float(np.median(t)) * scale, 1.0) for k, t in full.items() if k != anchor}
