"""Build the report (JSON + Markdown + PNG plots) from a run directory's items.jsonl alone."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

from .cost import RESULTS, load_curves
from .metrics import decoded_tokens, first_mismatch, observed_cost, summarize
from .plots import md_section, md_table, run_label
from .runner import ALL_METHODS, item_store

BASELINES = ("pld", "suffix", "token_recycling")
# Idealised MAT bound for a perfect schema + context-copy drafter (benchmarks/datasets/README.md, "How far
# drafting can go", Qwen2.5 tokenizer, gold calls): (compact <tool_call> layout, ```json pretty).
# The embedded model writes both layouts, so MAT is reported as a fraction of each.
MAT_BOUND = {"api_bank": (4.1, 5.1), "bfcl_v3": (7.3, 9.5), "toolalpaca": (9.9, 12.9)}
SUBSET_TITLES = {
    "all": "All items",
    "calls": "Items whose plain-greedy output contains a tool call",
    "prose": "Items answered in prose (no tool call in plain-greedy output)",
}
SUBSETS = tuple(SUBSET_TITLES)
CONFIG_KEYS = ("data", "limit", "seed", "methods", "libraries", "max_new_tokens", "warm_files", "warm_layout", "cost")
PRIOR_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 2, "2"), (3, 4, "3-4"), (5, 9, "5-9"), (10, 10**9, "10+"))


def _method_order(m: str) -> int:
    return ALL_METHODS.index(m) if m in ALL_METHODS else len(ALL_METHODS)


def load_records(out: Path) -> tuple[list[dict], dict[str, dict]]:
    """(every successful record, plain-greedy record by item) with exact match recomputed."""
    recs = list(item_store(Path(out)).records.values())
    # an interrupted run leaves its last item(s) with only some methods done: report an item only
    # when every (method, library) of the run has it, so all methods are compared on the same items
    runs_per_item: dict[str, set] = defaultdict(set)
    for r in recs:
        runs_per_item[r["item"]].add((r["method"], r["library"]))
    full = set().union(*runs_per_item.values()) if runs_per_item else set()
    recs = [r for r in recs if runs_per_item[r["item"]] == full]
    ar = {r["item"]: r for r in recs if r["method"] == "ar"}
    for r in recs:
        if r["item"] in ar:
            r["first_mismatch"] = first_mismatch(r["tokens"], ar[r["item"]]["tokens"])
            r["exact_match"] = r["first_mismatch"] is None
    return recs, ar


def prior_tool_calls(ar: dict[str, dict], items_tools: dict[str, str | None]) -> dict[str, int]:
    """Per item: how many calls of the same tool plain greedy made on earlier items of its
    benchmark stream (what an online library has seen of this tool)."""
    out: dict[str, int] = {}
    by_bench: dict[str, list[dict]] = defaultdict(list)
    for r in ar.values():
        by_bench[r["benchmark"]].append(r)
    for recs in by_bench.values():
        seen: dict[str, int] = defaultdict(int)
        for r in sorted(recs, key=lambda x: x["index"]):
            tool = r["calls"][0]["name"] if r["calls"] else items_tools.get(r["item"])
            out[r["item"]] = seen[tool] if tool else 0
            for c in r["calls"]:
                seen[c["name"]] += 1
    return out


def _bucket(n: int) -> str:
    return next(lab for lo, hi, lab in PRIOR_BUCKETS if lo <= n <= hi)


def agreed_keys(run: dict) -> dict:
    """A single-stream run in the results format every report shares (the batched benchmark's
    too): batch 1, decode tokens/s and the speedup over plain greedy named as there."""
    decode_s = run.get("decode_s") or 0.0
    return {
        "benchmark": run.pop("benchmark"),
        "method": run.pop("method"),
        "batch": 1,
        "items": run.pop("items"),
        "decode_tokens_per_s": run["generated_tokens"] / decode_s if decode_s else None,
        "speedup_vs_ar": run["decode_speedup"],
        "mat": run.pop("mat"),
        "exact_match": run.pop("exact_match"),
        **run,
    }


def build_runs(recs: list[dict], ar: dict[str, dict], curves: dict, step_seconds: dict | None = None) -> list[dict]:
    """One run entry per (benchmark, method, library, subset) in the issue-5 format + extras."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in recs:
        if r["item"] in ar:
            groups[(r["benchmark"], r["method"], r["library"])].append(r)
    runs = []
    for (bench, method, lib), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], _method_order(kv[0][1]), kv[0][2] or "")
    ):
        for subset in SUBSETS:
            if subset != "all" and bench.startswith("structured_"):
                continue  # answers, never calls: only the whole set
            sub = rs if subset == "all" else [r for r in rs if ar[r["item"]]["has_call"] == (subset == "calls")]
            if not sub:
                continue
            s = summarize(sub, ar, curves, step_seconds)
            bound = MAT_BOUND.get(bench)
            runs.append(agreed_keys({"benchmark": bench, "method": method, "library": lib, "subset": subset, **s}))
            if bound and subset == "calls":
                runs[-1]["mat_bound"] = list(bound)
                runs[-1]["mat_of_bound"] = [runs[-1]["mat"] / b for b in bound]
    return runs


def headline(runs: list[dict]) -> list[dict]:
    """Per benchmark and subset: full ToolSpec vs plain greedy and vs the best baseline."""
    out = []
    keyed = defaultdict(list)
    for r in runs:
        keyed[(r["benchmark"], r["subset"])].append(r)
    for (bench, subset), rs in sorted(keyed.items()):
        base = [r for r in rs if r["method"] in BASELINES and r["decode_speedup"]]
        best = max(base, key=lambda r: r["decode_speedup"], default=None)
        for r in rs:
            if r["method"] != "toolspec" or not r["decode_speedup"]:
                continue
            row = {"benchmark": bench, "subset": subset, "library": r["library"], "items": r["items"]}
            row.update(toolspec_speedup=r["decode_speedup"], toolspec_mat=r["mat"])
            row["best_baseline"] = run_label(best["method"], best["library"]) if best else None
            row["best_baseline_speedup"] = best["decode_speedup"] if best else None
            row["over_best_baseline"] = r["decode_speedup"] / best["decode_speedup"] if best else None
            out.append(row)
    return out


def mat_vs_prior(recs: list[dict], ar: dict[str, dict], prior: dict[str, int]) -> dict:
    """MAT per (method, library) by bucket of earlier calls of the same tool."""
    acc: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    for r in recs:
        if r["item"] not in prior or r["method"] == "ar":
            continue
        cell = acc[run_label(r["method"], r["library"])][_bucket(prior[r["item"]])]
        cell[0] += 1
        cell[1] += decoded_tokens(r)
        cell[2] += r["forwards"]
    order = [lab for _, _, lab in PRIOR_BUCKETS]
    return {
        label: {
            b: {"items": c[0], "mat": c[1] / c[2] if c[2] else None}
            for b, c in sorted(cells.items(), key=lambda kv: order.index(kv[0]))
        }
        for label, cells in acc.items()
    }


def build_report(
    out: Path, name: str | None = None, results_dir: Path = RESULTS, plots: bool = True, data: list[str] | None = None
) -> dict:
    """Write ``<results_dir>/<name>.json`` / ``.md`` and ``<name>_plots/*.png``; return the JSON.

    ``data``: where the run's JSONL files are on this machine, when the run was made elsewhere (a GPU
    machine); by default the paths in the run's config."""
    out = Path(out)
    name = name or out.name
    cfg = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    cost = json.loads((out / "cost.json").read_text()) if (out / "cost.json").exists() else None
    recs, ar = load_records(out)
    curves, step_seconds = load_curves(Path(results_dir) / "curves")
    if cost:
        from .cost import curve_from_points

        curves = {"run": curve_from_points(cost["points"]), **curves}
    gold_tool = _gold_tools(data or cfg.get("data", []))
    prior = prior_tool_calls(ar, gold_tool)
    runs = build_runs(recs, ar, curves, step_seconds)
    report = {
        "name": name,
        "model": cfg.get("target", "unknown"),
        "hardware": cfg.get("hardware", "unknown"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cost_model": cost,
        "projection_curves": sorted(curves),
        "projection_step_seconds": step_seconds,
        "config": {k: cfg.get(k) for k in CONFIG_KEYS},
        "retrieval": retrieval_key_summary(cfg, recs),
        "runs": runs,
        "headline": headline(runs),
        "mismatches": [
            {"item": r["item"], "method": r["method"], "library": r["library"], "first_mismatch": r["first_mismatch"]}
            for r in recs
            if r["item"] in ar and not r["exact_match"]
        ],
        "mat_vs_prior_calls": mat_vs_prior(recs, ar, prior),
        "observed_cost": observed_cost([r for r in recs if r["method"] != "ar" and r["item"] in ar]),
    }
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    (results_dir / f"{name}.md").write_text(markdown(report))
    if plots and runs:
        from .plots import write_plots

        write_plots(report, recs, results_dir / f"{name}_plots")
    return report


def _gold_tools(paths: list[str]) -> dict[str, str | None]:
    from .data import load_items

    out = {}
    for p in paths:
        if Path(p).exists():
            for it in load_items(p):
                out[it["id"]] = it["gold_calls"][0]["name"] if it.get("gold_calls") else None
    return out


def _fmt(x, spec=".2f", suffix="") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _retrieval_line(r: dict | None) -> list[str]:
    if not r:
        return []
    if r["key"] == "hidden":
        return ["- retrieval key: hidden (the target's last prompt state, in-process memory library)"]
    ms = ""
    if "mean_key_ms" in r:
        ms = f"; encoder {r['mean_key_ms']:.0f} ms mean / {r['p95_key_ms']:.0f} ms p95 per request"
    return [
        f"- retrieval key: {r['key']} (request text keyed as the Retrieval deployment keys it, memory store{ms}, "
        "computed before decode timing as serving overlaps it with prefill)"
    ]


def retrieval_key_summary(cfg: dict, recs: list[dict]) -> dict:
    """How library methods keyed the call library (runs before the option keyed by ``hidden``),
    and the text encoder's time per keyed request (not part of any decode time)."""
    key = cfg.get("retrieval_key") or "hidden"
    secs = {r["item"]: r["key_s"] for r in recs if r.get("key_s") is not None}
    out = {"key": key, "keyed_requests": len(secs)}
    if secs:
        vals = sorted(secs.values())
        out["mean_key_ms"] = 1e3 * sum(vals) / len(vals)
        out["p95_key_ms"] = 1e3 * vals[min(len(vals) - 1, int(0.95 * len(vals)))]
    return out


def markdown(report: dict) -> str:
    """benchmark × method table per subset: MAT, speedups, exact match, validity, projections."""
    proj = [c for c in report["projection_curves"] if c != "cpu_reference"]
    lines = [
        f"# Benchmark report: {report['name']}",
        "",
        f"- model: {report['model']}",
        f"- hardware: {report['hardware']}",
        *_retrieval_line(report.get("retrieval")),
        "- decode speedup = Σ plain-greedy decode time / Σ method decode time on the same items (same loop, cache, process); "
        "per-item = mean of per-item ratios; projected = Σ plain-greedy step cost / Σ method step cost under another cost curve "
        "(the method's actual trees; drafting time ignored)",
        "",
    ]
    if report["mismatches"]:
        failed = (f"{m['item']} ({_label(m)}, token {m['first_mismatch']})" for m in report["mismatches"][:20])
        lines += [f"**EXACT-MATCH FAILURES: {len(report['mismatches'])}** — " + ", ".join(failed), ""]
    for h in report["headline"]:
        lines.append(
            f"- **{h['benchmark']} / {h['subset']}** ({h['items']} items): toolspec/{h['library']} {h['toolspec_speedup']:.2f}× "
            f"(MAT {h['toolspec_mat']:.2f}); best baseline {h['best_baseline']} {_fmt(h['best_baseline_speedup'])}× "
            f"→ {_fmt(h['over_best_baseline'])}× over it"
        )
    head = ["benchmark", "method", "items", "MAT", "speedup", "per-item", "e2e", "exact", "valid", "gold"]
    for subset, title in SUBSET_TITLES.items():
        rows = [_subset_row(r, proj) for r in report["runs"] if r["subset"] == subset]
        if rows:
            lines += md_section(
                f"{title} (subset `{subset}`)", None, md_table(head + [f"proj. {c}" for c in proj], rows)
            )
    for section in (_host_lines, _bound_lines, _state_lines, _prior_lines, _cost_lines):
        lines += section(report)
    return "\n".join(lines) + "\n"


def _label(r: dict) -> str:
    return run_label(r["method"], r["library"])


def _pct(x) -> str:
    return _fmt(None if x is None else 100 * x, ".0f", "%")


def _subset_row(r: dict, proj: list[str]) -> list[str]:
    speedups = [r["decode_speedup"], r["mean_item_speedup"], r["e2e_speedup"]]
    speedups += [r.get("projected_speedup", {}).get(c) for c in proj]
    cells = [r["benchmark"], _label(r), str(r["items"]), _fmt(r["mat"])] + [_fmt(x, ".2f", "×") for x in speedups[:3]]
    cells += [_pct(r["exact_match"]), _pct(r["validity"]), _pct(r["gold_agreement"])]
    return cells + [_fmt(x, ".2f", "×") for x in speedups[3:]]


def _host_lines(report: dict) -> list[str]:
    """Accelerator projections with this run's host-side time per step added (subset `calls`)."""
    secs = report.get("projection_step_seconds") or {}
    runs = [r for r in report["runs"] if r["subset"] == "calls" and r.get("projected_speedup_with_host")]
    if not secs or not runs:
        return []
    names = sorted(secs)
    rows = []
    for r in runs:
        rows.append([r["benchmark"], _label(r), _fmt(r.get("host_ms_per_step"), ".2f")])
        for n in names:
            rows[-1] += [_fmt(r.get("projected_speedup", {}).get(n), ".2f", "×")]
            rows[-1] += [_fmt(r["projected_speedup_with_host"].get(n), ".2f", "×")]
    return md_section(
        "Accelerator projections with drafting time (subset `calls`)",
        "`proj.`: Σ step cost under the measured curve, as above; `+ host`: steps in seconds (c(1) = "
        + ", ".join(f"{secs[n] * 1000:.1f} ms for {n}" for n in names)
        + ") plus each decode's measured drafting + commit time from this run (this machine's CPU, not overlapped "
        "with the forward). Where a step takes milliseconds, drafting time is what separates the two.",
        md_table(
            ["benchmark", "method", "host ms / step"] + [h for n in names for h in (f"proj. {n}", "+ host")], rows
        ),
    )


def _bound_lines(report: dict) -> list[str]:
    runs = [r for r in report["runs"] if r.get("mat_of_bound") and r["method"] != "ar"]
    if not runs:
        return []
    rows = [
        [r["benchmark"], _label(r), f"{r['mat']:.2f}", "{:.1f} / {:.1f}".format(*r["mat_bound"])]
        + ["{1:.0%} – {0:.0%}".format(*r["mat_of_bound"])]
        for r in runs
    ]
    return md_section(
        "MAT against the idealised bound (subset `calls`)",
        "Bound: a perfect schema + context-copy drafter on the gold calls (benchmarks/datasets/README.md), for the compact "
        "`<tool_call>` layout and the ```` ```json ```` pretty layout; the embedded model writes both.",
        md_table(["benchmark", "method", "MAT", "bound (compact / pretty)", "fraction of bound"], rows),
    )


def _state_lines(report: dict) -> list[str]:
    """Where the steps go: per draft label (FSM state of the step's first node) for ToolSpec methods."""
    rows = []
    for r in report["runs"]:
        if r["subset"] != "calls" or not r["method"].startswith("toolspec") or not r.get("per_state"):
            continue
        total = sum(v["steps"] for v in r["per_state"].values()) or 1
        for lab, v in sorted(r["per_state"].items(), key=lambda kv: -kv[1]["steps"]):
            if v["steps"]:
                rows.append([r["benchmark"], _label(r), lab, v["steps"], f"{v['steps'] / total:.0%}"])
                rows[-1] += [_fmt(v["mean_accepted"]), _pct(v["node_acceptance"])]
    if not rows:
        return []
    head = ["benchmark", "method", "state", "steps", "share of steps", "mean accepted / step", "node acceptance"]
    return md_section(
        "Steps per FSM state / draft source (ToolSpec methods, subset `calls`)",
        "A step's state is the label of its first accepted node (or its first drafted node when none was "
        "accepted; `none`: nothing was worth drafting under the cost curve). Few accepted tokens per step "
        "in a state with many steps is where the remaining gap is.",
        md_table(head, rows),
    )


def _prior_lines(report: dict) -> list[str]:
    """The repeated-call curve: MAT by how many earlier calls of the same tool the stream had."""
    table = report.get("mat_vs_prior_calls") or {}
    keep = {k: v for k, v in table.items() if k.startswith("toolspec")}
    if not keep:
        return []
    buckets = [lab for _, _, lab in PRIOR_BUCKETS]
    rows = [
        [label] + [f"{c[b]['mat']:.2f} ({c[b]['items']})" if b in c and c[b]["mat"] else "–" for b in buckets]
        for label, c in sorted(keep.items())
    ]
    return md_section("MAT by earlier calls of the same tool (all items)", None, md_table(["method", *buckets], rows))


def _cost_lines(report: dict) -> list[str]:
    """The verify cost the run paid per forward size next to the curve its budget used."""
    seen = report.get("observed_cost") or {}
    if not seen:
        return []
    from .cost import curve_from_points

    curve = curve_from_points(report["cost_model"]["points"]) if report.get("cost_model") else None
    rows = [
        [key, v["steps"], v["median_rows"], f"{v['cost']:.2f}"]
        + [_fmt(curve[min(v["median_rows"], len(curve) - 1)] if curve else None)]
        for key, v in seen.items()
    ]
    head = ["forward size", "steps", "median size", "observed cost", "run curve at median size"]
    return md_section(
        "Verify cost as paid vs the budget's curve (all tree methods)",
        "Each step's time over the median plain-greedy step of the same item (same run); median per "
        "forward size (tree nodes + 1).",
        md_table(head, rows),
    )
