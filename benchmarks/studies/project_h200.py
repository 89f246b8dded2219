"""A projection, not a measurement: ToolSpec against batched plain greedy on the H200, from the
committed graphed 7B-shaped step curve and a replay run's host time, rows and MAT.

A step of B sequences costs the H200 forward of its rows (``step-curve-h200-qwen2.5-7b-451dd39.json``,
ragged + CUDA graphs: B rows, B x 4 rows and B x 16 rows measured; linear between them in rows
per sequence) plus the host time per step the replay measured on this CPU at that B (its
``host_ms_per_step``; the H200 machine's host CPU is not this one). Plain greedy yields B tokens
a step, ToolSpec B x MAT (the replay's MAT of the 0.5B model's recorded outputs: the 7B model's
acceptance is not known here).

    python -m benchmarks.studies.project_h200 --replay benchmarks/results/batch-replay-....json \\
        --out benchmarks/results/measurements/projection-h200-....json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CURVE = Path(__file__).resolve().parents[1] / "results" / "measurements" / "step-curve-h200-qwen2.5-7b-451dd39.json"


def forward_ms(cases: list[dict], b: int, rows_per_seq: float) -> float | None:
    """The graphed step's forward at B for this many rows a sequence (linear between the points)."""
    pts = sorted(
        (c["rows"] / c["batch"], c["forward_ms"]) for c in cases if c["mode"] == "ragged+graphs" and c["batch"] == b
    )
    if not pts:
        return None
    if rows_per_seq <= pts[0][0]:
        return pts[0][1]
    for (r0, f0), (r1, f1) in zip(pts, pts[1:]):
        if rows_per_seq <= r1:
            return f0 + (f1 - f0) * (rows_per_seq - r0) / (r1 - r0)
    (r0, f0), (r1, f1) = pts[-2], pts[-1]  # past the last point: the last slope
    return f1 + (f1 - f0) * (rows_per_seq - r1) / (r1 - r0)


def project(curve: dict, replay: dict, batches=(4, 16, 64)) -> list[dict]:
    runs = {(r["benchmark"], r["method"], r["batch"]): r for r in replay["runs"]}
    out = []
    for b in batches:
        ar, ts = runs.get(("pooled", "ar", b)), runs.get(("pooled", "toolspec", b))
        if ar is None or ts is None:
            continue
        f_ar = forward_ms(curve["cases"], b, 1.0)
        f_ts = forward_ms(curve["cases"], b, ts["rows_per_step"] / b)
        if f_ar is None or f_ts is None:
            continue
        step_ar = f_ar + ar["host_ms_per_step"]
        step_ts = f_ts + ts["host_ms_per_step"]
        zero_host = ts["mat"] * f_ar / f_ts  # what it would be with no host work at all
        out.append(
            {
                "batch": b,
                "mat": ts["mat"],
                "rows_per_seq": ts["rows_per_step"] / b,
                "plain_forward_ms": f_ar,
                "plain_host_ms": ar["host_ms_per_step"],
                "toolspec_forward_ms": f_ts,
                "toolspec_host_ms": ts["host_ms_per_step"],
                "plain_tokens_per_s": 1000 * b / step_ar,
                "toolspec_tokens_per_s": 1000 * b * ts["mat"] / step_ts,
                "speedup": ts["mat"] * step_ar / step_ts,
                "speedup_without_host": zero_host,
            }
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replay", required=True, help="a bench --batch report (JSON) of the replay target")
    ap.add_argument("--curve", default=str(CURVE))
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    rows = project(json.loads(Path(a.curve).read_text()), json.loads(Path(a.replay).read_text()))
    print(
        "| B | MAT | rows/seq | plain: forward + host ms | ToolSpec: forward + host ms | projected ToolSpec vs plain | with no host work |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['mat']:.2f} | {r['rows_per_seq']:.1f} | {r['plain_forward_ms']:.1f} + {r['plain_host_ms']:.1f} "
            f"| {r['toolspec_forward_ms']:.1f} + {r['toolspec_host_ms']:.1f} | **{r['speedup']:.2f}x** | {r['speedup_without_host']:.2f}x |"
        )
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "what": __doc__.split("\n\n")[0],
                    "curve": Path(a.curve).name,
                    "replay": Path(a.replay).name,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
