"""Study: the few-rows kernel's GB/s and GFLOP/s against torch.sum. Result: benchmarks/results/measurements/linear-bandwidth-cpu-avx512-093f8a8.json.

How fast the few-rows kernel reads a weight at one input row (plain decoding's product), against
the machine's read bandwidth (``torch.sum`` over the same weights), per weight shape of the embedded
model; and its compute rate at more rows with one weight kept in cache. Why: one-row products are
memory-bound, so GB/s says how far the kernel is from what the memory allows; many-row products are
bound by the cores, so GFLOP/s with the weight in cache says how far the arithmetic is from the FMA peak.

    python -m benchmarks.studies.linear_bandwidth [--baseline-rev REV] [--out benchmarks/runs/linear-bandwidth.json]

Bandwidth: each shape gets fresh random weights, up to 24 copies and ~2 GB (at least 77 MB: more than
the L3), read round-robin. Compute: one MLP-shaped weight (4864 x 896, 17 MB: in L3) read again and again.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# Qwen2.5-0.5B's weight shapes [out, in]: lm_head, MLP up/gate, MLP down, q/o projections
SHAPES = {"lm_head": (151936, 896), "mlp_up": (4864, 896), "mlp_down": (896, 4864), "attn_q": (896, 896)}


def gb_per_s(fn, weights, x, rounds: int) -> float:
    for w in weights:  # warm-up (page faults, code)
        fn(x, w)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for w in weights:
            fn(x, w)
    dt = (time.perf_counter() - t0) / (rounds * len(weights))
    return weights[0].numel() * 4 / dt / 1e9


def measure(rounds: int, baseline_rev: str | None) -> dict:
    from toolspec_core.model import rows_kernel

    kernel = rows_kernel.load()
    if kernel is None:
        raise SystemExit("the rows kernel does not build on this machine: nothing to measure")
    variants = {"rows_kernel": kernel}
    if baseline_rev:
        from .rows_kernel_ab import baseline_kernel

        variants[f"rows_kernel_{baseline_rev}"] = baseline_kernel(baseline_rev)
    out = {}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k) for _ in range(max(1, min(24, int(2e9 / (n * k * 4)))))]
        x = torch.randn(1, k)
        row = {
            v: round(gb_per_s(lambda x, w, m=m: m.rows_linear(x, w, None), weights, x, rounds), 1)
            for v, m in variants.items()
        }
        row["torch_sum"] = round(gb_per_s(lambda x, w: w.sum(), weights, x, rounds), 1)
        out[name] = row
        print(name, row, flush=True)
    return out


def gflops_in_cache(rounds: int, rows=(1, 8, 16, 24, 32), shape=(4864, 896)) -> dict:
    """{rows: GFLOP/s} of the kernel on one weight reused call after call (kept in cache)."""
    from toolspec_core.model import rows_kernel

    kernel = rows_kernel.load()
    w = torch.randn(*shape)
    out = {}
    for m in rows:
        x = torch.randn(m, shape[1])
        for _ in range(5):  # warm-up: the weight into cache
            kernel.rows_linear(x, w, None)
        rates = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(40):
                kernel.rows_linear(x, w, None)
            rates.append(2 * m * shape[0] * shape[1] * 40 / (time.perf_counter() - t0) / 1e9)
        out[m] = round(sorted(rates)[len(rates) // 2], 1)
    print("GFLOP/s, weight in cache:", out, flush=True)
    return out


def main() -> None:
    from benchmarks.cost import hardware_string

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline-rev", default=None, help="also measure the kernel of this git revision")
    ap.add_argument("--out", default="benchmarks/runs/linear-bandwidth.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {
        "what": "GB/s of weight read by one-row products (x[1, in] . W[out, in]^T) per weight shape of Qwen2.5-0.5B, "
        "random weights (up to 24 copies, ~2 GB) per shape read round-robin; torch_sum = torch.sum over the same "
        "weights (read bandwidth); gflop_per_s_weight_in_cache: the kernel at k rows on one 4864 x 896 weight reused",
        "hardware": hardware_string(),
        "rounds": a.rounds,
        "gb_per_s": measure(a.rounds, a.baseline_rev),
        "gflop_per_s_weight_in_cache": gflops_in_cache(a.rounds),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
