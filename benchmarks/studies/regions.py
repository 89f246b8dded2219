"""Study: decode time before / inside / after the call object. Result: benchmarks/results/measurements/regions-{3bench-cpu-avx512-afe9e69,apibank-full-cpu-avx512-093f8a8}.json.

Where decode time goes in outputs that hold a call: before the call (prose, an opener such as a
fence), the first call object itself, and after it (prose, tool results the model makes up,
further calls), per benchmark and method, from a run's raw records.

Schema drafting knows only the call; outside it every ToolSpec method drafts what the suffix
baseline drafts (suffix matches over the context and the same history). This splits a method's
measured step times by the regions of the tokens each step writes, so the ratio over the best
baseline can be read where the schema can help and where it cannot.

    python -m benchmarks.studies.regions benchmarks/runs/RUN [--out F.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from benchmarks.data import load_items
from benchmarks.report import BASELINES, run_label
from toolspec_core.drafters.toolcall.fsm import CallTracker, ToolIndex
from toolspec_core.engine.detokenize import Detokenizer
from toolspec_core.model.prompting import turn_end_ids

REGIONS = ("before", "call", "after")
TARGET = 1.5  # issue #5's goal over the best baseline


def run_items(raw: str | Path) -> dict[str, dict]:
    """The items of a run's data files (its raw folder's config.json), by id."""
    cfg = json.loads((Path(raw) / "config.json").read_text())
    return {it["id"]: it for p in cfg["data"] for it in load_items(p, cfg.get("structured", False))}


def call_bounds(tokenizer, tools: list[dict], tokens: list[int]) -> tuple[int, int] | None:
    """(start, end) token indices of the first call: ``start`` is the token that opens its JSON
    object (an opener such as a fence counts as text before it), ``end`` is one past the token that
    completes it. None: the tracker sees no complete call.

    Tokens go through a ``Detokenizer``, one at a time, as decoding feeds the drafter's tracker.
    """
    tr = CallTracker(ToolIndex.from_tools(tools))
    detok = Detokenizer(tokenizer, turn_end_ids(tokenizer))
    fed, start = 0, None  # tokens whose text the tracker has seen; where the first object opened
    for i, tok in enumerate(tokens):
        piece = detok.feed([tok])
        if not piece:
            continue
        tr.feed(piece)
        if start is None and (tr.stack or tr.calls):
            start = fed
        fed = i + 1
        if tr.calls:
            return start, i + 1
    return None


def region_of(pos: int, bounds: tuple[int, int]) -> str:
    """The region of output token ``pos`` given the first call's (start, end) token indices."""
    start, end = bounds
    return "before" if pos < start else "call" if pos < end else "after"


def token_shares(accepted: list[int], bounds: tuple[int, int], first: int = 1):
    """(step index, region, 1 / tokens of the step) for every token a step writes: a step that
    writes tokens in two regions (one that drafts from the prose through an opener into the call)
    is shared between them by its tokens. ``first``: the index of the first token a step writes
    (the token before it comes from prefill)."""
    pos = first
    for i, acc in enumerate(accepted):
        n = acc + 1
        for p in range(pos, pos + n):
            yield i, region_of(p, bounds), 1 / n
        pos += n


def split_steps(accepted: list[int], seconds: list[float], bounds: tuple[int, int], first: int = 1) -> dict[str, list]:
    """{region: [steps, tokens, seconds]} of one output; steps and seconds can be fractional
    (:func:`token_shares`)."""
    return region_sums(split_by_label(accepted, seconds, [""] * len(accepted), bounds, first))


def region_sums(split: dict[tuple[str, str], list]) -> dict[str, list]:
    """{region: [steps, tokens, seconds]} of a :func:`split_by_label` split, its labels summed."""
    out = {r: [0.0, 0, 0.0] for r in REGIONS}
    for (reg, _), vals in split.items():
        out[reg] = [a + b for a, b in zip(out[reg], vals)]
    return out


def split_by_label(
    accepted: list[int], seconds: list[float], labels: list[str], bounds: tuple[int, int], first: int = 1
) -> dict[tuple[str, str], list]:
    """{(region, step label): [steps, tokens, seconds]}: which draft source wrote each region's
    tokens ("none": a step that drafted nothing), so a region's time can be read by source."""
    out: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for i, reg, share in token_shares(accepted, bounds, first):
        agg = out[(reg, labels[i])]
        agg[0] += share
        agg[1] += 1
        agg[2] += seconds[i] * share
    return dict(out)


def step_seconds(rec: dict) -> list[float]:
    """Each step's verify time plus an even share of the record's drafting and commit time, so the
    steps add up to its decode time."""
    verify = rec["verify_per_step"]
    extra = (rec["decode_s"] - sum(verify)) / max(len(verify), 1)
    return [v + extra for v in verify]


def region_table(records: list[dict], items: dict, tokenizer) -> dict:
    """Per benchmark (and, with several, "all" of them pooled): items split, the best baseline
    (least total decode time on these items) and, per method and region, steps / tokens / MAT /
    seconds / share of the method's time / speedup over plain greedy / ratio over the best baseline."""
    by_item: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for r in records:
        by_item[r["item"]][run_label(r["method"], r.get("library"))] = r
    # pool -> method -> (region, step label) -> [steps, tokens, seconds]; region totals derive from it
    by_label: dict = collections.defaultdict(
        lambda: collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0.0]))
    )
    counts: collections.Counter = collections.Counter()
    for item, recs in by_item.items():
        ar = recs.get("ar")
        if ar is None or not ar.get("has_call"):
            continue
        bench = ar["benchmark"]
        bounds = call_bounds(tokenizer, items[item].get("tools") or [], ar["tokens"])
        pools = (bench, "all")  # "all": every benchmark's items pooled
        if bounds is None:  # a call the tracker does not complete: left out, counted
            counts.update((key, "unparsed") for key in pools)
            continue
        counts.update((key, "items") for key in pools)
        for m, rec in recs.items():
            split = split_by_label(rec["accepted_per_step"], step_seconds(rec), rec["step_labels"], bounds)
            for key in pools:
                for reg_lab, vals in split.items():
                    by_label[key][m][reg_lab] = [a + b for a, b in zip(by_label[key][m][reg_lab], vals)]
    if len(by_label) == 2:  # one benchmark: its pool is itself
        del by_label["all"]
    out = {}
    for bench, methods in by_label.items():
        table = summarize_regions({m: region_sums(split) for m, split in methods.items()})
        out[bench] = {"items": counts[(bench, "items")], "unparsed": counts[(bench, "unparsed")], **table}
        for m, row in out[bench]["methods"].items():
            add_label_split(row, methods[m])
    return out


def add_label_split(table: dict, by_label: dict[tuple[str, str], list]) -> None:
    """Each region of a method's row gets ``by_label``: steps / tokens / MAT / seconds / share of the
    method's time per step label, most time first."""
    for (reg, lab), (s, t, sec) in sorted(by_label.items(), key=lambda kv: -kv[1][2]):
        table[reg].setdefault("by_label", {})[lab] = {
            "steps": round(s, 1),
            "tokens": t,
            "mat": round(t / s, 2) if s else None,
            "seconds": round(sec, 2),
            "share": round(sec / table["total_s"], 3) if table["total_s"] else None,
        }


def summarize_regions(methods: dict[str, dict[str, list]]) -> dict:
    """The best baseline (least total time) and each method's per-region figures from
    {method: {region: [steps, tokens, seconds]}}; ``call_over_best_for_target``: how much faster than
    the best baseline the call object would have to be for the whole output to reach ``TARGET``
    over it, the rest as it is (None: out of reach even with a free call)."""
    total = {m: sum(v[2] for v in regs.values()) for m, regs in methods.items()}
    bases = [m for m in methods if m.split("/")[0] in BASELINES]
    best = min(bases, key=total.get) if bases else None
    table = {}
    for m, regs in methods.items():
        table[m] = {"total_s": round(total[m], 2)}
        if best:
            table[m]["over_best"] = round(total[best] / total[m], 3)
            room = total[best] / TARGET - (total[m] - regs["call"][2])  # time left for the call object
            table[m]["call_over_best_for_target"] = round(methods[best]["call"][2] / room, 2) if room > 0 else None
        for reg, (s, t, sec) in regs.items():
            ar_sec, best_sec = methods["ar"][reg][2], methods[best][reg][2] if best else 0.0
            table[m][reg] = {
                "steps": round(s, 1),
                "tokens": t,
                "mat": round(t / s, 2) if s else None,
                "seconds": round(sec, 2),
                "share": round(sec / total[m], 3) if total[m] else None,
                "speedup": round(ar_sec / sec, 2) if sec and ar_sec else None,
                "over_best": round(best_sec / sec, 2) if sec and best_sec else None,
            }
    return {"best_baseline": best, "target": TARGET, "methods": table}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw", help="a run's raw folder (config.json, items.jsonl)")
    ap.add_argument("--out", default=None, help="also write the table to this JSON file")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    raw = Path(a.raw)
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    items = run_items(raw)
    records = [json.loads(line) for line in open(raw / "items.jsonl")]
    res = {
        "what": "decode time of outputs with a call, split by region (a step spanning two regions shared by its tokens): "
        "before the first call object (prose, openers), the call object, after it (prose, made-up tool "
        "results, further calls); seconds = measured verify time + an even share of drafting/commit time",
        "source": str(raw / "items.jsonl"),
        "by_benchmark": region_table(records, items, tok),
    }
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
