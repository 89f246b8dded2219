"""Pure arithmetic of the load test: per-request timings, percentiles, goodput, level summaries.

Definitions follow ``vllm bench serve``, so numbers can be compared with it:

- TTFT: request sent -> first streamed chunk that carries content or a tool-call delta.
- TPOT: (E2E - TTFT) / (output tokens - 1), the mean time per output token after the first.
- ITL: gap between consecutive streamed chunks, per token. An SSE chunk does not say how many
  tokens it carries (a speculative step can emit several); the output tokens after the first
  chunk are spread evenly over the later chunks, so each gap counts as ``gap / tokens_per_chunk``.
  Each gap is one sample; a level's ITL distribution pools the samples of all its requests.
- E2E: request sent -> response complete.
- Server first token: when a ToolSpec server generated the first token, in ms after its HTTP route
  got the request (its ``toolspec.first_token_ms``; other servers do not say). TTFT minus it is
  what the first chunk waited for after the token (a call's name is streamed whole).
- Call complete: request sent -> the chunk that closed the first tool call's arguments (or, where
  a server leaves the call in ``content``, the chunk after which the content parses to a call).
- Prefix cached share: prompt tokens the server says it took from its prefix cache
  (``usage.prompt_tokens_details.cached_tokens``) over the prompt tokens of the requests that
  report it; None where no response reports it.

Every time is measured on the client that sent the request (its own monotonic clock), so clients
on different machines need no clock agreement.
"""

from __future__ import annotations

import argparse
import collections
import math

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "tpot", "e2e")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def distribution(values) -> dict:
    """{"mean", "p50", "p90", "p95", "p99"} of the non-None values (all None when there are none)."""
    xs = [float(v) for v in values if v is not None]
    return {"mean": mean(xs), **{f"p{q}": percentile(xs, q) for q in PERCENTILES}}


def first_token_gap_ms(rec: dict) -> float | None:
    """How long a request sat between its first token and its next step on a ToolSpec server, in
    ms: from the end of the step that gave it its first token to the start of the forward of its
    next own step (that step's end less its forward time), read from the early steps of its
    server timeline (``--timeline``). A sequence that waits after its prefill -- for a held first
    draft, or behind other sequences' prompt chunks -- shows here, not in TTFT (its first token
    is out) nor in the server's forward time. None without a timeline or a second step."""
    timeline = rec.get("server_timeline")
    steps = (timeline.get("early_steps") if isinstance(timeline, dict) else None) or []
    for first, after in zip(steps, steps[1:]):
        if first.get("generated") == 1:
            return 1e3 * (after["end"] - after["forward_s"] - first["end"])
    return None


def request_timings(sent: float, chunk_times: list[float] | None, finished: float, output_tokens: int | None) -> dict:
    """TTFT, TPOT, ITL samples and E2E (ms) of one request from its client-side timestamps (s).

    ``chunk_times`` is None for a non-streamed request: only E2E is known then.
    """
    e2e = (finished - sent) * 1e3
    if not chunk_times:
        return {"ttft_ms": None, "tpot_ms": None, "itl_ms": [], "e2e_ms": e2e}
    ttft = (chunk_times[0] - sent) * 1e3
    tokens = output_tokens if output_tokens is not None else len(chunk_times)
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else None
    itl = []
    if len(chunk_times) > 1:
        per_chunk = max(tokens - 1, 1) / (len(chunk_times) - 1)
        itl = [(b - a) * 1e3 / per_chunk for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    return {"ttft_ms": ttft, "tpot_ms": tpot, "itl_ms": itl, "e2e_ms": e2e}


def parse_slo(text: str) -> dict[str, float]:
    """'ttft:200,tpot:50,e2e:2000' -> {"ttft": 200.0, ...} (milliseconds)."""
    slo = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition(":")
        if not sep or key not in SLO_KEYS:
            raise argparse.ArgumentTypeError(f"--slo wants KEY:MS pairs with KEY in {SLO_KEYS}: {text!r}")
        try:
            slo[key] = float(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--slo: not a number of ms: {part!r}") from exc
    return slo


def meets_slo(rec: dict, slo: dict[str, float]) -> bool:
    """A successful request whose every SLO'd metric is known and within its limit."""
    if not rec.get("ok"):
        return False
    for key, limit in slo.items():
        value = rec.get(f"{key}_ms")
        if value is None or value > limit:
            return False
    return True


def summarize(
    endpoint: str, url: str, concurrency: int | None, request_rate: float | None, run: dict, slo: dict | None
) -> dict:
    """One endpoint x level row of the report from its merged run (records + client-side duration)."""
    recs = run["records"]
    ok = [r for r in recs if r["ok"]]
    wall = max(run["duration_s"], 1e-9)
    out_tokens = [r["completion_tokens"] for r in ok if r["completion_tokens"] is not None]
    in_tokens = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]
    with_calls = [r for r in ok if r["tool_calls"]]
    gold = [r["gold_name_match"] for r in ok if r["gold_name_match"] is not None]
    errors = collections.Counter(r["error"] for r in recs if not r["ok"])
    problems = collections.Counter(r["tool_call_problem"] for r in with_calls if r["tool_call_problem"])
    drafted = sum(r.get("drafted_tokens") or 0 for r in ok)
    accepted = sum(r.get("accepted_tokens") or 0 for r in ok)
    e2e = distribution(r["e2e_ms"] for r in ok)
    reported = [r for r in ok if r.get("cached_tokens") is not None and r.get("prompt_tokens")]
    gaps = [g for g in map(first_token_gap_ms, ok) if g is not None]
    return {
        "endpoint": endpoint,
        "url": url,
        "concurrency": concurrency,
        "request_rate": request_rate,
        "requests": len(recs),
        "ok": len(ok),
        "errors": len(recs) - len(ok),
        "error_kinds": dict(sorted(errors.items())),
        "output_tokens_per_s": sum(out_tokens) / wall if out_tokens else None,
        "total_tokens_per_s": (sum(out_tokens) + sum(in_tokens)) / wall if in_tokens else None,
        "requests_per_s": len(ok) / wall,
        "goodput_rps": sum(meets_slo(r, slo) for r in recs) / wall if slo else None,
        "ttft_ms": distribution(r["ttft_ms"] for r in ok),
        "tpot_ms": distribution(r["tpot_ms"] for r in ok),
        "itl_ms": distribution(x for r in ok for x in r["itl_ms"]),
        "e2e_ms": e2e,
        "server_first_token_ms": distribution(r.get("server_first_token_ms") for r in ok),
        "call_complete_ms": distribution(r.get("call_complete_ms") for r in ok),
        # first token -> the request's next step on a ToolSpec server (``first_token_gap_ms``): the
        # distribution and the level's sum (seconds its requests sat after their first token)
        "first_token_gap_ms": distribution(gaps),
        "first_token_gap_s_total": sum(gaps) / 1e3 if gaps else None,
        "prefix_cached_share": prefix_cached_share(reported),
        "identical_outputs": None,  # filled in by compare() against the baseline endpoint
        "mat": mean(r["mat"] for r in ok),
        "acceptance_rate": accepted / drafted if drafted else None,
        "completion_tokens": sum(out_tokens) if out_tokens else None,
        "tool_call_responses": len(with_calls),
        "tool_call_validity": (len(with_calls) - sum(problems.values())) / len(with_calls) if with_calls else None,
        "invalid_calls": dict(sorted(problems.items())),
        "gold_name_match": sum(gold) / len(gold) if gold else None,
        "wall_s": wall,
        "nodes": run["nodes"],
        "per_node": per_node(recs),
        "stopped_by_time": run["timed_out"],
        "unsent": run["unsent"],
        "peak_in_flight": run.get("peak_in_flight"),
    }


def prefix_cached_share(records: list[dict]) -> float | None:
    """Prompt tokens served from the prefix cache over all prompt tokens of ``records`` (those
    whose response reports ``cached_tokens``); None when there are none."""
    prompt = sum(r["prompt_tokens"] for r in records)
    return sum(r["cached_tokens"] for r in records) / prompt if prompt else None


def per_node(recs: list[dict]) -> dict[str, dict]:
    """Requests, successes, errors (by kind) and output tokens of each client node: what each
    node's clients sent, adding up to the level's totals."""
    out: dict[str, dict] = {}
    for r in recs:
        row = out.setdefault(
            r.get("node"), {"requests": 0, "ok": 0, "errors": 0, "error_kinds": {}, "completion_tokens": 0}
        )
        row["requests"] += 1
        if r["ok"]:
            row["ok"] += 1
            row["completion_tokens"] += r.get("completion_tokens") or 0
        else:
            row["errors"] += 1
            row["error_kinds"][r["error"]] = row["error_kinds"].get(r["error"], 0) + 1
    return dict(sorted(out.items()))


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def compare(levels: list[dict], records: dict, baseline: str) -> list[dict]:
    """Speedup over *baseline* per level, and the share of requests answered identically.

    ``records`` maps (endpoint, level number) to that run's records; a request is the same on two
    endpoints when it has the same index. Sets ``identical_outputs`` on the non-baseline levels.
    """
    level_no = {}
    for lv in levels:
        level_no.setdefault((lv["concurrency"], lv["request_rate"]), len(level_no))
    base = {(lv["concurrency"], lv["request_rate"]): lv for lv in levels if lv["endpoint"] == baseline}
    rows = []
    for lv in levels:
        key = (lv["concurrency"], lv["request_rate"])
        ref = base.get(key)
        if lv["endpoint"] == baseline or ref is None:
            continue
        mine = {r["index"]: r["digest"] for r in records[(lv["endpoint"], level_no[key])] if r["ok"]}
        theirs = {r["index"]: r["digest"] for r in records[(baseline, level_no[key])] if r["ok"]}
        both = sorted(set(mine) & set(theirs))
        same = sum(mine[i] == theirs[i] for i in both)
        lv["identical_outputs"] = same / len(both) if both else None
        rows.append(
            {
                "endpoint": lv["endpoint"],
                "baseline": baseline,
                "concurrency": lv["concurrency"],
                "request_rate": lv["request_rate"],
                "throughput_speedup": _ratio(lv["requests_per_s"], ref["requests_per_s"]),
                "p50_latency_speedup": _ratio(ref["e2e_ms"]["p50"], lv["e2e_ms"]["p50"]),
                "p95_latency_speedup": _ratio(ref["e2e_ms"]["p95"], lv["e2e_ms"]["p95"]),
                "tokens_per_s_speedup": _ratio(lv["output_tokens_per_s"], ref["output_tokens_per_s"]),
                "compared_outputs": len(both),
                "identical_outputs": same,
            }
        )
    return rows
