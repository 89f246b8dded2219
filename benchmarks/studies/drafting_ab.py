"""Drafting CPU time, A/B by part of the drafter: ``bench --batch --target replay`` with the schema
drafter's compiled parts (``tree_kernel``: the tree merge, the batch's suffix walk, the boundary
tokenizer's ASCII encoder) on and off, run in turn (alternated, ``--rounds`` times), timing the thread CPU time of the batch
drafting call only (``Scheduler._propose_all``) per drafted sequence-step. Trees are the same in
every compiled-or-not variant (tests/drafters/test_batch_drafting.py), so MAT and outputs are too;
the report checks it. ``nofloor`` drafts without the budget's floor (``scheduler.FLOOR_SHARE`` 0:
every branch expanded as far as ``levels`` go): other trees, so MAT is reported per benchmark.

    python -m benchmarks.studies.drafting_ab --batch 16 --rounds 2 --json benchmarks/runs/drafting-ab.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
from pathlib import Path

from benchmarks.batch import BatchRun
from benchmarks.cli import parse
from toolspec_core.drafters import tree_kernel
from toolspec_core.drafters.toolcall import boundary as boundary_mod
from toolspec_core.drafters.toolcall import drafter as drafter_mod
from toolspec_core.engine import scheduler as sched_mod

VARIANTS = {
    "python": dict(compiled=False, suffix=False, bpe=False),  # every part in Python
    "merge": dict(compiled=True, suffix=False, bpe=False),  # the compiled merge only
    "suffix": dict(compiled=True, suffix=True, bpe=False),  # + the batch's suffix walk
    "compiled": dict(compiled=True, suffix=True, bpe=True),  # + the ASCII encoder (the default where built)
    "nofloor": dict(compiled=True, suffix=True, bpe=True, floor=False),  # the default without the budget's floor
}


def run_variant(a, compiled: bool, suffix: bool = True, bpe: bool = True, floor: bool = True) -> dict:
    load, load_suffix, load_bpe = tree_kernel.load, tree_kernel.load_suffix, tree_kernel.load_bpe
    native, share = boundary_mod.native_encoder, sched_mod.FLOOR_SHARE
    if not floor:
        sched_mod.FLOOR_SHARE = 0.0
    if not compiled:
        tree_kernel.load = lambda: None
    if not suffix:
        tree_kernel.load_suffix = lambda: None
    if not bpe:  # the encoder and the labels' loop (the boundary tokenizers made for this run)
        boundary_mod.native_encoder = lambda tokenizer: None
        tree_kernel.load_bpe = lambda: None
    cpu = {"s": 0.0, "seq_steps": 0}
    batch_propose = sched_mod.Scheduler._propose_all

    inside = [False]  # whether the batch drafting call is running (a collection there counts in its time)

    def timed(self, seqs):
        t = time.thread_time()
        inside[0] = True
        try:
            return batch_propose(self, seqs)
        finally:
            inside[0] = False
            cpu["s"] += time.thread_time() - t
            cpu["seq_steps"] += sum(1 for s in seqs if isinstance(s.drafter, drafter_mod.SchemaDrafter))

    sched_mod.Scheduler._propose_all = timed
    gc_s, gc_n, gc_in, started = [0.0, 0.0, 0.0], [0, 0, 0], [0.0, 0.0, 0.0], {}

    def on_gc(phase, info):  # collections, by generation: what the objects a variant keeps cost
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            took = time.perf_counter() - started.get("t", time.perf_counter())
            gc_s[info["generation"]] += took
            gc_n[info["generation"]] += 1
            if inside[0]:  # ... and the part of it inside the drafting call's time
                gc_in[info["generation"]] += took

    gc.callbacks.append(on_gc)
    argv = ["--batch", str(a.batch), "--same-batch-reference", "--target", "replay", "--limit", str(a.limit)]
    argv += ["--methods", "toolspec"]  # the bench runs plain greedy (ar) beside it: its steps draft nothing
    out = str(Path(a.out) / f"{len(list(Path(a.out).glob('*')))}" if Path(a.out).exists() else Path(a.out) / "0")
    argv += ["--cost", a.cost, "--max-new-tokens", "128", "--out", out] + (["--cycle"] if a.cycle else [])
    try:
        run = BatchRun(parse(argv))
        run.run()
    finally:
        sched_mod.Scheduler._propose_all = batch_propose
        gc.callbacks.remove(on_gc)
        tree_kernel.load, tree_kernel.load_suffix, tree_kernel.load_bpe = load, load_suffix, load_bpe
        boundary_mod.native_encoder = native
        sched_mod.FLOOR_SHARE = share
    outs, mats, by_bench = [], [], {}
    for rec in run.store.records.values():
        for item, o in sorted(rec["outputs"].items()):
            outs.append((rec["benchmark"], rec["group"], item, tuple(o["tokens"])))
            if rec["method"] != "ar":  # plain greedy's steps, run beside it, draft nothing
                mats.append(o["mat"])
                by_bench.setdefault(rec["benchmark"], []).append(o["mat"])
    digest = hashlib.sha1(repr(sorted(outs)).encode()).hexdigest()[:12]
    return {
        "draft_cpu_s": cpu["s"],
        "seq_steps": cpu["seq_steps"],
        "ms_per_seq_step": 1e3 * cpu["s"] / max(1, cpu["seq_steps"]),
        "outputs_sha1": digest,
        "mean_item_mat": sum(mats) / max(1, len(mats)),
        "mean_item_mat_by_benchmark": {b: sum(m) / len(m) for b, m in sorted(by_bench.items())},
        "gc_s_by_generation": gc_s,
        "gc_collections_by_generation": gc_n,
        "gc_s_inside_drafting_by_generation": gc_in,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cycle", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/runs/drafting-ab")
    ap.add_argument("--cost", default="reference", help="the budget's curve (bench --cost)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    for r in range(a.rounds):
        for name in a.variants.split(","):
            res = run_variant(a, **VARIANTS[name])
            res.update(variant=name, round=r)
            rows.append(res)
            print(
                f"round {r} {name:14s} drafting {res['ms_per_seq_step']:.3f} ms / seq-step  ({res['seq_steps']} seq-steps; "
                f"gc {[round(x, 2) for x in res['gc_s_by_generation']]} s, inside drafting "
                f"{[round(x, 3) for x in res['gc_s_inside_drafting_by_generation']]} s)",
                flush=True,
            )
            if a.json:
                head = {"batch": a.batch, "limit": a.limit, "cycle": a.cycle, "cost": a.cost}
                Path(a.json).write_text(json.dumps({**head, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
