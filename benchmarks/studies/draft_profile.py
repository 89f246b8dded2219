"""Where drafting's host time goes: ``bench --batch --target replay`` with cProfile around each
sequence's drafting call only (``Scheduler._propose_all``), so the
profile is of the drafting part of the step and nothing else.

    python -m benchmarks.studies.draft_profile --batch 16 --limit 16 --out benchmarks/runs/profile-b16 \\
        --json benchmarks/results/measurements/draft-profile-b16-cpu-HW-<commit>.json

``--parts``: no profiler (it inflates many small Python calls against one C call); instead the
wall time of each part of a drafter's step (``PARTS``: the FSM sync, the schema candidates, their
tree, the value tree, the suffix walk, the merges ...) summed by a timer around it, in ms per
drafted sequence-step, with the expansion's candidate objects made per call against those it
returns. Parts nest (the tree of the value candidates is inside the value tree), so they do not
add up to the whole.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

from benchmarks.batch import BatchRun
from benchmarks.cli import parse
from toolspec_core.engine import scheduler as sched_mod

PARTS = (  # (module attribute path, name): what --parts times
    ("drafter.SchemaDrafter._draft", "draft (per sequence, up to the suffix walk)"),
    ("drafter.SchemaDrafter._sync", "FSM sync"),
    ("drafter.SchemaDrafter._continuations", "schema candidates (continuations)"),
    ("drafter.candidates_to_tree", "candidates to tree (tokenize + merge)"),
    ("boundary.BoundaryTokenizer.tokenize", "tokenize (table misses)"),
    ("drafter.SchemaDrafter._value_tree", "value tree"),
    ("drafter.SchemaDrafter._generic", "suffix job"),
    ("drafter.walk_batch", "suffix walk (the batch)"),
    ("drafter._finish", "finish (merge the walked tree)"),
    ("drafter.RetrievalDrafter.tree", "retrieval tree"),
    ("drafter.SchemaDrafter.prepare", "prompt side (beside the prefill, not a step's)"),
)


def time_parts(a, argv_bench: list[str]) -> dict:
    """Run the bench with a timer around each of ``PARTS``, ms per drafted sequence-step; then again
    (a second pass, so the counting costs no timed part anything) counting the candidate objects
    the expansion makes against those it returns."""
    import functools
    import time

    from toolspec_core.drafters.toolcall import boundary, candidates, drafter

    mods = {"drafter": drafter, "boundary": boundary}
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    undo = []

    def timed(name, fn):
        @functools.wraps(fn)
        def inner(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
                calls[name] = calls.get(name, 0) + 1

        return inner

    for path, name in PARTS:
        mod, *attrs = path.split(".")
        owner = mods[mod]
        for at in attrs[:-1]:
            owner = getattr(owner, at)
        fn = getattr(owner, attrs[-1])
        undo.append((owner, attrs[-1], fn))
        setattr(owner, attrs[-1], timed(name, fn))
    try:
        BatchRun(parse(argv_bench + ["--out", a.out + "/timed"])).run()
    finally:
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)
    made = {"objects": 0, "returned": 0, "calls": 0}
    cand_init, cont = candidates.Cand.__init__, drafter.continuations

    def counting_init(self, *args, **kw):
        made["objects"] += 1
        cand_init(self, *args, **kw)

    def counting_cont(*args, **kw):
        out = cont(*args, **kw)
        made["returned"] += len(out)
        made["calls"] += 1
        return out

    candidates.Cand.__init__, drafter.continuations = counting_init, counting_cont
    try:
        BatchRun(parse(argv_bench + ["--out", a.out + "/counted"])).run()
    finally:
        candidates.Cand.__init__, drafter.continuations = cand_init, cont
    n = calls.get(PARTS[0][1], 0)  # drafted sequence-steps
    return {
        "batch": a.batch,
        "limit": a.limit,
        "drafted_sequence_steps": n,
        "ms_per_drafted_sequence_step": {k: 1e3 * v / max(1, n) for k, v in spent.items()},
        "calls": calls,
        "candidate_objects_per_expansion": made["objects"] / max(1, made["calls"]),
        "candidates_returned_per_expansion": made["returned"] / max(1, made["calls"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--methods", default="toolspec")
    ap.add_argument("--cost", default="reference")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/runs/draft-profile")
    ap.add_argument("--json", help="write the top functions here")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--cycle", action="store_true")
    ap.add_argument("--replay-file")
    ap.add_argument("--data", action="append")
    ap.add_argument("--parts", action="store_true", help="time each part of drafting (no profiler)")
    a = ap.parse_args(argv)
    argv_bench = ["--batch", str(a.batch), "--same-batch-reference", "--target", "replay", "--limit", str(a.limit)]
    argv_bench += ["--methods", "ar," + a.methods, "--cost", a.cost, "--max-new-tokens", str(a.max_new_tokens)]
    argv_bench += (
        ["--out", a.out]
        + (["--cycle"] if a.cycle else [])
        + (["--replay-file", a.replay_file] if a.replay_file else [])
    )
    for d in a.data or []:
        argv_bench += ["--data", d]
    if a.parts:
        res = time_parts(a, argv_bench)
        for k, v in res["ms_per_drafted_sequence_step"].items():
            print(f"{v:8.4f} ms  {k}")
        print(
            f"{res['drafted_sequence_steps']} drafted sequence-steps; candidate objects per expansion "
            f"{res['candidate_objects_per_expansion']:.1f}, returned {res['candidates_returned_per_expansion']:.1f}"
        )
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    args = parse(argv_bench)  # what toolspec bench --batch runs
    prof = cProfile.Profile()
    seconds = {"draft": 0.0}
    batch_propose = sched_mod.Scheduler._propose_all

    def profiled_all(self, seqs):
        prof.enable()
        try:
            return batch_propose(self, seqs)
        finally:
            prof.disable()

    sched_mod.Scheduler._propose_all = profiled_all
    run = BatchRun(args)
    run.run()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())  # tottime summed: the profiled drafting time
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[: a.top]
    out = []
    for (file, line, fn), (cc, nc, tt, ct, _) in rows:
        out.append({"function": f"{Path(file).name}:{line}:{fn}", "calls": nc, "tottime_s": tt, "cumtime_s": ct})
    print(f"profiled drafting: {total:.3f} s (under cProfile)")
    for r in out:
        print(f"{r['tottime_s']:8.3f} {r['cumtime_s']:8.3f} {r['calls']:9d}  {r['function']}")
    st.sort_stats("cumulative").print_stats(25)
    if a.json:
        Path(a.json).write_text(
            json.dumps({"batch": a.batch, "limit": a.limit, "total_tottime_s": total, "top": out}, indent=1) + "\n"
        )
    seconds["draft"] = total
    return 0


if __name__ == "__main__":
    sys.exit(main())
