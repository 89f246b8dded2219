"""Study: packed GEMM x start-up / calibrated cost curve, end to end. Result: none committed; its figures are cited in toolspec_core/engine/budget.py (Calibration).

A/B of the CPU verify set-up on the embedded model, in one process.

Variants: the linear-layer kernel (``packed_rows`` 16: MKL packed GEMM for 4..16-row forwards;
0: the default dispatch of ``toolspec_core.model.cpu_linears``) x the budget's cost curve (start-up probe only, or calibrated
from the real steps as decoding goes: ``CostModel(calibrate=True)``). Each variant measures the
start-up curve, then decodes the same items with plain greedy and ``toolspec_schema``, recording
what every step really cost relative to the same item's median plain-greedy step. Questions:
does a kernel that is faster per layer make decoding faster; does the start-up curve predict
what steps really cost; does calibrating the curve pay?

    python -m benchmarks.studies.kernel_ab [--items 4] [--out benchmarks/runs/kernel-ab.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict

import torch

BUCKETS = ((1, 1), (2, 3), (4, 8), (9, 16), (17, 64))
VARIANTS = (
    ("transposed", 0, False),
    ("transposed+calibrated", 0, True),
    ("packed", 16, False),
    ("packed+calibrated", 16, True),
)


def _bucket(rows: int) -> str:
    lo, hi = next(b for b in BUCKETS if b[0] <= min(rows, 64) <= b[1])
    return str(lo) if lo == hi else f"{lo}-{hi}"


def summarize(raw: dict) -> dict:
    """Per variant: start-up curve, observed step cost per forward-size bucket, geomean speedup."""
    out = {}
    for variant, res in raw.items():
        ratios: dict[str, list[float]] = defaultdict(list)
        for it in res["items"]:
            for k, t in it["steps"]:
                ratios[_bucket(k + 1)].append(t / it["ar_step"])
        speedups = [it["speedup"] for it in res["items"]]
        out[variant] = {
            "startup_curve": {str(k): round(v, 3) for k, v in sorted(res["points"].items(), key=lambda kv: int(kv[0]))},
            "observed_cost": {
                b: {"steps": len(v), "median": round(sorted(v)[len(v) // 2], 3)} for b, v in ratios.items()
            },
            "geomean_speedup": math.exp(sum(map(math.log, speedups)) / len(speedups)),
            "items": [it["id"] for it in res["items"]],
            "load_s": res["load_s"],
            "final_curve": res.get("final_points"),
        }
    return out


def measure(n_items: int) -> dict:
    from benchmarks.data import load_items, prompt_ids
    from benchmarks.datasets import dev_set
    from benchmarks.prompts import PromptPool
    from toolspec_core.drafters.methods import RequestInfo, make_method
    from toolspec_core.engine.budget import CostModel
    from toolspec_core.engine.cost_probe import measure_cost_points
    from toolspec_core.engine.loop import DecodeConfig
    from toolspec_core.model.target import load_target

    items = [it for f in ("api_bank", "bfcl_v3") for it in load_items(dev_set(f))[: 10 * n_items : 10]]
    raw = {}
    target = None
    for variant, packed, calibrate in VARIANTS:
        if target is None or packed != target.packed_rows:
            del target
            t0 = time.time()
            target = load_target(packed_rows=packed)
            target.packed_rows, load_s = packed, time.time() - t0
        res = {"load_s": load_s, "points": measure_cost_points(target)[1], "items": []}
        cost = CostModel(res["points"], calibrate=calibrate)
        for it in items:
            ids = prompt_ids(target.tokenizer, it)
            prompts = PromptPool(target, 2 * len(ids) + 512)
            prompts.warm(it["id"], ids)  # the prompt prefilled once; each decode starts from its blocks
            prompts.decode(ids, None, DecodeConfig(max_new_tokens=2))  # untimed warm-up
            runs = {}
            for name in ("ar", "toolspec_schema"):
                method = make_method(name, target.tokenizer)
                req = RequestInfo(ids, it.get("tools") or [])
                runs[name] = prompts.decode(ids, lambda: method.drafter(req), DecodeConfig(max_new_tokens=128), cost)[0]
            assert runs["ar"].tokens == runs["toolspec_schema"].tokens, it["id"]
            ar_steps = sorted(runs["ar"].stats.verify_step_s)
            res["items"].append(
                {
                    "id": it["id"],
                    "speedup": runs["ar"].stats.decode_s / runs["toolspec_schema"].stats.decode_s,
                    "ar_step": ar_steps[len(ar_steps) // 2],
                    "steps": list(
                        zip(runs["toolspec_schema"].stats.drafted, runs["toolspec_schema"].stats.verify_step_s)
                    ),
                }
            )
            print(variant, it["id"], f"{res['items'][-1]['speedup']:.2f}x", flush=True)
        res["final_points"] = {str(k): round(v, 3) for k, v in sorted(cost.points.items())}
        raw[variant] = res
    return raw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=4, help="items per benchmark (API-Bank, BFCL)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/runs/kernel-ab.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    summary = summarize(measure(a.items))
    with open(a.out, "w") as f:
        json.dump({"threads": a.threads, "variants": summary}, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
