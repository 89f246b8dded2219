"""Study: the CPU forward of a prompt, part by part. Result: benchmarks/results/measurements/prefill-forward-*.json.

Where a float32 prefill's time goes on the CPU and what each candidate change buys, on the
load test's long tool prompts (the prompts :mod:`benchmarks.studies.prefill_vllm` sets against
vLLM's prefill):

* ``linears``: GFLOP/s of each way to run the model's projections at prefill row counts (256,
  512, 1024): ``F.linear`` (MKL), oneDNN on a weight reordered at load for 16 rows (what
  :mod:`toolspec_core.model.cpu_linears` serves every step of over 16 rows with) or for the row
  count itself, MKL's packed GEMM at the row count, and the fused q/k/v and gate/up weights
  (one GEMM instead of three / two) -- against this CPU's peak, they say whether the GEMMs have
  anything left.
* ``attention``: one layer's prefill attention (Qwen2.5-0.5B: 14 query heads, 2 KV heads, 64
  dims) at chunk shapes, through a causal mask tensor (the grouped-query rows of
  :func:`~toolspec_core.model.batch_forward.segment_attention`) against
  :func:`~toolspec_core.model.batch_forward.causal_attention` (a first chunk: no mask, causal
  blocks skipped; swept over ``--attention-rows``, interleaved ``--attention-rounds`` times) or,
  for a chunk after a cached prefix, :func:`split_attention` (prefix and chunk apart, merged by
  log-sum-exp). ``causal_from_rows``: the fewest rows from which the causal kernel was faster at
  every larger row count, the figure to hold
  :data:`~toolspec_core.model.batch_forward.CAUSAL_MIN_ROWS` against. The attention part alone (``--parts attention``) loads no model.
* ``prefill``: whole prefills (:func:`toolspec_core.engine.loop.prefill`) of the prompts,
  512-row chunks and the whole prompt at once, the forward with a causal mask tensor and HF's
  rotary embedding (``mask_tensor_hf_rope``) and the served one (``causal_kernel_rope``: the causal kernel for
  first chunks, ``rope``), interleaved
  ``--rounds`` times; best and median tokens/s (a shared machine: the best says what the kernels
  do, the spread what other work does).
* ``breakdown``: where one served prefill's time goes, by the profiler's per-operator self time,
  grouped into linears (oneDNN / MKL / the rows kernel), attention (SDPA), KV-cache writes and
  gathers, elementwise work (RMSNorm, rotary, SwiGLU, residuals), and the framework's share (the
  wall time of an unprofiled prefill less every operator's time: Python, the scheduler, the
  step runner), on one 512-row first chunk, the scheduler's chunks of a whole prompt and the whole
  prompt in one forward -- each against the GEMM ceiling (the linears' FLOP at the measured
  rate of a 512-row MLP GEMM, :func:`benchmarks.studies.prefill_vllm.gemm_gflops`).
* ``env``: the process environment a served prefill runs under -- OpenMP thread binding
  (``OMP_PROC_BIND`` / ``OMP_PLACES``; torch's OpenMP here is libgomp) and the C allocator
  (tcmalloc or jemalloc preloaded) -- each configuration a fresh process loading the served
  target, the configurations interleaved ``--rounds`` times; per configuration the median over
  prompts and rounds of its prefill time against the plain process's in the same round.
* ``compile`` (``--compile``): the decoder traced by ``torch.compile`` (inductor, ``freezing``:
  weights constant-folded and prepacked) for a whole prompt of ``--compile-rows`` rows at once
  (no cache, causal SDPA), the compile time of each shape, its rate against the same function
  eager and against the served path, and its largest hidden-state difference.

    flock /tmp/toolspec-cpu.lock python -m benchmarks.studies.prefill_forward --compile \\
        --out benchmarks/results/measurements/prefill-forward-cpu-HW-SHA.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from toolspec_core.model.cpu_linears import call_seconds

SHAPES = {"q/o": (896, 896), "k/v": (128, 896), "qkv": (1152, 896), "up": (4864, 896), "gate+up": (9728, 896),
          "down": (896, 4864)}  # fmt: skip
FUSED_OF = {"qkv": ("q/o", "k/v", "k/v"), "gate+up": ("up", "up")}


def best_seconds(fn, repeats: int) -> float:
    return min(call_seconds(fn, repeats))


def linear_rates(rows_list=(256, 512, 1024), repeats: int = 7) -> list[dict]:
    """GFLOP/s (best of ``repeats``) per kernel per projection shape per row count."""
    import torch
    import torch.nn.functional as F

    from toolspec_core.model.cpu_linears import mkl_pack, onednn_linear, onednn_pack

    out = []
    with torch.inference_mode():
        for rows in rows_list:
            for name, (o, i) in SHAPES.items():
                w, x = torch.randn(o, i), torch.randn(rows, i)
                b = torch.randn(o) if name in ("k/v", "qkv") else None
                d16, drows, mkl = onednn_pack(w, 16), onednn_pack(w, rows), mkl_pack(w, rows)
                flop = 2 * rows * o * i
                kernels = {
                    "F.linear": lambda: F.linear(x, w, b),
                    "onednn_packed16": lambda: onednn_linear(x, d16, b),
                    "onednn_packed_rows": lambda: onednn_linear(x, drows, b),
                    "mkl_packed_rows": lambda: torch.ops.mkl._mkl_linear(x, mkl, w, b, rows),
                }
                row = {"rows": rows, "weight": name, "out_in": [o, i]}
                for k, fn in kernels.items():
                    row[k + "_gflops"] = flop / best_seconds(fn, repeats) / 1e9
                row["onednn_packed16_ms"] = flop / row["onednn_packed16_gflops"] / 1e6
                out.append(row)
                print(json.dumps(row), flush=True)
    by = {(r["rows"], r["weight"]): r for r in out}
    for rows in rows_list:  # a fused GEMM against its parts run one after another (oneDNN, 16-row layout)
        for fused, parts in FUSED_OF.items():
            r = by[(rows, fused)]
            r["parts_ms"] = sum(by[(rows, p)]["onednn_packed16_ms"] for p in parts)
            r["fused_speedup"] = r["parts_ms"] / r["onednn_packed16_ms"]
    return out


def fused_exact(rows_list=(1, 3, 5, 17, 100, 512, 1024)) -> bool:
    """Whether oneDNN on a concatenated weight gives bitwise the columns of the separate weights."""
    import torch

    from toolspec_core.model.cpu_linears import onednn_linear, onednn_pack

    torch.manual_seed(0)
    ok = True
    with torch.inference_mode():
        for outs in ((896, 128, 128), (4864, 4864)):
            ws = [torch.randn(o, 896) * 0.05 for o in outs]
            bs = [torch.randn(o) for o in outs]
            fused, parts = onednn_pack(torch.cat(ws)), [onednn_pack(w) for w in ws]
            for n in rows_list:
                x = torch.randn(n, 896)
                y = onednn_linear(x, fused, torch.cat(bs))
                ok &= torch.equal(y, torch.cat([onednn_linear(x, p, b) for p, b in zip(parts, bs)], -1))
    return bool(ok)


def split_attention(q, k, v, prefix: int, scale: float):
    """A chunk after a cached prefix without a mask tensor: its rows over the prefix (no mask) and
    over themselves (``is_causal``), merged by their log-sum-exps -> [1, n, H * D]."""
    import torch

    _, h, n, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    old, lse_old = flash(q.reshape(1, hkv, g * n, d), k[:, :, :prefix], v[:, :, :prefix], scale=scale)[:2]
    kn, vn = k[:, :, prefix:].repeat_interleave(g, 1), v[:, :, prefix:].repeat_interleave(g, 1)
    new, lse_new = flash(q, kn, vn, is_causal=True, scale=scale)[:2]
    old, lse_old, lse_new = old.reshape(1, h, n, d), lse_old.reshape(1, h, n, 1), lse_new.unsqueeze(-1)
    top = torch.maximum(lse_old, lse_new)
    a, b = torch.exp(lse_old - top), torch.exp(lse_new - top)
    return ((old * a + new * b) / (a + b)).transpose(1, 2).reshape(1, n, h * d)


ATTENTION_ROWS = tuple(range(128, 1025, 64))  # first chunks the sweep times (``--attention-rows``)


def attention_rates(rows=ATTENTION_ROWS, repeats: int = 5, rounds: int = 7, block: int = 0) -> list[dict]:
    """One layer's prefill attention: causal mask tensor vs the causal kernel.

    First chunks (no cached prefix) of each of ``rows``: the grouped masked call
    (:func:`~toolspec_core.model.batch_forward.segment_attention`) against
    :func:`~toolspec_core.model.batch_forward.causal_attention`, the two interleaved row count by
    row count, ``rounds`` times (best of ``repeats`` each), so other work on the machine slows
    both alike: per row count the best time of each over the rounds and the median of the rounds'
    ratios (``speedup``, masked / causal). Then two chunks after a 512-row prefix, masked against
    :func:`split_attention`. ``block`` > 0: the masked call against :func:`~toolspec_core.model.batch_forward.blocked_attention` in
    row blocks of ``block`` instead, for every case. ``max_abs_diff``: the two outputs' largest
    difference."""
    import torch

    from toolspec_core.model.batch_forward import (
        blocked_attention,
        blocked_masks,
        causal_attention,
        causal_mask,
        grouped_mask,
        segment_attention,
    )

    h, hkv, d = 14, 2, 64
    g, scale = h // hkv, d**-0.5
    cases = [(0, n) for n in rows] + [(512, 400), (512, 512)]
    gen = torch.Generator().manual_seed(0)
    inputs = {}
    for prefix, n in cases:
        q = torch.randn(1, h, n, d, generator=gen)
        k, v = torch.randn(1, hkv, prefix + n, d, generator=gen), torch.randn(1, hkv, prefix + n, d, generator=gen)
        mg = grouped_mask(causal_mask(prefix, n, torch.float32, "cpu"), g)
        other = (lambda q=q, k=k, v=v: causal_attention(q, k, v, scale)) if prefix == 0 else (
            lambda q=q, k=k, v=v, prefix=prefix: split_attention(q, k, v, prefix, scale))  # fmt: skip
        if block:  # the masks made once, as the forward makes them once a step
            bl = blocked_masks(prefix, n, g, torch.float32, "cpu", block)
            other = lambda q=q, k=k, v=v, prefix=prefix, bl=bl: blocked_attention(q, k, v, bl, prefix, scale)  # noqa: E731
        inputs[(prefix, n)] = (lambda q=q, k=k, v=v, mg=mg: segment_attention(q, k, v, mg, scale)), other
    times: dict[tuple, list[tuple[float, float]]] = {c: [] for c in cases}
    with torch.inference_mode():
        for _ in range(rounds):
            for c in cases:
                masked, causal = inputs[c]
                times[c].append((best_seconds(masked, repeats), best_seconds(causal, repeats)))
        out = []
        for prefix, n in cases:
            masked, causal = inputs[(prefix, n)]
            diff = (masked() - causal()).abs().max()
            pairs = times[(prefix, n)]
            row = {
                "prefix": prefix,
                "rows": n,
                "mask_ms": min(m for m, _ in pairs) * 1e3,
                "causal_kernel_ms": min(c for _, c in pairs) * 1e3,
                "speedup": statistics.median(m / c for m, c in pairs),
                "speedup_of_best": min(m for m, _ in pairs) / min(c for _, c in pairs),
                "rounds_causal_faster": sum(m > c for m, c in pairs),
                "rounds": len(pairs),
                "max_abs_diff": float(diff),
                "bitwise_equal": bool(diff == 0),
            }
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def causal_from_rows(rows: list[dict]) -> int | None:
    """The fewest first-chunk rows from which the causal kernel was faster (median of the rounds'
    ratios above 1) at that row count and at every larger one measured; None when it never was."""
    first = sorted((r for r in rows if r["prefix"] == 0), key=lambda r: r["rows"])
    start = None
    for r in first:
        if r["speedup"] > 1:
            start = r["rows"] if start is None else start
        else:
            start = None
    return start


# the two forwards whole prefills compare
MASKED = "mask_tensor_hf_rope"  # a causal mask tensor for every chunk, HF's rotary embedding
SERVED = "causal_kernel_rope"  # the served forward: the causal kernel for first chunks, ``rope``


def hf_rope(x, cos, sin):
    """HF's rotary embedding (``x * cos + rotate_half(x) * sin``): the ``mask_tensor_hf_rope`` configuration."""
    import torch

    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


def prefill_rates(target, ids: list[list[int]], chunks=(512, 4096), rounds: int = 3) -> list[dict]:
    """Prefill tokens/s per (chunk, forward), every prompt under every configuration in turn:
    ``mask_tensor_hf_rope`` (a causal mask tensor, HF's rotary embedding) and ``causal_kernel_rope`` (the
    served forward: :func:`~toolspec_core.model.batch_forward.causal_attention` for first chunks
    and :func:`~toolspec_core.model.batch_forward.rope`)."""
    from toolspec_core.engine.loop import prefill
    from toolspec_core.model import batch_forward

    served_rope = batch_forward.rope

    def use(forward: str) -> None:
        batch_forward.CAUSAL_KERNEL = forward == SERVED
        batch_forward.rope = served_rope if forward == SERVED else hf_rope

    configs = [(c, f) for c in chunks for f in (MASKED, SERVED)]
    rates: dict[tuple, list[float]] = {c: [] for c in configs}
    try:
        for c, f in configs:  # warm-up: first calls of each shape
            use(f)
            prefill(target, ids[0], chunk=c)
        for _ in range(rounds):
            for p in ids[1:]:
                for c, f in configs:
                    use(f)
                    (seconds,) = call_seconds(lambda: prefill(target, p, chunk=c), 1, warm=False)
                    rates[(c, f)].append(len(p) / seconds)
    finally:
        use(SERVED)
    rows = []
    for (c, f), r in rates.items():
        row = {
            "chunk": c,
            "forward": f,
            "prompts": len(ids) - 1,
            "rounds": rounds,
            "best_tokens_per_s": max(r),
            "median_tokens_per_s": statistics.median(r),
            "all_tokens_per_s": r,
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "all_tokens_per_s"}), flush=True)
    by = {(r["chunk"], r["forward"]): r for r in rows}
    for c in chunks:  # per prompt and round, the served forward against the masked one side by side
        pairs = [a / b for a, b in zip(by[(c, SERVED)]["all_tokens_per_s"], by[(c, MASKED)]["all_tokens_per_s"])]
        by[(c, SERVED)]["speedup_median_of_pairs"] = statistics.median(pairs)
    return rows


PART_OF = {  # profiler operator name -> part (first match by substring; the rest: "other ops")
    "linears": ("_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm", "_mkl_linear", "rows_linear"),
    "attention": ("scaled_dot_product", "flash_attention"),
    "kv_cache": ("index_copy", "index_select", "aten::copy_", "aten::narrow"),
    "elementwise": ("aten::mul", "aten::add", "aten::sub", "aten::pow", "aten::mean", "aten::rsqrt", "aten::silu",
                    "aten::neg", "aten::cat", "aten::to", "aten::embedding", "aten::where", "aten::repeat",
                    "aten::zeros", "aten::new_zeros", "aten::fill_", "aten::cos", "aten::sin", "aten::matmul",
                    "aten::bmm"),
}  # fmt: skip


def part_of(name: str) -> str:
    for part, keys in PART_OF.items():
        if any(k in name for k in keys):
            return part
    return "other ops"


def ceiling_gflops(rows: int = 512, repeats: int = 10) -> float:
    """The GEMM ceiling here: the faster of ``F.linear`` and oneDNN on a weight reordered at load
    (the served kernel) on the model's MLP shape at ``rows`` rows, best of ``repeats``."""
    import torch
    import torch.nn.functional as F

    from toolspec_core.model.cpu_linears import onednn_linear, onednn_pack

    with torch.inference_mode():
        x, w = torch.randn(rows, 896), torch.randn(4864, 896)
        dnn = onednn_pack(w)
        best = best_seconds(lambda: F.linear(x, w), repeats)
        if dnn is not None:
            best = min(best, best_seconds(lambda: onednn_linear(x, dnn, None), repeats))
    return 2 * rows * 896 * 4864 / best / 1e9


def prefill_breakdown(target, ids: list[list[int]], rounds: int = 3) -> dict:
    """Where a served prefill's time goes: per case (one 512-row first chunk; the whole prompt
    in 512-row chunks, the scheduler's; the whole prompt in one forward), the best unprofiled
    wall time over ``rounds`` interleaved rounds and every prompt, and, from one profiled run of
    each, the seconds per part (:data:`PART_OF`) scaled to that wall time's prompt; the
    framework's share is the wall time less the operators' (Python, scheduler, step runner)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.studies.prefill_vllm import FLOP_PER_TOKEN
    from toolspec_core.engine.loop import prefill

    gflops = ceiling_gflops()
    cases = [("first_chunk_512", 512, 512)] + [("prompt_chunks_512", None, 512), ("prompt_whole", None, 4096)]
    prompts = ids[1:]
    for _, rows, c in cases:  # warm-up: first calls of each shape
        prefill(target, (ids[0] * 2)[: rows or len(ids[0])], chunk=c)
    walls: dict[tuple, list[float]] = {}
    for _ in range(rounds):
        for pi, p in enumerate(prompts):
            for name, rows, c in cases:
                q = p[:rows] if rows else p
                (sec,) = call_seconds(lambda: prefill(target, q, chunk=c), 1, warm=False)
                walls.setdefault((name, pi), []).append(sec)
    out = {"ceiling_gflops": gflops, "ceiling_tokens_per_s": gflops * 1e9 / FLOP_PER_TOKEN, "cases": []}
    for name, rows, c in cases:
        parts: dict[str, float] = {}
        tokens, wall = 0, 0.0
        for pi, p in enumerate(prompts):
            q = p[:rows] if rows else p
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                (psec,) = call_seconds(lambda: prefill(target, q, chunk=c), 1, warm=False)
            best = min(walls[(name, pi)])
            scale = best / psec  # the profiled run's operators, scaled to the best unprofiled wall
            ops = 0.0
            for ev in prof.key_averages():
                sec = ev.self_cpu_time_total / 1e6 * scale
                parts[part_of(ev.key)] = parts.get(part_of(ev.key), 0.0) + sec
                ops += sec
            parts["framework"] = parts.get("framework", 0.0) + max(0.0, best - ops)
            tokens += len(q)
            wall += best
        row = {
            "case": name,
            "chunk": c,
            "prompts": len(prompts),
            "tokens": tokens,
            "best_tokens_per_s": tokens / wall,
            "share_of_ceiling": tokens / wall / out["ceiling_tokens_per_s"],
            "linears_at_ceiling_s": tokens * FLOP_PER_TOKEN / gflops / 1e9,
            "seconds": {k: round(v, 4) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
            "share": {k: round(v / wall, 4) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
            "top_ops": [(e.key, round(e.self_cpu_time_total / 1e3, 2)) for e in sorted(
                prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]],
        }  # fmt: skip
        row["linears_gflops"] = tokens * FLOP_PER_TOKEN / parts.get("linears", float("nan")) / 1e9
        row["median_round_tokens_per_s"] = statistics.median(
            tokens / sum(walls[(name, pi)][r] for pi in range(len(prompts))) for r in range(rounds)
        )
        out["cases"].append(row)
        print(json.dumps(row), flush=True)
    pairs = [
        a / b
        for pi in range(len(prompts))
        for a, b in zip(walls[("prompt_chunks_512", pi)], walls[("prompt_whole", pi)])
    ]
    out["whole_over_chunks_median_of_pairs"] = statistics.median(pairs)  # > 1: the whole prompt at once is faster
    print(json.dumps({"whole_over_chunks_median_of_pairs": out["whole_over_chunks_median_of_pairs"]}), flush=True)
    return out


LIBDIR = "/usr/lib/x86_64-linux-gnu"
ENVS = {  # configuration -> environment added to a fresh process (``env``)
    "plain": {},
    "bind_close": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "tcmalloc": {"LD_PRELOAD": f"{LIBDIR}/libtcmalloc_minimal.so.4"},
    "jemalloc": {"LD_PRELOAD": f"{LIBDIR}/libjemalloc.so.2"},
    "tcmalloc_bind": {"LD_PRELOAD": f"{LIBDIR}/libtcmalloc_minimal.so.4", "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
}  # fmt: skip


def env_worker(n_prompts: int, span: str, chunk: int, threads: int) -> None:
    """One configuration's process: load the served target, warm up on the first prompt, then
    print one JSON line of each timed prompt's prefill seconds and its process's sys / user CPU."""
    import resource

    import torch

    from benchmarks.data import prompt_ids
    from benchmarks.studies.prefill_vllm import long_prompts
    from toolspec_core.engine.loop import prefill
    from toolspec_core.model.target import load_target

    torch.set_num_threads(threads)
    low, _, high = span.partition(":")
    target = load_target()
    ids = [prompt_ids(target.tokenizer, it) for it in long_prompts(n_prompts, (int(low), int(high)))]
    prefill(target, ids[0], chunk=chunk)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    secs = [call_seconds(lambda p=p: prefill(target, p, chunk=chunk), 1, warm=False)[0] for p in ids[1:]]
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print("ENV " + json.dumps({"seconds": secs, "tokens": [len(p) for p in ids[1:]], "sys_s": r1.ru_stime - r0.ru_stime,
                               "user_s": r1.ru_utime - r0.ru_utime, "minor_faults": r1.ru_minflt - r0.ru_minflt}))  # fmt: skip


def env_rates(names: list[str], n_prompts: int, span: str, chunk: int, threads: int, rounds: int) -> list[dict]:
    """Each configuration of ``names`` (:data:`ENVS`) in a fresh process, interleaved ``rounds`` times
    (every other round in reverse order)."""
    import os
    import sys

    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:  # each order in turn: no configuration always first
            env = {**os.environ, **ENVS[name]}
            cmd = [sys.executable, "-m", "benchmarks.studies.prefill_forward", "--env-worker", "--prompts", str(n_prompts),
                   "--prompt-chars", span, "--env-chunk", str(chunk), "--threads", str(threads), "--out", "-"]  # fmt: skip
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [x for x in res.stdout.splitlines() if x.startswith("ENV ")]
            if not line:
                raise RuntimeError(f"{name}: {res.stderr[-2000:]}")
            runs[name].append(json.loads(line[0][4:]))
            print(json.dumps({"env": name, **runs[name][-1]}), flush=True)
    out = []
    for name in names:
        ratios = [b / a for ra, rb in zip(runs[name], runs[names[0]]) for a, b in zip(ra["seconds"], rb["seconds"])]
        tok = [t / s for r in runs[name] for t, s in zip(r["tokens"], r["seconds"])]
        out.append({
            "env": name, "vars": ENVS[name], "chunk": chunk, "rounds": rounds,
            "median_tokens_per_s": statistics.median(tok), "best_tokens_per_s": max(tok),
            "speedup_vs_" + names[0]: statistics.median(ratios),
            "sys_s": [r["sys_s"] for r in runs[name]], "minor_faults": [r["minor_faults"] for r in runs[name]],
        })  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    return out


def compiled_prefill(ids: list[list[int]], sizes=(512,), repeats: int = 3) -> list[dict]:
    """The decoder compiled by inductor with freezing, for whole prompts of ``sizes`` rows."""
    import torch
    import torch._inductor.config as inductor_config
    import torch.nn.functional as F

    from toolspec_core.engine.loop import prefill
    from toolspec_core.model.batch_forward import rope
    from toolspec_core.model.target import load_target

    served = load_target()
    plain = load_target(tune_gemm=False).model  # nn.Linear as is: inductor packs the weights itself

    class Whole(torch.nn.Module):
        """A whole prompt, no cache: last-layer hidden states [N, H] and each layer's K / V."""

        def __init__(self, model):
            super().__init__()
            self.m = model

        def forward(self, ids, pos):
            core = self.m.model
            x = core.embed_tokens(ids[None])
            cos, sin = core.rotary_emb(x, pos[None])
            kv = []
            for layer in core.layers:
                a = layer.self_attn
                h = layer.input_layernorm(x)
                shape = (1, h.shape[1], -1, a.head_dim)
                q, k = a.q_proj(h).view(shape).transpose(1, 2), a.k_proj(h).view(shape).transpose(1, 2)
                v = a.v_proj(h).view(shape).transpose(1, 2)
                q, k = rope(q, cos[:, None], sin[:, None]), rope(k, cos[:, None], sin[:, None])
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.scaling, enable_gqa=True)
                x = x + a.o_proj(o.transpose(1, 2).reshape(1, h.shape[1], -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
                kv.append((k, v))
            return core.norm(x)[0], kv

    eager = Whole(plain).eval()
    inductor_config.freezing = True
    compiled = torch.compile(eager, dynamic=False)
    pool = [t for p in ids for t in p]
    out = []
    with torch.inference_mode():
        for n in sizes:
            x, pos = torch.tensor(pool[:n]), torch.arange(n)
            t0 = time.perf_counter()
            compiled(x, pos)
            compile_s = time.perf_counter() - t0
            hc = compiled(x, pos)[0]
            hs = prefill(served, pool[:n], chunk=4096, states=True).states  # [n, H] the served path's
            row = {
                "rows": n,
                "compile_s": compile_s,
                "compiled_tokens_per_s": n / best_seconds(lambda: compiled(x, pos), repeats),
                "same_function_eager_tokens_per_s": n / best_seconds(lambda: eager(x, pos), repeats),
                "served_path_tokens_per_s": n / best_seconds(lambda: prefill(served, pool[:n], chunk=4096), repeats),
                "max_abs_hidden_diff_vs_served": float((hc - hs).abs().max()),
                "argmax_equal_rows": float(
                    (served.logits(hc).argmax(-1) == served.logits(hs).argmax(-1)).float().mean()
                ),
            }
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts timed (one more is the warm-up)")
    ap.add_argument("--prompt-chars", default="2000:8000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="linears,attention,prefill")
    ap.add_argument(
        "--attention-rows", default="128:1024:64", help="first-chunk rows the attention part sweeps (FROM:TO:STEP)"
    )
    ap.add_argument("--attention-rounds", type=int, default=7)
    ap.add_argument(
        "--attention-block", type=int, default=0, help="> 0: the masked call against row blocks of this size"
    )
    ap.add_argument("--envs", default=",".join(ENVS), help="the env part's configurations (the first is the baseline)")
    ap.add_argument("--env-chunk", type=int, default=512)
    ap.add_argument("--env-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help="also the inductor-compiled whole-prompt forward")
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile (kept as 'machine')")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.env_worker:
        env_worker(args.prompts, args.prompt_chars, args.env_chunk, args.threads)
        return 0

    import torch

    from benchmarks.cost import hardware_string
    from benchmarks.data import prompt_ids
    from benchmarks.studies.prefill_vllm import FLOP_PER_TOKEN, long_prompts
    from toolspec_core.model.target import load_target

    torch.set_num_threads(args.threads)
    low, _, high = args.prompt_chars.partition(":")
    parts = set(args.parts.split(","))
    prompts = bool(parts & {"prefill", "breakdown"}) or args.compile  # the parts that run the model on the prompts
    items = long_prompts(args.prompts, (int(low), int(high))) if prompts else []
    out = {
        "what": "float32 CPU prefill forward part by part: projection kernels (GFLOP/s), prefill attention "
        "(mask tensor vs causal kernel), whole prefills with the forward mask_tensor_hf_rope / causal_kernel_rope (best and median "
        "tokens/s, interleaved), and optionally the inductor-compiled decoder (compile time, rate)",
        "hardware": hardware_string("cpu"),
        "torch": torch.__version__,
        "threads": args.threads,
        "code": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": args.note,
        "flop_per_token": FLOP_PER_TOKEN,
        "items": [it["id"] for it in items[1:]],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if "linears" in parts:
        out["linears"] = linear_rates()
        out["fused_bitwise_equal_to_parts"] = fused_exact()
    if "env" in parts:
        out["env"] = env_rates(args.envs.split(","), args.prompts, args.prompt_chars, args.env_chunk, args.threads,
                               args.rounds)  # fmt: skip
    if "attention" in parts:
        a, b, step = (int(x) for x in args.attention_rows.split(":"))
        out["attention"] = attention_rates(
            tuple(range(a, b + 1, step)), rounds=args.attention_rounds, block=args.attention_block
        )
        out["causal_from_rows"] = causal_from_rows(out["attention"])
        print(json.dumps({"causal_from_rows": out["causal_from_rows"]}), flush=True)
    if prompts:
        target = load_target()
        ids = [prompt_ids(target.tokenizer, it) for it in items]
        out["mean_prompt_tokens"] = statistics.mean(len(p) for p in ids[1:])
        if "breakdown" in parts:
            out["breakdown"] = prefill_breakdown(target, ids, rounds=args.rounds)
        if "prefill" in parts:
            out["prefill"] = prefill_rates(target, ids, rounds=args.rounds)
        del target
        if args.compile:
            out["compile"] = compiled_prefill(ids)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
