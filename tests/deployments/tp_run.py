"""Tensor-parallel check on real weights: greedy output of the TP path equals the single-process
engine's, item by item and with requests batched; what each rank's host memory peaked at; what
crossed between the replica and rank 0 per step; the step times side by side.

    PYTHONPATH=. python tests/deployments/tp_run.py --tp 2 --items 30 --batch 4 --out benchmarks/results/measurements/NAME.json
    PYTHONPATH=. python tests/deployments/tp_run.py --workers local --device cuda --items 30 --out $OUT/tp1-h200.json

The slow TP2 test in ``test_tp.py`` drives it; ``benchmarks/studies/gpu_tp_check.sh`` ran the one-GPU check.

``--workers ray`` starts the ranks as Ray actors (a local Ray; CPU: gloo), ``local`` runs one rank in
this process (the DeepSpeed worker path without Ray: what a single GPU can check). Both engines
run the same requests: every item alone, then ``--batch`` at a time; ``identical`` compares the
generated token ids. Items come from the API-Bank, BFCL v3 and ToolAlpaca dev sets
(``benchmarks/datasets``) round-robin, the first N of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path


def requests_of(items: list[dict], max_tokens: int) -> list:
    from deployments.protocol import ChatRequest

    return [
        ChatRequest.model_validate(
            {
                "messages": it["messages"],
                "tools": it.get("tools") or [],
                "tool_choice": "auto" if it.get("tools") else "none",
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "toolspec": {"remember": False},
            }
        )
        for it in items
    ]


async def _run(host, reqs: list, batch: int) -> tuple[list, list]:
    alone = [await host.generate(r, "tp-check") for r in reqs]
    together: list = []
    for i in range(0, len(reqs), batch):
        together += await asyncio.gather(*(host.generate(r, "tp-check") for r in reqs[i : i + batch]))
    return alone, together


def run_engine(host, reqs: list, batch: int) -> dict:
    t0 = time.perf_counter()
    alone, together = asyncio.run(_run(host, reqs, batch))
    steps = host.engine.scheduler.steps
    fwd = [s.forward_s for s in steps if s.prefill_rows == 0]
    from deployments.events import Done

    errors = [r for r in alone + together if not isinstance(r, Done)]
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        "alone": [getattr(r, "text", None) for r in alone],
        "together": [getattr(r, "text", None) for r in together],
        "tokens": [getattr(r, "completion_tokens", None) for r in alone],
        "errors": len(errors),
        "decode_steps": len(fwd),
        "decode_step_s_median": statistics.median(fwd) if fwd else None,
    }


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--workers", choices=("ray", "local"), default="ray")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--items", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from benchmarks.data import interleave, load_items
    from benchmarks.datasets import SINGLE_TURN, dev_set
    from deployments.config import ServeAppConfig
    from deployments.engine_host import EngineHost
    from deployments.tp.target import local_tp_target, resolve_model_path

    per = -(-args.items // len(SINGLE_TURN))
    items = interleave([load_items(dev_set(name))[:per] for name in SINGLE_TURN])[: args.items]
    reqs = requests_of(items, args.max_tokens)
    base = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        method="toolspec",
        cost_model="reference",
        retrieval={"enabled": False},
        max_num_seqs=max(args.batch, 1),
        kv_pool_tokens=65536,
        replica_num_gpus=1 if args.device == "cuda" else 0,  # the plain engine holds its GPU itself
    )
    out: dict = {"items": [it["id"] for it in items], "config": vars(args)}
    ref = EngineHost.build(ServeAppConfig(**base))
    try:
        out["single"] = run_engine(ref, reqs, args.batch)
    finally:
        ref.close()
    del ref
    if args.workers == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        tp = EngineHost.build(ServeAppConfig(**base, tensor_parallel_size=args.tp))
    else:  # the host's own loader would run the model in-process; give it the local worker's target
        cfg = ServeAppConfig(**base)
        target = local_tp_target(args.model, args.dtype, args.device)
        tp = EngineHost(cfg, target, *_method_and_cost(cfg, target))
    try:
        group = tp.target.group
        calls0 = group.transport.ray_calls
        out["tp"] = run_engine(tp, reqs, args.batch)
        out["workers"] = group.reports
        out["transport"] = group.transport.as_dict()
        out["transport"]["ray_calls_in_run"] = group.transport.ray_calls - calls0
        out["worker_reports_after"] = group.worker_reports()
    finally:
        tp.close()
    full = checkpoint_bytes(resolve_model_path(args.model))
    s, t = out["single"], out["tp"]
    out["summary"] = {
        "identical_alone": sum(a == b for a, b in zip(s["alone"], t["alone"])),
        "identical_batched": sum(a == b for a, b in zip(s["together"], t["together"])),
        "batched_equals_alone": sum(a == b for a, b in zip(t["alone"], t["together"])),
        "items": len(reqs),
        "full_copy_bytes": full,
        "peak_rss_per_rank_bytes": [w["peak_rss_bytes"] for w in out["workers"]],
        "peak_rss_over_full_copy": [round(w["peak_rss_bytes"] / full, 3) for w in out["workers"]],
        "load_rss_over_full_copy": [
            round((w["rss_after_load_bytes"] - w["rss_before_load_bytes"]) / full, 3) for w in out["workers"]
        ],
        "ray_calls_per_step": round(out["transport"]["ray_calls_in_run"] / max(out["transport"]["steps"], 1), 3),
        "handover_ms_per_step": out["transport"]["handover_ms_per_step"],
        "bytes_out_per_step": out["transport"]["bytes_out_per_step"],
        "bytes_in_per_step": out["transport"]["bytes_in_per_step"],
        "decode_step_s_median": {"single": s["decode_step_s_median"], "tp": t["decode_step_s_median"]},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))
    return 0 if out["summary"]["identical_alone"] == len(reqs) == out["summary"]["identical_batched"] else 1


def _method_and_cost(cfg, target):
    from toolspec_core.drafters.methods import make_method
    from toolspec_core.engine.cost_probe import cost_model_for

    return make_method(cfg.method, target.tokenizer), cost_model_for(cfg.cost_model, target)


if __name__ == "__main__":
    raise SystemExit(main())
