"""A/B of projecting only the rows a verify walk reads (``verify.RowLogits`` under ``Target.lazy_head``)
against projecting every row, on the embedded model, in one process.

Measures (1) lm_head alone at 1-20 rows (what ``LazyHead``'s constants rest on) and (2) whole verify
steps of the start-up cost probe (k tree tokens over a 500-token cache, each right after a 1-token
step, median over shuffled rounds), alternating variant by round. The probe's drafts are random, so
every step stops at the root: the lazy variant pays its first pass only (the cost the budget sees);
a real step that walks out of it pays a second pass, counted in a real sitting's step times.

    python -m benchmarks.lazy_head_ab [--rounds 6] [--out benchmarks/results/measurements/cpu-lazy-head.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

KS = (1, 2, 4, 6, 8, 10, 12, 16, 20, 24)


def head_ms(target, rows=(1, 2, 4, 6, 8, 10, 12, 16, 20), rounds: int = 5) -> dict[int, float]:
    """Median milliseconds of lm_head over ``r`` rows of random hidden states."""
    lm, out = target.model.lm_head, {}
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, lm.in_features, dtype=target.dtype)
            lm(x)
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                lm(x)
                times.append(1000 * (time.perf_counter() - t0))
            out[r] = round(statistics.median(times), 2)
    return out


def measure(rounds: int, repeats: int, prefix: int, ks=KS) -> dict:
    from toolspec_core.budget import paired_cost, probe_steps
    from toolspec_core.target import load_target
    from toolspec_core.verify import LazyHead

    target = load_target(None)
    heads = head_ms(target)
    steps = probe_steps(target, prefix, ks)
    variants = {"all_rows": None, "lazy": LazyHead()}
    samples = {name: {"ms": {k: [] for k in ks}, "rel": {k: [] for k in ks}} for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            target.lazy_head = variants[name]
            secs, rel = paired_cost(lambda k: steps[k](), ks, repeats)
            for k in ks:
                samples[name]["ms"][k].append(1000 * secs[k])
                samples[name]["rel"][k].append(rel[k])
            print(f"round {r} {name}: " + " ".join(f"{k}:{1000 * secs[k]:.0f}ms" for k in ks), flush=True)
    med = {name: {kind: {k: round(statistics.median(v), 3) for k, v in d.items()} for kind, d in s.items()}
           for name, s in samples.items()}
    return {
        "what": "lm_head alone by rows (ms, median); verify steps of the cost probe (k tree tokens over a cache, "
                "paired with a 1-token step), projecting every row vs only the walk's (LazyHead defaults), "
                "alternating rounds, medians; the probe's drafts are random so the lazy variant's steps pay the "
                "first pass only",
        "prefix": prefix, "rounds": rounds, "repeats": repeats, "threads": torch.get_num_threads(),
        "lazy_head": vars(LazyHead()), "lm_head_ms": heads, "median": med,
        "lazy_over_all_ms": {k: round(med["lazy"]["ms"][k] / med["all_rows"]["ms"][k], 3) for k in ks},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/measurements/cpu-lazy-head.json"))
    args = ap.parse_args(argv)
    res = measure(args.rounds, args.repeats, args.prefix)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"lm_head_ms": res["lm_head_ms"], "lazy_over_all_ms": res["lazy_over_all_ms"]}))


if __name__ == "__main__":
    main()
