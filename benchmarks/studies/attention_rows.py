"""Study: does a verify row's attention equal a decode row's, bit for bit? Result:
benchmarks/results/measurements/attention-rows-cpu-*.json.

Greedy ToolSpec writes plain greedy's tokens only as far as the target computes a token's row
alike in both: plain greedy computes each row alone (one query row over the keys up to it, no
mask), a verify step computes it among the tree's rows (one call, every row's queries stacked,
a mask hiding the keys a row may not see). The linears are made row-invariant on the CPU
(:mod:`toolspec_core.model.cpu_linears`); this study asks the same of the attention, on the
layout :func:`toolspec_core.model.batch_forward.segment_attention` uses (Qwen2.5-0.5B: 2 KV
heads, 7 query heads each, 64 dims; float32, which is also what a bfloat16 CPU model's attention
runs in): for a chain of ``--rows`` tree rows after ``L`` cached keys, the largest absolute
difference of each row against the same row computed alone, and -- for a bfloat16 model, whose
attention output is rounded to bfloat16 -- the share of output elements whose bfloat16 value
differs; whether the float32 GEMMs inside attention give a row the same bits alone as among
other rows (``gemm_rows``); and the same chain through the fixed-order kernel that replaces SDPA
for a reduced-precision model's decode and tree rows (``kernel_rows``). Random inputs (seeded); no
model; no timing unless ``--time`` (the kernel against SDPA per layer call: run that alone).
``--prefill [--baseline REV]`` times only a bf16 prompt chunk's attention per layer: SDPA, this
checkout's kernel and REV's, interleaved (``prefill_timing``).

    python -m benchmarks.studies.attention_rows --json benchmarks/results/measurements/attention-rows-cpu-HW-<commit>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HKV, G, D = 2, 7, 64  # Qwen2.5-0.5B: KV heads, query heads per KV head, head dim
SCALE = D**-0.5


def chain_rows(length: int, rows: int, seed: int = 0, threads: int = 2) -> dict:
    """One chain of ``rows`` tree rows after ``length`` cached keys: the masked call's rows against
    each row alone (the decode call)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    keys = length + rows

    def rand(*shape):  # bfloat16 values held in float32, as a bfloat16 model's attention sees them
        return torch.randn(*shape, generator=gen).bfloat16().float()

    k, v = rand(1, HKV, keys, D), rand(1, HKV, keys, D)  # [1, H_kv, S, D]
    q = rand(1, HKV * G, rows, D)  # [1, H, n, D]
    cols = torch.arange(keys)
    seen = torch.arange(rows)[:, None] + length
    mask = torch.where(cols[None] <= seen, 0.0, torch.finfo(torch.float32).min)[None, None]  # [1, 1, n, S]
    together = F.scaled_dot_product_attention(
        q.reshape(1, HKV, G * rows, D), k, v, attn_mask=mask.repeat(1, 1, G, 1), scale=SCALE
    ).reshape(1, HKV * G, rows, D)
    diff, flips = [], []
    for i in range(rows):
        alone = F.scaled_dot_product_attention(
            q[:, :, i : i + 1].reshape(1, HKV, G, D), k[:, :, : length + i + 1], v[:, :, : length + i + 1], scale=SCALE
        ).reshape(1, HKV * G, D)
        row = together[:, :, i]
        diff.append(float((alone - row).abs().max()))
        flips.append(float((alone.bfloat16() != row.bfloat16()).float().mean()))
    return {
        "cached_keys": length,
        "rows": rows,
        "max_abs_diff_per_row": diff,
        "rows_not_equal": sum(d > 0 for d in diff),
        "bf16_elements_rounded_apart": sum(flips) / rows,
    }


def gemm_rows(length: int, rows: int, threads: int = 2) -> dict:
    """The products inside attention, as plain float32 matmuls: the scores of one decode row's
    query heads (``G`` rows) against ``length`` keys, and the weights times V -- computed alone and
    as the first ``G`` of ``G * rows`` stacked rows. Whether torch's CPU GEMM gives a row the same
    bits whatever rows share its call: if not, no arrangement of SDPA or matmul calls makes a
    verify row equal a decode row, only a kernel with a fixed order per row."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(length, D, generator=gen), torch.randn(length, D, generator=gen)
    q = torch.randn(G * rows, D, generator=gen)
    scores_all, scores_one = q @ k.T, q[:G] @ k.T  # [G * rows, S], [G, S]
    weights = torch.softmax(scores_one, -1)
    pv_all = torch.cat([weights, torch.softmax(scores_all[G:], -1)]) @ v  # [G * rows, D]
    return {
        "keys": length,
        "stacked_rows": G * rows,
        "scores_equal": bool(torch.equal(scores_all[:G], scores_one)),
        "weights_times_v_equal": bool(torch.equal(pv_all[:G], weights @ v)),
    }


def kernel_rows(length: int, rows: int, threads: int = 2) -> dict:
    """The fixed-order kernel (:mod:`toolspec_core.model.rows_attention`) on the same chain: each
    row in the call against the row alone, bit for bit."""
    from toolspec_core.model import rows_attention as ra

    kernel = ra.load()
    if kernel is None:
        return {"cached_keys": length, "rows": rows, "kernel": None}
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(HKV, length + rows, D, generator=gen), torch.randn(HKV, length + rows, D, generator=gen)
    q = torch.randn(rows, HKV * G, D, generator=gen)
    chain = torch.tensor(range(-1, rows - 1))
    together = kernel.rows_attention(q, k, v, chain, length, SCALE)
    equal = [
        bool(
            torch.equal(
                kernel.rows_attention(q[i : i + 1], k, v, torch.tensor([-1]), length + i, SCALE)[0], together[i]
            )
        )
        for i in range(rows)
    ]
    return {"cached_keys": length, "rows": rows, "kernel": "rows_attention", "rows_equal_alone": sum(equal)}


def timing(lengths: list[int], row_counts: list[int], threads: int, repeats: int) -> list[dict]:
    """ms per layer call, the kernel against the grouped masked SDPA call it replaces (float32
    inputs; a bf16 model's rows are converted to float32 for either). Median of ``repeats``."""
    import statistics

    from toolspec_core.model import rows_attention as ra
    from toolspec_core.model.cpu_linears import call_seconds

    kernel = ra.load()
    torch.set_num_threads(threads)
    out = []
    for length in lengths:
        for rows in row_counts:
            gen = torch.Generator().manual_seed(2)
            keys = length + rows
            k, v = torch.randn(1, HKV, keys, D, generator=gen), torch.randn(1, HKV, keys, D, generator=gen)
            q = torch.randn(1, HKV * G, rows, D, generator=gen)
            mask = torch.zeros(1, 1, G * rows, keys)
            chain = ra.rows_parents(None, rows)
            calls = {
                "sdpa": lambda: F.scaled_dot_product_attention(
                    q.reshape(1, HKV, G * rows, D), k, v, attn_mask=mask if rows > 1 else None, scale=SCALE
                ),
            }
            if kernel is not None:
                calls["kernel"] = lambda: ra.rows_attention(kernel, q, k, v, chain, length, SCALE)
            row = {"cached_keys": length, "rows": rows}
            for name, fn in calls.items():
                row[f"{name}_ms"] = round(1e3 * statistics.median(call_seconds(fn, repeats)), 4)
            out.append(row)
    return out


def revision_kernel(rev: str):
    """``rows_attention.cpp`` as git revision ``rev`` had it (with its headers), built beside this
    checkout's kernel -- the A/B's baseline -- and its Python wrapper's input conversion."""
    import subprocess
    import tempfile

    from toolspec_core.model import rows_kernel as rk

    folder = Path(tempfile.mkdtemp(prefix=f"rows-attention-{rev}-"))
    for name in ("rows_attention.cpp", "simd.h"):
        text = subprocess.run(
            ["git", "show", f"{rev}:toolspec_core/model/kernels/{name}"], capture_output=True, text=True, check=True
        ).stdout
        (folder / name).write_text(text)
    source = folder / "rows_attention.cpp"
    return rk.build(source, f"toolspec_rows_attention_{rev}", rk.build_dir(source=source))


def prefill_timing(baseline: str | None, threads: int, rounds: int) -> dict:
    """One layer of a bfloat16 prompt chunk, ms per call: the SDPA path (causal_attention for a first
    chunk, the grouped causal mask after a prefix), this checkout's kernel through its wrapper as
    ``batched_forward`` calls it and, with ``baseline``, that revision's kernel fed as its wrapper
    did (q and the cache widened to float32, the output narrowed back, all inside the timed call).
    The three interleaved ``rounds`` times, medians."""
    import statistics

    from toolspec_core.model import rows_attention as ra
    from toolspec_core.model.batch_forward import causal_attention, causal_mask, grouped_mask, segment_attention
    from toolspec_core.model.cpu_linears import call_seconds

    torch.set_num_threads(threads)
    kernel, old = ra.load(), (revision_kernel(baseline) if baseline else None)
    h = HKV * G
    rows = []
    for prefix, n in ((0, 512), (512, 512), (1024, 300)):
        gen = torch.Generator().manual_seed(prefix + n)
        q = torch.randn(1, h, n, D, generator=gen).bfloat16()  # [1, H, n, D]
        k = torch.randn(1, HKV, prefix + n, D, generator=gen).bfloat16()  # [1, H_kv, S, D]
        v = torch.randn(1, HKV, prefix + n, D, generator=gen).bfloat16()
        parents = ra.rows_parents(None, n)
        if prefix == 0:
            calls = {"sdpa": lambda: causal_attention(q, k, v, SCALE)}
        else:
            mask = grouped_mask(causal_mask(prefix, n, torch.bfloat16, "cpu"), G)
            calls = {"sdpa": lambda: segment_attention(q, k, v, mask, SCALE)}
        calls["kernel"] = lambda: ra.rows_attention(kernel, q, k, v, parents, prefix, SCALE)
        if old is not None:
            calls[f"kernel_{baseline}"] = lambda: (
                old.rows_attention(
                    q[0].transpose(0, 1).float().contiguous(), k[0].float(), v[0].float(), parents, prefix, SCALE
                )
                .reshape(1, n, h * D)
                .to(q.dtype)
            )
        times = {name: [] for name in calls}
        for _ in range(rounds):
            for name, fn in calls.items():
                times[name] += call_seconds(fn, 3)
        rows.append(
            {
                "prefix": prefix,
                "rows": n,
                **{f"{k_}_ms": round(1e3 * statistics.median(t), 2) for k_, t in times.items()},
            }
        )
    return {"threads": threads, "rounds": rounds, "baseline": baseline, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="300,777,1023,1500,1800")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time", action="store_true", help="also time the kernel against SDPA (run it alone)")
    ap.add_argument("--time-rows", default="1,4,17,33")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--prefill", action="store_true", help="only time bf16 prompt chunks (run it alone)")
    ap.add_argument("--baseline", help="with --prefill: also the kernel of this git revision")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.prefill:
        out = {"study": "attention_rows --prefill", "torch": torch.__version__, "machine": platform.machine()}
        out["command"] = "python -m benchmarks.studies.attention_rows " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        out["prefill_chunk_timing"] = prefill_timing(a.baseline, a.threads, max(3, a.repeats // 6))
        for r in out["prefill_chunk_timing"]["rows"]:
            print(r)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        return 0
    runs = [chain_rows(int(n), a.rows, threads=a.threads) for n in a.lengths.split(",")]
    gemms = [gemm_rows(int(n), a.rows, threads=a.threads) for n in a.lengths.split(",")]
    for r in gemms:
        print(f"GEMM, {r['keys']} keys: scores alone = stacked {r['scores_equal']}, P @ V {r['weights_times_v_equal']}")
    kernels = [kernel_rows(int(n), a.rows, threads=a.threads) for n in a.lengths.split(",")]
    for r in kernels:
        print(f"rows_attention, {r['cached_keys']} keys: {r.get('rows_equal_alone')}/{r['rows']} rows equal alone")
    timed = []
    if a.time:
        lengths = [int(n) for n in a.lengths.split(",")]
        timed = timing(lengths, [int(r) for r in a.time_rows.split(",")], a.threads, a.repeats)
        for r in timed:
            print(r)
    for r in runs:
        print(
            f"L={r['cached_keys']:5d}: {r['rows_not_equal']}/{r['rows']} rows differ, max {max(r['max_abs_diff_per_row']):.1e}; "
            f"bf16 elements rounded apart {100 * r['bf16_elements_rounded_apart']:.3f}%"
        )
    out = {
        "study": "attention_rows",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": a.threads,
        "layout": {"kv_heads": HKV, "query_heads_per_kv": G, "head_dim": D, "dtype": "float32"},
        "command": "python -m benchmarks.studies.attention_rows " + " ".join(sys.argv[1:] if argv is None else argv),
        "runs": runs,
        "gemm_rows": gemms,
        "kernel_rows": kernels,
        "timing_ms_per_layer_call": timed,
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
