"""Study: drafters replayed along recorded greedy outputs (steps, MAT, losses). Result: none committed; it chose the suffix drafter's buckets (toolspec_core/drafters/suffix.py).

Offline drafter study: replay recorded greedy outputs (a run's ``items.jsonl``) through a method's
drafter with the target replaced by those tokens (``toolspec_core.drafters.simulate``), each tree cut to the budget
(``Pruned``).

Greedy output is a function of the prompt only, so the recorded ``ar`` tokens are exactly what the
target will write; steps / MAT / per-state losses of a drafter change come out in seconds instead
of a benchmark run. Timing is not simulated -- the budget uses the given cost curve.

    python -m benchmarks.studies.offline_sim benchmarks/runs/RUN --methods toolspec_schema,toolspec [--show 5]

A step prints as ``[accepted/drafted]`` followed by the accepted text and the target's own token.
``--regions`` also splits each benchmark's projected cost by region of the output (before the first
call object, the object, after it: ``benchmarks.studies.regions``), so a drafting change can be judged where it
acts -- the text around the call is where ToolSpec drafts what the suffix baseline drafts.
``--calibration`` adds, per draft label and conf decile, how often a node whose parent was accepted
was accepted itself against the conf the drafter gave it: the budget's cut is only as good as that.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time
from pathlib import Path

from benchmarks.data import load_items, prompt_ids, select_items, warm_documents
from benchmarks.runner import PrefillCache, decode_hidden
from toolspec_core.drafters.methods import RequestInfo, make_method
from toolspec_core.drafters.simulate import simulate
from toolspec_core.engine.budget import CostModel
from toolspec_core.spec.tree import prune_to_budget, tried

from .regions import call_bounds, run_items, split_steps


def replay(
    raw: Path,
    methods: list[str],
    tokenizer,
    cost,
    only_calls: bool = True,
    show: int = 0,
    show_bench: str | None = None,
    shuffle: int | None = None,
    regions: bool = False,
    calibration: bool = False,
) -> dict:
    cfg = json.loads((raw / "config.json").read_text())
    items = run_items(raw)
    recs = [json.loads(line) for line in open(raw / "items.jsonl") if '"method": "ar"' in line]
    if shuffle is not None:  # another stream order: what an online library gains from the file's order
        random.Random(shuffle).shuffle(recs)
    keys = _keys(raw / "prefill.jsonl")
    warm = (
        _warm_docs(raw, cfg, tokenizer, set(items) & {r["item"] for r in recs})
        if "warm" in (cfg.get("libraries") or [])
        else []
    )
    bounds = (
        {
            r["item"]: call_bounds(tokenizer, items[r["item"]].get("tools") or [], r["tokens"])
            for r in recs
            if r.get("has_call")
        }
        if regions
        else {}
    )
    out = {}
    for name in methods:
        method = make_method(name, tokenizer)
        for req, ids, text in warm:
            method.observe(req, ids, text)
        per_bench = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
        lost = collections.Counter()
        by_region: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0, 0.0]))
        calib: dict = collections.defaultdict(lambda: [0, 0.0, 0])  # (label, decile) -> tries, sum conf, accepted
        for r in recs:
            item = items[r["item"]]
            req = RequestInfo(prompt_ids(tokenizer, item), item.get("tools") or [], embedding=keys.get(r["item"]))
            drafter = _Timed(method.drafter(req))
            trace: list = []
            res = simulate(Pruned(drafter, cost), req.prompt_ids, r["tokens"], trace, tokenizer=tokenizer)
            if not warm:  # online library: learns from the outputs before this one
                method.observe(req, r["tokens"], r["text"])
            if only_calls and not r.get("has_call"):
                continue
            for lab, conf, ok in drafter.tries:
                agg = calib[(lab, min(int(conf * 10), 9))]
                agg[0], agg[1], agg[2] = agg[0] + 1, agg[1] + conf, agg[2] + ok
            if show > 0 and show_bench in (None, r["benchmark"]):
                show -= 1
                print(
                    f"== {name} {r['item']}\n"
                    + "".join(
                        f"[{acc}/{size}]" + tokenizer.decode(r["tokens"][done : done + acc + 1])
                        for done, size, acc, _ in trace
                    )
                )
            b = per_bench[r["benchmark"]]
            b[0] += res["tokens"] - 1
            b[1] += res["steps"]
            b[2] += sum(cost.step_cost(size) for _, size, _, _ in trace)
            b[3] += drafter.seconds
            for done, size, acc, label in trace:
                if acc == 0:
                    lost[_state_at(tokenizer, item, r["tokens"], done)] += 1
            if bounds.get(r["item"]) is not None:
                for reg, vals in region_costs(trace, bounds[r["item"]], cost).items():
                    agg = by_region[r["benchmark"]][reg]
                    by_region[r["benchmark"]][reg] = [a + b for a, b in zip(agg, vals)]
        # MAT, and the speedup the cost curve projects (greedy: one c(1) = 1 step per token)
        out[name] = {
            k: {
                "mat": round(v[0] / max(v[1], 1), 3),
                "proj": round(v[0] / max(v[2], 1e-9), 3),
                "propose_ms_per_step": round(1000 * v[3] / max(v[1], 1), 3),
            }
            for k, v in per_bench.items()
        }
        for k, regs in by_region.items():
            out[name][k]["regions"] = {
                reg: {"tokens": t, "cost": round(c, 2), "proj": round(t / c, 3) if c else None}
                for reg, (_, t, c) in regs.items()
            }
        out[name]["zero_accept_steps_by_state"] = dict(lost.most_common())
        if calibration:
            out[name]["calibration"] = {
                f"{lab} {dec / 10:.1f}": {"tries": n, "conf": round(c / n, 3), "accepted": round(a / n, 3)}
                for (lab, dec), (n, c, a) in sorted(calib.items())
            }
    return out


def region_costs(trace: list, bounds: tuple[int, int], cost) -> dict[str, list]:
    """{region: [steps, tokens, projected cost]} of one replayed output: each step's cost (the curve's
    price of its tree) shared by the tokens it writes (``regions.split_steps``)."""
    return split_steps([acc for _, _, acc, _ in trace], [cost.step_cost(size) for _, size, _, _ in trace], bounds)


class Pruned:
    """A drafter whose trees are cut to ``cost``'s budget as decoding cuts a batch of one
    (``prune_to_budget``), so the replay accepts and prices what decoding would verify."""

    def __init__(self, drafter, cost: CostModel):
        self.drafter, self.cost = drafter, cost

    def propose(self, ctx):
        return prune_to_budget(self.drafter.propose(ctx), self.cost.curve, self.cost.max_nodes)

    def feedback(self, tree, result) -> None:
        self.drafter.feedback(tree, result)


class _Timed:
    """A drafter whose ``propose`` time is summed (drafting cost per step, without the target)."""

    def __init__(self, drafter):
        self.drafter, self.seconds = drafter, 0.0
        self.tries: list[tuple[str, float, bool]] = []  # (label, conf, accepted) of every node tried (tree.tried)

    def propose(self, ctx):
        t0 = time.perf_counter()
        tree = self.drafter.propose(ctx)
        self.seconds += time.perf_counter() - t0
        return tree

    def feedback(self, tree, result) -> None:
        accepted = set(result.path)
        self.tries += [(tree.labels[i], tree.conf[i], i in accepted) for i in tried(tree.parents, result.path)]
        self.drafter.feedback(tree, result)


def _keys(path: Path) -> dict:
    """Retrieval keys (prefill hidden states) the run recorded, by item."""
    if not path.exists():
        return {}
    return {k: decode_hidden(v["hidden"]) for k, v in PrefillCache(path).store.records.items()}


def _warm_docs(raw: Path, cfg: dict, tokenizer, evaluated: set) -> list:
    """The run's warm library, rebuilt as the runner builds it (keys from warm_prefill.jsonl)."""
    keys = _keys(raw / "warm_prefill.jsonl")
    items = [it for p in cfg.get("warm_files") or [] for it in load_items(p)]
    benches = {it["benchmark"] for p in cfg["data"] for it in load_items(p) if it["id"] in evaluated}
    items = [it for it in items if it["benchmark"] in benches and it["id"] not in evaluated]
    items = select_items(items, cfg.get("warm_limit"), cfg.get("seed"))
    embed = (lambda item, ids: keys.get(item["id"])) if keys else None
    return warm_documents(tokenizer, items, [151645], cfg.get("warm_layout") or "fence", embed)


def _state_at(tokenizer, item: dict, tokens: list[int], done: int) -> str:
    from toolspec_core.drafters.toolcall.fsm import CallTracker, ToolIndex

    tr = CallTracker(ToolIndex.from_tools(item.get("tools") or []))
    tr.feed(tokenizer.decode(tokens[:done], skip_special_tokens=True))
    return tr.state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw", nargs="+")
    ap.add_argument("--methods", default="toolspec_schema,toolspec")
    ap.add_argument("--all-items", action="store_true")
    ap.add_argument("--show", type=int, default=0, help="print the step trace of the first N items per method")
    ap.add_argument("--show-bench", default=None, help="print traces of this benchmark's items only")
    ap.add_argument(
        "--cost", default="run", help="run (the run's measured cost.json) | reference | flat | path to a cost JSON"
    )
    ap.add_argument(
        "--json-out", default=None, help="also write {raw: {method: ...}} with the cost curve used to this file"
    )
    ap.add_argument(
        "--shuffle",
        type=int,
        default=None,
        help="replay the items in a random order (this seed), not the run's stream order",
    )
    ap.add_argument(
        "--regions", action="store_true", help="also split projected cost by region (before / call object / after)"
    )
    ap.add_argument(
        "--calibration", action="store_true", help="also tabulate conf vs acceptance per draft label and conf decile"
    )
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    results = {
        "cost": a.cost,
        "subset": "all" if a.all_items else "calls",
        "order": "run" if a.shuffle is None else f"shuffled (seed {a.shuffle})",
        "runs": {},
    }
    for raw in a.raw:
        cost = _cost(Path(raw), a.cost)
        res = results["runs"][raw] = replay(
            Path(raw),
            a.methods.split(","),
            tok,
            cost,
            not a.all_items,
            a.show,
            a.show_bench,
            a.shuffle,
            a.regions,
            a.calibration,
        )
        print(raw, json.dumps(res, indent=1), flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1) + "\n")


def _cost(raw: Path, spec: str) -> CostModel:
    if spec == "run" or spec.endswith(".json"):
        d = json.loads(((raw / "cost.json") if spec == "run" else Path(spec)).read_text())
        return CostModel({int(k): v for k, v in d["points"].items()}, d.get("max_nodes", 63), "run")
    return CostModel.flat() if spec == "flat" else CostModel.cpu_reference()


if __name__ == "__main__":
    main()
