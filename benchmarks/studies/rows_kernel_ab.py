"""Study: whole verify forwards, the few-rows kernel vs the oneDNN dispatch. Result: benchmarks/results/measurements/rows-kernel-vs-onednn-cpu-avx512-afe9e69.json.

A/B of ToolSpec's few-rows CPU kernel (``toolspec_core.model.rows_kernel``) against the oneDNN /
``F.linear`` dispatch it replaces up to 16 rows, on the embedded model, in one process.

Both variants time the same verify steps (the start-up cost probe's: k tree tokens over a
500-token cache, each k-token forward right after a 1-token one, median over shuffled rounds),
alternating variant by round so a machine whose speed drifts affects both alike. Reports absolute
milliseconds (what plain decoding and every drafting method pay per step) and the cost curve
relative to each variant's own 1-token forward (what the budget sees).

    python -m benchmarks.studies.rows_kernel_ab [--rounds 4] [--out benchmarks/runs/rows-kernel-ab.json]

``--baseline-rev REV`` compares the kernel against the kernel source of another git revision instead of
oneDNN (both built here, same forwards, same alternation): how a kernel change is measured
(e.g. ``--baseline-rev REV --ks 1,4,6,7,8,10,12,16 --rounds 6``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

KS = (1, 2, 3, 4, 6, 8, 12, 16)


def baseline_kernel(rev: str):
    """The rows kernel as it was at git revision ``rev``, built here under its own module name."""
    import subprocess
    import tempfile

    from toolspec_core.model import rows_kernel

    rel = rows_kernel.SOURCE.relative_to(Path(__file__).resolve().parents[1])
    src = subprocess.run(["git", "show", f"{rev}:{rel}"], check=True, capture_output=True, text=True).stdout
    tag = subprocess.run(
        ["git", "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    out = Path(tempfile.mkdtemp(prefix=f"rows_kernel_{tag}_"))
    (out / "rows_linear.cpp").write_text(src)
    return rows_kernel.build(out / "rows_linear.cpp", f"toolspec_rows_linear_{tag}", out)


def measure(
    rounds: int, repeats: int, prefix: int, ks=KS, max_rows: int | None = None, baseline_rev: str | None = None
) -> dict:
    """``max_rows``: let the kernel take forwards up to this many rows (default: its own limit).
    ``baseline_rev``: the other variant is that revision's kernel (same dispatch around it), not oneDNN."""
    from toolspec_core.engine.cost_probe import paired_cost, probe_steps
    from toolspec_core.model import rows_kernel
    from toolspec_core.model.cpu_linears import tune_cpu_linears
    from toolspec_core.model.target import load_target

    target = load_target(None, tune_gemm=False)
    kernel = rows_kernel.load()
    if kernel is None:
        raise SystemExit("the rows kernel does not build on this machine: nothing to compare")
    if max_rows is not None:
        rows_kernel.MAX_ROWS = max_rows
    linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    old = baseline_kernel(baseline_rev) if baseline_rev else None
    variants = (
        [(f"rows_kernel_{baseline_rev}", old), ("rows_kernel", kernel)]
        if old
        else [("onednn", None), ("rows_kernel", kernel)]
    )
    forwards = {}
    for name, mod in variants:
        for m in linears:
            m.__dict__.pop("forward", None)  # back to nn.Linear.forward before tuning again
        tune_cpu_linears(target.model, rows_kernel=mod is not None, kernel_module=mod)
        forwards[name] = [m.forward for m in linears]
    equal = {}
    if old is not None:
        g = torch.Generator().manual_seed(0)
        for m in linears[:7]:  # same arithmetic expected: say so before timing it
            x = torch.randn(max(ks), m.in_features, generator=g)
            same = all(
                torch.equal(old.rows_linear(x[:r], m.weight, m.bias), kernel.rows_linear(x[:r], m.weight, m.bias))
                for r in ks
            )
            equal[str(tuple(m.weight.shape))] = same
            print(
                f"{tuple(m.weight.shape)}: outputs {'bit for bit equal' if same else 'DIFFER'} at {ks} rows", flush=True
            )
    steps = probe_steps(target, prefix, ks)
    names = list(forwards)
    samples: dict = {name: {"ms": {k: [] for k in ks}, "rel": {k: [] for k in ks}} for name in forwards}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            for m, f in zip(linears, forwards[name]):
                m.forward = f
            secs, rel = paired_cost(lambda k: steps[k](), ks, repeats)
            for k in ks:
                samples[name]["ms"][k].append(1000 * secs[k])
                samples[name]["rel"][k].append(rel[k])
    med = lambda xs: sorted(xs)[len(xs) // 2]
    out = {
        name: {
            "ms": {k: round(med(v), 1) for k, v in s["ms"].items()},
            "cost": {k: round(med(v), 3) for k, v in s["rel"].items()},
        }
        for name, s in samples.items()
    }
    out[f"rows_kernel_ms_over_{names[0]}"] = {
        k: round(out["rows_kernel"]["ms"][k] / out[names[0]]["ms"][k], 3) for k in ks
    }
    if equal:  # the first layer's linears (every shape the model has), both kernels, every k of the run
        out["bit_for_bit_equal_by_weight_shape"] = equal
    return out


def main() -> None:
    from benchmarks.cost import hardware_string

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="forward sizes (tokens, the 1-token one included)")
    ap.add_argument("--max-rows", type=int, default=None, help="let the kernel take forwards up to this many rows")
    ap.add_argument("--baseline-rev", default=None, help="compare against the kernel of this git revision, not oneDNN")
    ap.add_argument("--out", default="benchmarks/runs/rows-kernel-ab.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    other = (
        f"the kernel of git revision {a.baseline_rev} (rows_kernel_{a.baseline_rev})"
        if a.baseline_rev
        else "the oneDNN / F.linear dispatch (onednn)"
    )
    res = {
        "what": "one verify forward of k tree tokens over a cache of --prefix tokens, embedded Qwen2.5-Coder-0.5B float32: "
        f"ToolSpec's few-rows kernel (rows_kernel) vs {other}; "
        "median ms and cost relative to the variant's own 1-token forward",
        "hardware": hardware_string(),
        "prefix": a.prefix,
        "rounds": a.rounds,
        "kernel_max_rows": a.max_rows,
        **measure(a.rounds, a.repeats, a.prefix, tuple(int(k) for k in a.ks.split(",")), a.max_rows, a.baseline_rev),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
