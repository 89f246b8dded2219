"""Study: the perfect-foresight copy oracle's bound on copy drafting. Result: benchmarks/results/measurements/copy-bound-{cpu-avx512-,flat-}1f236d4.json.

How far could any drafter that copies from the request, the history and the schema go?

An upper bound for the drafting ToolSpec and the suffix baseline do: replay a run's recorded greedy
outputs with an *oracle* that knows the output. At each position it may draft the longest run of the
output's next tokens whose text occurs in a source -- the prompt (messages and tool schemas), every
earlier output of the stream (the online library, all of it, no cap), or this output so far -- or
what a recorded method really got accepted by a step that began there (so the bound covers the
drafts that are not copies: rendered dates, counted digits). It drafts one chain, exactly as long as
it chooses, and picks the chain lengths of the whole output by dynamic programming for the least
total verify cost under a cost curve. No drafter built from those sources can do better under that
curve; a method's projected speedup over plain greedy against the oracle's says how much of the
copyable ceiling it reaches, and oracle / best baseline bounds what any such ToolSpec could gain
over the baseline.

    python -m benchmarks.studies.copy_bound benchmarks/runs/RUN [--cost run|flat] [--json-out F]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from benchmarks.data import prompt_ids

from .offline_sim import _cost, region_costs
from .regions import call_bounds, run_items


def copy_lengths(tokens: list[int], text_of, sources: str, anchor: int = 0) -> list[int]:
    """For each position p: the most tokens t[p:p+j] whose text, preceded by the ``anchor`` tokens
    before p (the context a drafter has to find the copy by), occurs in ``sources`` or in the text of
    this output before p. Monotone in j, so found by binary search."""
    out = []
    for p in range(len(tokens)):
        own = text_of(tokens[:p])
        a = min(anchor, p)
        lo, hi = 0, len(tokens) - p
        while lo < hi:
            mid = (lo + hi + 1) // 2
            piece = text_of(tokens[p - a : p + mid])
            if piece in sources or piece in own:
                lo = mid
            else:
                hi = mid - 1
        out.append(lo)
    return out


def recorded_trace(rec: dict, first: int = 1) -> list[tuple[int, int, int, str]]:
    """A recorded decode's steps as (output position it began at, tree size, accepted, method): the
    trace form ``offline_sim.region_costs`` reads."""
    out, pos = [], first
    for size, acc in zip(rec["drafted_per_step"], rec["accepted_per_step"]):
        out.append((pos, size, acc, rec["method"]))
        pos += acc + 1
    return out


def best_chains(lengths: list[int], step_cost, first: int = 1, max_nodes: int = 63) -> list[tuple[int, int]]:
    """The steps (position, chain length j) of least Σ step_cost(j) writing positions first..n-1, when a
    step at p may draft j <= lengths[p] correct tokens (it writes j + 1: the chain and the target's
    own token)."""
    n = len(lengths)
    best = [(0.0, 0)] * (n + 1)  # (cost from p to the end, j at p)
    for p in range(n - 1, first - 1, -1):
        best[p] = min(
            (step_cost(j) + best[min(p + j + 1, n)][0], j) for j in range(min(lengths[p], max_nodes, n - p) + 1)
        )
    out, p = [], first
    while p < n:
        out.append((p, best[p][1]))
        p += best[p][1] + 1
    return out


def _traces(toks: list[int], recs: dict, sources: str, text_of, cost, anchor: int) -> dict[str, list]:
    """Steps of each recorded method on one output, and of the oracle, which may also take what a
    recorded step that began at a position got accepted there."""
    out = {m: recorded_trace(rec) for m, rec in recs.items()}
    lengths = copy_lengths(toks, text_of, sources, anchor)
    for trace in out.values():
        for pos, _, acc, _ in trace:
            if pos < len(lengths):
                lengths[pos] = max(lengths[pos], acc)
    out["oracle"] = [(p, j, j, "oracle") for p, j in best_chains(lengths, cost.step_cost, max_nodes=cost.max_nodes)]
    return out


def bound_run(
    raw: Path,
    tokenizer,
    cost,
    methods: tuple[str, ...] = ("suffix", "toolspec"),
    only_calls: bool = True,
    anchor: int = 0,
    regions: bool = False,
) -> dict:
    items = run_items(raw)
    recs = [json.loads(line) for line in open(raw / "items.jsonl")]
    by_method = collections.defaultdict(dict)
    for r in recs:
        by_method[r["method"]][r["item"]] = r
    ar = [r for r in recs if r["method"] == "ar"]  # stream order
    text_of = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    history: list[str] = []
    agg = collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0, 0.0, 0])
    )  # bench -> who -> tokens, cost, steps
    by_region = collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0.0, 0, 0.0])
    )  # (bench, who) -> region -> steps, tokens, cost
    for r in ar:
        toks = r["tokens"]
        sources = "\x00".join([text_of(prompt_ids(tokenizer, items[r["item"]]))] + history)
        history.append(text_of(toks))
        if only_calls and not r.get("has_call"):
            continue
        mine = {m: by_method[m][r["item"]] for m in methods if r["item"] in by_method.get(m, {})}
        bounds = (
            call_bounds(tokenizer, items[r["item"]].get("tools") or [], toks) if regions and r.get("has_call") else None
        )
        for who, trace in _traces(toks, mine, sources, text_of, cost, anchor).items():
            b = agg[r["benchmark"]][who]
            b[0], b[1], b[2] = (
                b[0] + len(toks) - 1,
                b[1] + sum(cost.step_cost(size) for _, size, _, _ in trace),
                b[2] + len(trace),
            )
            for reg, vals in region_costs(trace, bounds, cost).items() if bounds is not None else ():
                agg_r = by_region[(r["benchmark"], who)]
                agg_r[reg] = [x + y for x, y in zip(agg_r[reg], vals)]
    out = {}
    for bench, who in agg.items():
        row = {
            w: {"tokens": t, "steps": s, "mat": round(t / max(s, 1), 3), "proj": round(t / max(c, 1e-9), 3)}
            for w, (t, c, s) in who.items()
        }
        for w in row:
            if (bench, w) in by_region:
                row[w]["regions"] = {
                    reg: {"tokens": t, "cost": round(c, 2), "proj": round(t / c, 3) if c else None}
                    for reg, (_, t, c) in by_region[(bench, w)].items()
                }
        base = [m for m in methods if m in row and m != "toolspec"]
        if base:
            best = max(base, key=lambda m: row[m]["proj"])
            row["best_baseline"] = best
            row["oracle_over_best_baseline"] = round(row["oracle"]["proj"] / row[best]["proj"], 3)
            if "toolspec" in row:
                row["toolspec_over_best_baseline"] = round(row["toolspec"]["proj"] / row[best]["proj"], 3)
                row["toolspec_share_of_oracle"] = round(row["toolspec"]["proj"] / row["oracle"]["proj"], 3)
        row["items"] = sum(1 for r in ar if r["benchmark"] == bench and (r.get("has_call") or not only_calls))
        out[bench] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw", nargs="+")
    ap.add_argument(
        "--methods",
        default="suffix,toolspec",
        help="recorded methods to compare (and whose steps the oracle may reuse)",
    )
    ap.add_argument("--cost", default="run", help="run (the run's cost.json) | reference | flat | path to a cost JSON")
    ap.add_argument("--all-items", action="store_true")
    ap.add_argument("--anchors", default="0,2,4,8", help="context tokens a copy must match before it (one bound each)")
    ap.add_argument(
        "--regions",
        action="store_true",
        help="also split each one's projected cost by region (before / call object / after)",
    )
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    res = {"what": __doc__.split("\n\n")[0], "cost": a.cost, "subset": "all" if a.all_items else "calls", "runs": {}}
    for raw in a.raw:
        for anchor in map(int, a.anchors.split(",")):
            key = f"{raw} anchor={anchor}"
            res["runs"][key] = bound_run(
                Path(raw),
                tok,
                _cost(Path(raw), a.cost),
                tuple(a.methods.split(",")),
                not a.all_items,
                anchor,
                a.regions,
            )
            print(
                key,
                json.dumps(
                    {
                        b: {k: v for k, v in row.items() if not isinstance(v, dict)}
                        | {"oracle_mat": row["oracle"]["mat"]}
                        for b, row in res["runs"][key].items()
                    }
                ),
                flush=True,
            )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
