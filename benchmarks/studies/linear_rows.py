"""Study: a linear layer's time by row count per CPU kernel. Result: benchmarks/results/measurements/linear-rows-cpu-{xeon-bc0b02f,epyc-6e488eb}.json.

Time a linear layer by row count: ``F.linear``, ``x @ W.T`` on a contiguous transposed copy,
oneDNN on a weight reordered once into its blocked layout (the default for 4+ rows), and MKL's
packed GEMM on a weight reordered for 16 rows (inputs zero-padded to 16 rows).

The measurement behind ``toolspec_core.model.cpu_linears.tune_cpu_linears`` (and its ``SMALL_ROWS``): on x86
CPUs the BLAS switches kernels at a few rows, which is what a tree-verify forward hits. Shapes of
the embedded Qwen2.5-0.5B (lm_head 151936x896, MLP 4864x896), float32.

    python -m benchmarks.studies.linear_rows [--threads 2] [--out benchmarks/runs/linear-rows.json]

``cpu-linear-rows.json`` is the Intel Xeon dev box, ``cpu-linear-rows-epyc.json`` an AMD EPYC one (where
``F.linear`` is slow at 1-3 rows too: why ``tune_cpu_linears`` measures that choice at load).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.cost import hardware_string
from toolspec_core.model.cpu_linears import (
    PACKED_ROWS,
    median_seconds,
    mkl_pack,
    onednn_linear,
    onednn_pack,
    packed_linear,
)

SHAPES = {"lm_head": (151936, 896), "mlp_up": (4864, 896)}
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 17, 32, 64, 512)


def median_ms(fn, repeats: int) -> float:
    return 1000 * median_seconds(fn, repeats)


def measure(repeats: int = 5) -> dict:
    out = {}
    for name, (n_out, n_in) in SHAPES.items():
        w = torch.randn(n_out, n_in)
        wt = w.t().contiguous()
        packed = mkl_pack(w, PACKED_ROWS)
        dnn = onednn_pack(w)
        out[name] = {}
        for rows in ROWS:
            x = torch.randn(rows, n_in)
            out[name][rows] = {
                "linear_ms": round(median_ms(lambda: F.linear(x, w), repeats), 2),
                "transposed_ms": round(median_ms(lambda: x @ wt, repeats), 2),
            }
            if dnn is not None:
                out[name][rows]["onednn_ms"] = round(median_ms(lambda: onednn_linear(x, dnn, None), repeats), 2)
            if packed is not None and rows <= PACKED_ROWS:
                out[name][rows]["packed_ms"] = round(
                    median_ms(lambda: packed_linear(x, packed, w, None, PACKED_ROWS), repeats), 2
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/runs/linear-rows.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"hardware": hardware_string(), "times": measure(a.repeats)}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for name, by_rows in res["times"].items():
        for rows, t in by_rows.items():
            packed = f"   packed {t['packed_ms']:8.2f} ms" if "packed_ms" in t else ""
            dnn = f"   oneDNN {t['onednn_ms']:8.2f} ms" if "onednn_ms" in t else ""
            print(
                f"{name:8s} rows {rows:4d}  F.linear {t['linear_ms']:8.2f} ms   x @ W.T {t['transposed_ms']:8.2f} ms{dnn}{packed}"
            )


if __name__ == "__main__":
    main()
