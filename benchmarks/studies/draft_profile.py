"""Where drafting's host time goes: ``bench --batch --target replay`` with cProfile around each
sequence's drafting call only (``Scheduler._propose_all``), so the
profile is of the drafting part of the step and nothing else.

    python -m benchmarks.studies.draft_profile --batch 16 --limit 16 --out benchmarks/runs/profile-b16 \\
        --json benchmarks/results/measurements/draft-profile-b16-cpu-HW-<commit>.json
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
