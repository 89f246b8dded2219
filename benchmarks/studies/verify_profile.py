"""Study: one verify forward's time by operator group (torch profiler). Result: none committed; cited by toolspec_core/engine/cost_probe.py (probe_steps).

Where the time of one verify forward goes, by operator group (torch profiler, self CPU time).

The question behind the CPU kernel work: is a k-token verify step GEMM-bound (then the linear
kernels decide the cost curve) or spent in attention / glue? The start-up cost probe's
steps (``toolspec_core.engine.cost_probe.probe_steps``) on the embedded model as decoding loads it.

    python -m benchmarks.studies.verify_profile [--ks 1,4,8,16] [--out benchmarks/runs/verify-profile.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from benchmarks.cost import hardware_string

# operator name fragments -> group (first match wins; self time, so nested ops count once)
GROUPS = (
    (
        "attention",
        (
            "scaled_dot_product",
            "flash_attention",
            "_efficient_attention",
            "softmax",
            "bmm",
            "baddbmm",
            "repeat_kv",
            "expand",
        ),
    ),
    ("gemm", ("linear", "addmm", "aten::mm", "matmul", "mkldnn", "onednn", "_mkl")),
)


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, frags in GROUPS if any(f in low for f in frags)), "other")


def profile(target, ks: list[int], prefix: int = 500, repeats: int = 5) -> dict:
    from toolspec_core.engine.cost_probe import probe_steps

    steps = probe_steps(target, prefix, ks)
    out = {}
    for k in ks:
        step = steps[k]
        step()  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                step()
        by_group: dict[str, float] = defaultdict(float)
        top: dict[str, float] = defaultdict(float)
        for ev in prof.key_averages():
            us = ev.self_cpu_time_total / repeats
            by_group[group_of(ev.key)] += us
            top[ev.key] += us
        total = sum(by_group.values())
        out[str(k)] = {
            "step_ms": round(total / 1000, 2),
            "share": {grp: round(v / total, 3) for grp, v in sorted(by_group.items())},
            "top_ops_ms": {name: round(v / 1000, 2) for name, v in sorted(top.items(), key=lambda kv: -kv[1])[:8]},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from toolspec_core.model.target import load_target

    target = load_target(threads=a.threads)
    res = {
        "what": "self CPU time of one verify forward (k tokens over a 500-token cache) by operator group, torch profiler; "
        "gemm = linear layers incl. lm_head, attention = SDPA + KV-head repeat",
        "hardware": hardware_string(),
        "model": "Qwen2.5-Coder-0.5B-Instruct (embedded, float32, tuned CPU linears)",
        "ks": profile(target, [int(k) for k in a.ks.split(",")], repeats=a.repeats),
    }
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
