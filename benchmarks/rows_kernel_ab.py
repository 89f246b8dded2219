"""A/B of ToolSpec's few-rows CPU kernel (``toolspec_core.rows_kernel``) against the oneDNN /
``F.linear`` dispatch it replaces up to 16 rows, on the embedded model, in one process.

Both variants time the same verify steps (the start-up cost probe's: k tree tokens over a
500-token cache, each k-token forward right after a 1-token one, median over shuffled rounds),
alternating variant by round so a machine whose speed drifts affects both alike. Reports absolute
milliseconds (what plain decoding and every drafting method pay per step) and the cost curve
relative to each variant's own 1-token forward (what the budget sees).

    python -m benchmarks.rows_kernel_ab [--rounds 4] [--out benchmarks/results/measurements/cpu-rows-kernel.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

KS = (1, 2, 3, 4, 6, 8, 12, 16)


def measure(rounds: int, repeats: int, prefix: int, ks=KS, max_rows: int | None = None) -> dict:
    """``max_rows``: let the kernel take forwards up to this many rows (default: its own limit)."""
    from toolspec_core import rows_kernel
    from toolspec_core.budget import paired_cost, probe_steps
    from toolspec_core.target import load_target, tune_cpu_linears

    target = load_target(None, tune_gemm=False)
    if rows_kernel.load() is None:
        raise SystemExit("the rows kernel does not build on this machine: nothing to compare")
    if max_rows is not None:
        rows_kernel.MAX_ROWS = max_rows
    linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    forwards = {}
    for name, on in (("onednn", False), ("rows_kernel", True)):
        for m in linears:
            m.__dict__.pop("forward", None)  # back to nn.Linear.forward before tuning again
        tune_cpu_linears(target.model, rows_kernel=on)
        forwards[name] = [m.forward for m in linears]
    steps = probe_steps(target, prefix, ks)
    samples: dict = {name: {"ms": {k: [] for k in ks}, "rel": {k: [] for k in ks}} for name in forwards}
    for r in range(rounds):
        for name in (("onednn", "rows_kernel") if r % 2 == 0 else ("rows_kernel", "onednn")):
            for m, f in zip(linears, forwards[name]):
                m.forward = f
            secs, rel = paired_cost(lambda k: steps[k](), ks, repeats)
            for k in ks:
                samples[name]["ms"][k].append(1000 * secs[k])
                samples[name]["rel"][k].append(rel[k])
    med = lambda xs: sorted(xs)[len(xs) // 2]
    out = {name: {"ms": {k: round(med(v), 1) for k, v in s["ms"].items()},
                  "cost": {k: round(med(v), 3) for k, v in s["rel"].items()}} for name, s in samples.items()}
    out["rows_kernel_ms_over_onednn"] = {k: round(out["rows_kernel"]["ms"][k] / out["onednn"]["ms"][k], 3) for k in ks}
    return out


def main() -> None:
    from .cost import hardware_string

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="forward sizes (tokens, the 1-token one included)")
    ap.add_argument("--max-rows", type=int, default=None, help="let the kernel take forwards up to this many rows")
    ap.add_argument("--out", default="benchmarks/results/measurements/cpu-rows-kernel.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"what": "one verify forward of k tree tokens over a cache of --prefix tokens, embedded Qwen2.5-Coder-0.5B float32: "
                   "ToolSpec's few-rows kernel (rows_kernel, up to 16 rows) vs the oneDNN / F.linear dispatch (onednn); "
                   "median ms and cost relative to the variant's own 1-token forward",
           "hardware": hardware_string(), "prefix": a.prefix, "rounds": a.rounds,
           "kernel_max_rows": a.max_rows, **measure(a.rounds, a.repeats, a.prefix, tuple(int(k) for k in a.ks.split(",")), a.max_rows)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
