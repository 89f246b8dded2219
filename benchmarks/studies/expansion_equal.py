"""The schema candidates of this tree's expansion graph against another revision's
``continuations``, at every character of the dev sets' gold calls.

    python -m benchmarks.studies.expansion_equal --rev 7e4a9d2 --per-set 12 \\
        --json benchmarks/results/measurements/expansion-equal-<rev>-<commit>.json

The other revision's ``toolspec_core/drafters/toolcall/candidates.py`` is read with ``git show``
and loaded beside this tree's modules (its imports are this tree's: the FSM, values, schema
tables), so the comparison is of the expansion alone. For each gold output (three dev sets,
``--per-set`` items each; layouts hermes, fence and bare; with and without the tool set's compiled
tables) and each character of it, both expand from the same tracker with the retrieved past calls,
the conversation's numbers and dates and this output's finished calls, at five (cut, floor) pairs;
this tree's way is the drafter's (one graph kept across the output's positions, the compiled
walk) and, separately, a fresh graph walked in Python. Every candidate list must be equal
(segments, probability, order); the expansion's wall time is summed for both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.data import gold_requests
from toolspec_core.drafters.toolcall import candidates as new
from toolspec_core.drafters.toolcall.compiled import compile_tools
from toolspec_core.drafters.toolcall.fsm import CallTracker
from toolspec_core.spec.layouts import layout_by_name, render_calls

CUTS = ((64, 0.0), (64, 0.01), (8, 0.0), (64, 0.2), (4, 0.05))  # (max_cands, min_prob)
SOURCE = "toolspec_core/drafters/toolcall/candidates.py"


def load_revision(rev: str):
    """The ``candidates`` module of ``rev`` (``git show``), loaded under a name of its own."""
    root = Path(__file__).resolve().parents[2]
    text = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=root, capture_output=True, text=True, check=True)
    path = Path(tempfile.mkdtemp()) / "candidates_rev.py"
    path.write_text(text.stdout)
    spec = importlib.util.spec_from_file_location("candidates_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["candidates_rev"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def compare(old, per_set: int) -> dict:
    checked, t_old, t_new = 0, 0.0, 0.0
    for it, idx, extra in gold_requests(per_set):
        past = extra["past"]
        for layout in ("hermes", "fence", "bare"):
            text = render_calls(it["gold_calls"], layout_by_name(layout))
            for tables in (None, compile_tools(it["tools"], None)):
                memo_old, memo_new, graph, own = {}, {}, new.Graph(), []
                pri_old, pri_new = old.Priors(), new.Priors()
                tr = CallTracker(idx)
                for k in range(len(text) + 1):
                    if k:
                        tr.feed(text[k - 1])
                    if len(tr.calls) != len(own):
                        own = past[: len(tr.calls)]  # a new list whenever it changes, as the drafter's
                    for keep, floor in CUTS:
                        kw = dict(max_cands=keep, min_prob=floor, own=own, tables=tables, **extra)
                        s0 = time.perf_counter()
                        a = old.continuations(tr, idx, pri_old, [7], past_memo=memo_old, **kw)
                        s1 = time.perf_counter()
                        b = new.continuations(tr, idx, pri_new, [7], past_memo=memo_new, graph=graph, **kw)
                        s2 = time.perf_counter()
                        c = new.continuations(tr, idx, pri_new, [7], compiled=False, **kw)
                        t_old, t_new = t_old + s1 - s0, t_new + s2 - s1
                        want = [(x.segs, x.prob) for x in a]
                        for way, got in (("kept graph, compiled walk", b), ("fresh graph, Python walk", c)):
                            if [(x.segs, x.prob) for x in got] != want:
                                raise AssertionError(f"{way} differs: {it['id']} {layout} {keep} {floor} {text[:k]!r}")
                        checked += 1
    return {"positions_checked": checked, "revision_s": t_old, "graph_s": t_new}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the revision whose continuations to compare against")
    ap.add_argument("--per-set", type=int, default=12)
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"what": __doc__.splitlines()[0], "rev": a.rev, "code": head, "per_set": a.per_set, "cuts": CUTS}
    res.update(compare(load_revision(a.rev), a.per_set))
    res["all_equal"] = True  # compare raises on the first difference
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
