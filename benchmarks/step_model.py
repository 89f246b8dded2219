"""A GPU's forward time per step, from a committed step curve: what the replay target sleeps for.

``toolspec bench --batch ... --target replay --step-model FILE`` makes each replayed step last as
long as the forward of its rows and batch on the GPU the file was measured on, with the GIL
released (``time.sleep``), so the bench's tokens/s become a **projection** for that GPU: the
host's real work on this CPU plus the GPU's forward, with host work the scheduler runs beside the
forward (``Scheduler(overlap=...)``) hidden behind the sleep as it would be behind the GPU.

File format (JSON)::

    {"what": "...", "gpu": "NVIDIA H200", "model": "...", "context": 500,
     "source": {"file": "...", "commit": "...", "code": "...", "mode": "ragged+graphs"},
     "excluded": [{"batch": 1, "rows": 4, "why": "..."}],
     "points": [{"batch": 1, "rows": 1, "forward_ms": 7.51}, ...]}

``points`` are measured forwards: ``batch`` sequences in the step, ``rows`` rows in all (a
sequence's root plus its kept draft nodes). Only ``points`` are read; the rest says where they
came from. How a step of ``b`` sequences and ``r`` rows is priced (:meth:`StepModel.forward_ms`),
with ``q = r / b`` rows per sequence:

1. At each measured batch, linear in ``q`` through that batch's points; below its first point
   the first point's time, past its last the last segment's slope (never below the first point).
   A batch measured at one ``q`` only takes the shape in ``q`` of the nearest batch measured at
   several (its time scaled by that batch's ratio to its own time at the same first ``q``).
2. Across batches, linear in ``b`` between the two measured batches around it; below the
   smallest measured batch that batch's time; past the largest the line through the last two
   (at the same ``q``) -- an extrapolation, which a report says (:meth:`StepModel.measured`).

A step with no rows costs nothing. ``python -m benchmarks.step_model derive`` writes a file from
a ``benchmarks.batch_timing`` step curve (one attention mode's cases, points named as
measured wrongly left out with ``--exclude BATCH:ROWS=why``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from dataclasses import dataclass
from pathlib import Path

CURVES = Path(__file__).resolve().parent / "results" / "curves"
H200_7B = CURVES / "step-model-h200-qwen2.5-7b-451dd39.json"  # the committed H200 graphed 7B-shaped step


def _lerp(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def piecewise(pts: list[tuple[float, float]], x: float) -> float:
    """``pts`` (x, y) sorted by x, at ``x``: linear between points, the first point's y below them,
    the last segment's slope past them (never below the first point's y)."""
    if x <= pts[0][0] or len(pts) == 1:
        return pts[0][1]
    i = bisect.bisect_left([p[0] for p in pts], x)
    if i == len(pts):
        i -= 1
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return max(pts[0][1], _lerp(x, x0, y0, x1, y1))


@dataclass(frozen=True)
class StepModel:
    """Forward milliseconds by (batch, rows), read from a step-model file (module docstring)."""

    points: tuple[tuple[int, int, float], ...]  # (batch, rows, forward_ms)
    name: str = ""

    def __post_init__(self):
        if not self.points:
            raise ValueError("a step model needs at least one point")
        for b, r, ms in self.points:
            if b <= 0 or r < b or ms <= 0:
                raise ValueError(
                    f"step-model point batch={b} rows={r} forward_ms={ms}: need rows >= batch >= 1, ms > 0"
                )

    @classmethod
    def load(cls, path: str | Path) -> StepModel:
        d = json.loads(Path(path).read_text())
        return cls(
            tuple((int(p["batch"]), int(p["rows"]), float(p["forward_ms"])) for p in d["points"]), Path(path).name
        )

    def _curves(self) -> dict[int, list[tuple[float, float]]]:
        """Each measured batch's (rows per sequence, ms), sorted."""
        out: dict[int, list[tuple[float, float]]] = {}
        for b, r, ms in self.points:
            out.setdefault(b, []).append((r / b, ms))
        return {b: sorted(v) for b, v in sorted(out.items())}

    def at_batch(self, b: int, q: float) -> float:
        """Step 1 of the module docstring: a measured batch ``b`` at ``q`` rows per sequence."""
        curves = self._curves()
        pts = curves[b]
        if len(pts) > 1:
            return piecewise(pts, q)
        shaped = [c for c in curves if len(curves[c]) > 1]
        if not shaped:
            return pts[0][1]
        near = min(shaped, key=lambda c: (abs(c - b), c))
        ref = curves[near]
        return pts[0][1] * piecewise(ref, q) / piecewise(ref, pts[0][0])

    def forward_ms(self, batch: int, rows: int) -> float:
        """The modelled forward of one step of ``batch`` sequences and ``rows`` rows (module docstring)."""
        if rows <= 0 or batch <= 0:
            return 0.0
        q = rows / batch
        bs = sorted(self._curves())
        if batch <= bs[0] or len(bs) == 1:
            return self.at_batch(bs[0], q)
        i = bisect.bisect_left(bs, batch)
        if i < len(bs) and bs[i] == batch:
            return self.at_batch(batch, q)
        if i == len(bs):
            i -= 1
        b0, b1 = bs[i - 1], bs[i]
        return max(0.0, _lerp(batch, b0, self.at_batch(b0, q), b1, self.at_batch(b1, q)))

    def measured(self, batch: int) -> bool:
        """Whether ``batch`` lies within the measured batches (else the model extrapolates)."""
        bs = [b for b, _, _ in self.points]
        return min(bs) <= batch <= max(bs)


def derive(curve: dict, mode: str, exclude: dict[tuple[int, int], str], source: dict) -> dict:
    """A step-model file's content from a ``benchmarks.batch_timing`` step curve: ``mode``'s cases,
    those named in ``exclude`` ((batch, rows) -> why) left out and listed."""
    cases = [c for c in curve["cases"] if c["mode"] == mode]
    if not cases:
        raise ValueError(f"the step curve has no {mode!r} cases")
    kept = [c for c in cases if (c["batch"], c["rows"]) not in exclude]
    return {
        "what": f"forward ms per step of {curve.get('model')} ({curve.get('dtype')}, {curve.get('context')}-token "
        f"context) on {curve.get('hardware')}, attention mode {mode}: the replay target's step model "
        "(benchmarks/step_model.py); projections from it are projections, not measurements",
        "gpu": curve.get("hardware"),
        "model": curve.get("model"),
        "context": curve.get("context"),
        "source": {**source, "mode": mode},
        "excluded": [{"batch": b, "rows": r, "why": why} for (b, r), why in sorted(exclude.items())],
        "points": [
            {"batch": c["batch"], "rows": c["rows"], "forward_ms": round(c["forward_ms"], 4)}
            for c in sorted(kept, key=lambda c: (c["batch"], c["rows"]))
        ],
    }


def _exclusion(s: str) -> tuple[tuple[int, int], str]:
    key, _, why = s.partition("=")
    b, r = key.split(":")
    return (int(b), int(r)), why or "excluded"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_model", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("derive", help="a step-model file from a batch_timing step curve")
    d.add_argument("curve", help="a benchmarks.batch_timing JSON (results/measurements/step-curve-*.json)")
    d.add_argument("--mode", default="ragged+graphs")
    d.add_argument("--exclude", action="append", default=[], help="BATCH:ROWS=why, a point measured wrongly")
    d.add_argument("--commit", default="", help="the commit that added the curve")
    d.add_argument("--code", default="", help="the code the curve was measured at")
    d.add_argument("--out", required=True)
    p = sub.add_parser("show", help="a step model's forward ms at these batches and rows per sequence")
    p.add_argument("file", nargs="?", default=str(H200_7B))
    p.add_argument("--batch", default="1,4,16,64,256")
    p.add_argument("--rows-per-seq", default="1,2,4,8,16")
    a = ap.parse_args(argv)
    if a.cmd == "derive":
        source = {"file": a.curve, "commit": a.commit, "code": a.code}
        out = derive(json.loads(Path(a.curve).read_text()), a.mode, dict(map(_exclusion, a.exclude)), source)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        return 0
    m = StepModel.load(a.file)
    qs = [float(x) for x in a.rows_per_seq.split(",")]
    print("| B | " + " | ".join(f"{q:g} rows/seq" for q in qs) + " |")
    print("|---:|" + "---:|" * len(qs))
    for b in (int(x) for x in a.batch.split(",")):
        cells = " | ".join(f"{m.forward_ms(b, round(b * q)):.2f}" for q in qs)
        print(f"| {b}{'' if m.measured(b) else ' (extrapolated)'} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
