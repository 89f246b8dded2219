"""How far could any drafter that copies from the request, the history and the schema go?

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

    python -m benchmarks.copy_bound benchmarks/results/raw/cpu-streamkernel [--cost run|flat] [--json-out F]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from .data import prompt_ids, run_items


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
            piece = text_of(tokens[p - a:p + mid])
            if piece in sources or piece in own:
                lo = mid
            else:
                hi = mid - 1
        out.append(lo)
    return out


def recorded_lengths(n: int, accepted_per_step: list[int], first: int = 1) -> list[int]:
    """Accepted tokens of a recorded decode, by the output position its step began at (0 elsewhere)."""
    out, pos = [0] * n, first
    for acc in accepted_per_step:
        if pos < n:
            out[pos] = max(out[pos], acc)
        pos += acc + 1
    return out


def best_cost(lengths: list[int], step_cost, first: int = 1, max_nodes: int = 63) -> tuple[float, int]:
    """Least Σ step_cost(j) to write positions first..n-1 when a step at p may draft j <= lengths[p]
    correct tokens (it writes j + 1: the accepted chain and the target's own token). Returns
    (cost, steps)."""
    n = len(lengths)
    best = [(0.0, 0)] * (n + 1)
    for p in range(n - 1, first - 1, -1):
        cands = []
        for j in range(min(lengths[p], max_nodes, n - p) + 1):
            c, s = best[min(p + j + 1, n)]
            cands.append((step_cost(j) + c, s + 1))
        best[p] = min(cands)
    return best[first]


def bound_run(raw: Path, tokenizer, cost, methods: tuple[str, ...] = ("suffix", "toolspec"), only_calls: bool = True,
              anchor: int = 0) -> dict:
    items = run_items(raw)
    recs = [json.loads(l) for l in open(raw / "items.jsonl")]
    by_method = collections.defaultdict(dict)
    for r in recs:
        by_method[r["method"]][r["item"]] = r
    ar = [r for r in recs if r["method"] == "ar"]  # stream order
    text_of = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    history: list[str] = []
    agg = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0, 0]))  # bench -> who -> tokens, cost, steps
    for r in ar:
        toks = r["tokens"]
        sources = "\x00".join([text_of(prompt_ids(tokenizer, items[r["item"]]))] + history)
        history.append(text_of(toks))
        if only_calls and not r.get("has_call"):
            continue
        lengths = copy_lengths(toks, text_of, sources, anchor)
        for m in methods:
            rec = by_method.get(m, {}).get(r["item"])
            if rec is not None:
                lengths = [max(a, b) for a, b in zip(lengths, recorded_lengths(len(toks), rec["accepted_per_step"]))]
        b = agg[r["benchmark"]]
        c, s = best_cost(lengths, cost.step_cost, max_nodes=cost.max_nodes)
        b["oracle"] = [b["oracle"][0] + len(toks) - 1, b["oracle"][1] + c, b["oracle"][2] + s]
        for m in methods:
            rec = by_method.get(m, {}).get(r["item"])
            if rec is not None:
                mc = sum(cost.step_cost(d) for d in rec["drafted_per_step"])
                b[m] = [b[m][0] + len(toks) - 1, b[m][1] + mc, b[m][2] + len(rec["drafted_per_step"])]
    out = {}
    for bench, who in agg.items():
        row = {w: {"tokens": t, "steps": s, "mat": round(t / max(s, 1), 3), "proj": round(t / max(c, 1e-9), 3)} for w, (t, c, s) in who.items()}
        base = [m for m in methods if m in row and m != "toolspec"]
        if base:
            best = max(base, key=lambda m: row[m]["proj"])
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
    ap.add_argument("--methods", default="suffix,toolspec", help="recorded methods to compare (and whose steps the oracle may reuse)")
    ap.add_argument("--cost", default="run", help="run (the run's cost.json) | reference | flat | path to a cost JSON")
    ap.add_argument("--all-items", action="store_true")
    ap.add_argument("--anchors", default="0,1,2,4", help="context tokens a copy must match before it (one bound each)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from toolspec_core.embedded import embedded_model_dir

    from .offline_sim import _cost

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    res = {"what": __doc__.split("\n\n")[0], "cost": a.cost, "subset": "all" if a.all_items else "calls", "runs": {}}
    for raw in a.raw:
        for anchor in map(int, a.anchors.split(",")):
            key = f"{raw} anchor={anchor}"
            res["runs"][key] = bound_run(Path(raw), tok, _cost(Path(raw), a.cost), tuple(a.methods.split(",")), not a.all_items, anchor)
            print(key, json.dumps({b: {k: v for k, v in row.items() if not isinstance(v, dict)} | {"oracle_mat": row["oracle"]["mat"]}
                                   for b, row in res["runs"][key].items()}), flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
