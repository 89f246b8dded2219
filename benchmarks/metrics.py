"""Per-item and aggregated metrics. Pure functions over records (one (item, method, library)
decode each, as items.jsonl holds them), so the report can be rebuilt from items.jsonl alone and
the arithmetic can be tested on hand-made traces."""

from __future__ import annotations

import json
import math
from collections import defaultdict

from toolspec_core.drafters.toolcall.parse import is_name_problem, parse_tool_calls, validate_call

from .cost import host_seconds, projected_speedup
from .loadtest.metrics import mean

# --------------------------------------------------------------------------- per item


def first_mismatch(tokens: list[int], ref: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (a, b) in enumerate(zip(tokens, ref)):
        if a != b:
            return i
    return None if len(tokens) == len(ref) else min(len(tokens), len(ref))


def _norm(v):
    """JSON value normalised for comparison: 1 == 1.0, tuples are lists, dict order ignored."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _norm(x) for k, x in v.items()}
    return v


def _args_match(args: dict, gold: dict, alternatives: dict | None) -> bool:
    """Gold arguments equal; with BFCL alternatives, each value is one of the acceptable ones
    and an argument may be omitted when "" is acceptable."""
    if alternatives is None:
        return _norm(args) == _norm(gold)
    if set(args) - set(alternatives):
        return False
    for name, ok in alternatives.items():
        ok = [_norm(x) for x in (ok if isinstance(ok, list) else [ok])]
        if name not in args:
            if "" not in ok:
                return False
        elif _norm(args[name]) not in ok:
            return False
    return True


def gold_agreement(calls, gold_calls: list[dict], gold_alternatives: list[dict] | None = None) -> tuple[bool, bool]:
    """(names agree as a multiset, every gold call matched by name and arguments, any order)."""
    names_ok = sorted(c.name for c in calls) == sorted(g["name"] for g in gold_calls)
    if not names_ok or not gold_calls:
        return names_ok and bool(gold_calls), False
    alts = gold_alternatives or [None] * len(gold_calls)
    unused = list(calls)
    for g, alt in zip(gold_calls, alts):
        alt_args = alt.get("arguments") if isinstance(alt, dict) else None
        hit = next(
            (c for c in unused if c.name == g["name"] and _args_match(c.arguments, g["arguments"], alt_args)), None
        )
        if hit is None:
            return True, False
        unused.remove(hit)
    return True, True


def call_metrics(text: str, item: dict) -> dict:
    """Tool-call validity (parses, tool exists, argument names valid), completeness (required
    arguments present) and agreement with gold."""
    parsed = parse_tool_calls(text)
    problems = [p for c in parsed.calls for p in validate_call(c, item.get("tools") or [])]
    bad_names = [p for p in problems if is_name_problem(p)]
    name_ok, full_ok = gold_agreement(parsed.calls, item.get("gold_calls") or [], item.get("gold_alternatives"))
    return {
        "calls": [{"name": c.name, "arguments": c.arguments} for c in parsed.calls],
        "has_call": bool(parsed.calls),
        "valid": bool(parsed.calls) and not bad_names,
        "complete": bool(parsed.calls) and not problems,
        "problems": problems,
        "gold_name_match": name_ok,
        "gold_match": full_ok,
    }


def answer_metrics(text: str, item: dict) -> dict:
    """A structured answer's metrics under the call metrics' keys: ``valid`` -- JSON that follows
    the item's ``response_format`` schema; ``gold_match`` -- equal to the gold arguments."""
    from .data import response_schema

    problems: list[str] = []
    try:
        answer = json.loads(text)
    except json.JSONDecodeError as exc:
        answer, problems = None, [f"not JSON: {exc.msg}"]
    if not problems:
        try:
            import jsonschema

            jsonschema.validate(answer, response_schema(item) or {})
        except jsonschema.ValidationError as exc:
            problems = [f"schema: {exc.message}"]
    gold = item.get("gold_answer")
    match = gold is not None and isinstance(answer, dict) and _args_match(answer, gold, None)
    return {
        "calls": [],
        "has_call": False,
        "answer": answer,
        "valid": not problems,
        "complete": not problems,
        "problems": problems,
        "gold_name_match": not problems,
        "gold_match": match,
    }


# --------------------------------------------------------------------------- aggregation


def decoded_tokens(r: dict) -> int:
    """Tokens produced by decode forwards: not the first (from prefill), not grammar-forced ones."""
    return r["generated_tokens"] - 1 - r.get("forced_tokens", 0)


def _geomean(xs) -> float | None:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def per_state(records: list[dict]) -> dict:
    """Per FSM state / draft label: steps, mean accepted per step, node acceptance rate."""
    steps: dict[str, list[int]] = defaultdict(list)
    drafted: dict[str, int] = defaultdict(int)
    accepted: dict[str, int] = defaultdict(int)
    for r in records:
        for lab, acc in zip(r["step_labels"], r["accepted_per_step"]):
            steps[lab].append(acc)
        for lab, n in r["label_drafted"].items():
            drafted[lab] += n
        for lab, n in r["label_accepted"].items():
            accepted[lab] += n
    out = {}
    for lab in sorted(set(steps) | set(drafted)):
        s = steps.get(lab, [])
        out[lab] = {
            "steps": len(s),
            "mean_accepted": mean(s),
            "drafted_nodes": drafted.get(lab, 0),
            "accepted_nodes": accepted.get(lab, 0),
            "node_acceptance": accepted[lab] / drafted[lab] if drafted.get(lab) else None,
        }
    return out


COST_BUCKETS = ((1, 1), (2, 3), (4, 8), (9, 16), (17, 32), (33, 64))


def observed_cost(records: list[dict]) -> dict[str, dict]:
    """The verify-cost curve as the run really paid it, by forward size (tree nodes + 1): each step's
    seconds over the median plain-greedy step of the same item (``ar_step_s``), median per size
    bucket. A curve measured at start-up on a busy shared machine can be off; this is what it
    should have said. Empty for records without per-step timings (older runs)."""
    ratios: dict[str, list[float]] = defaultdict(list)
    rows_seen: dict[str, list[int]] = defaultdict(list)
    for r in records:
        base, steps = r.get("ar_step_s"), r.get("verify_per_step")
        if not base or not steps:
            continue
        for k, t in zip(r["drafted_per_step"], steps):
            rows = min(k + 1, COST_BUCKETS[-1][1])
            lo, hi = next(b for b in COST_BUCKETS if b[0] <= rows <= b[1])
            key = f"{lo}-{hi}" if lo != hi else str(lo)
            ratios[key].append(t / base)
            rows_seen[key].append(k + 1)
    out = {}
    for key in sorted(ratios, key=lambda x: int(x.split("-")[0])):
        xs, ks = sorted(ratios[key]), sorted(rows_seen[key])
        out[key] = {"steps": len(xs), "median_rows": ks[len(ks) // 2], "cost": xs[len(xs) // 2]}
    return out


def summarize(
    records: list[dict],
    ar_by_item: dict[str, dict],
    curves: dict[str, list[float]] | None = None,
    step_seconds: dict[str, float] | None = None,
) -> dict:
    """Aggregate one (benchmark, method, library, subset) group against plain greedy.

    mat = Σ decoded tokens / Σ forwards (as GenerationStats.mat: the first token comes from
    prefill, grammar-forced tokens need no forward);
    decode_speedup = Σ AR decode time / Σ method decode time over the same items (total-time
    ratio); mean/geomean_item_speedup average the per-item ratios.
    """
    ar = [ar_by_item[r["item"]] for r in records]
    # plain greedy's time as the record measured it (same run; see runner.finish_record)
    ref = [r.get("ar_decode_s") or a["decode_s"] for r, a in zip(records, ar)]
    decoded = sum(decoded_tokens(r) for r in records)
    forwards = sum(r["forwards"] for r in records)
    t_me, t_ar = sum(r["decode_s"] for r in records), sum(ref)
    e2e_me = sum(r["prefill_s"] + r["decode_s"] for r in records)
    e2e_ar = sum(r["prefill_s"] + t for r, t in zip(records, ref))
    item_speedups = [t / r["decode_s"] if r["decode_s"] > 0 else None for r, t in zip(records, ref)]
    n = len(records)

    def share(key: str) -> float | None:
        return sum(bool(r[key]) for r in records) / n if n else None

    out = {
        "items": n,
        "mat": decoded / forwards if forwards else 1.0,
        "decode_speedup": t_ar / t_me if t_me > 0 else None,
        "exact_match": share("exact_match"),
        "mean_item_speedup": mean(item_speedups),
        "geomean_item_speedup": _geomean(item_speedups),
        "e2e_speedup": e2e_ar / e2e_me if e2e_me > 0 else None,
        "mean_item_mat": mean(r["mat"] for r in records),
        "generated_tokens": sum(r["generated_tokens"] for r in records),
        "forwards": forwards,
        "decode_s": t_me,
        "ar_decode_s": t_ar,
        "prefill_s": sum(r["prefill_s"] for r in records),
        "draft_s": sum(r.get("draft_s", 0.0) for r in records),
        "host_ms_per_step": 1000 * sum(host_seconds(r) for r in records) / forwards if forwards else None,
        "mean_tree_size": mean(k for r in records for k in r["drafted_per_step"]),
        # of the calls written, or of the structured answers (every record that has one)
        "validity": mean(float(r["valid"]) for r in records if r["has_call"] or "answer" in r),
        "completeness": mean(float(r.get("complete", False)) for r in records if r["has_call"]),
        "gold_name_agreement": share("gold_name_match"),
        "gold_agreement": share("gold_match"),
        "per_state": per_state(records),
    }
    if curves:
        out["projected_speedup"] = {name: projected_speedup(ar, records, c) for name, c in curves.items()}
        out["projected_speedup_with_host"] = {
            name: projected_speedup(ar, records, curves[name], s)
            for name, s in (step_seconds or {}).items()
            if name in curves
        }
    return out
