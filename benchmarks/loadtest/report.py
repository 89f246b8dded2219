"""The run's files: <name>.json (the report), .md (tables), .png (plots), optional .records.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..plots import md_section, md_table, pyplot


def fmt(value, digits=1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def level_label(lv: dict) -> str:
    if lv["request_rate"] is None:
        return f"c={lv['concurrency']}"
    cap = f", max {lv['max_concurrency']}" if lv.get("max_concurrency") else ""
    return f"{lv['request_rate']:g}/s{cap}"


LEVEL_HEAD = (
    *("endpoint", "level", "requests", "errors", "TTFT ms mean / p50 / p99", "server 1st token ms p50 / p99"),
    *("call complete ms p50 / p99", "TPOT ms mean / p99", "ITL ms mean / p99", "E2E ms p50 / p90 / p99"),
    *("out tok/s", "req/s", "goodput req/s", "tool-call valid", "identical", "MAT", "prefix cached"),
)
LEVEL_STATS = (
    *(("ttft_ms", "mean p50 p99"), ("server_first_token_ms", "p50 p99"), ("call_complete_ms", "p50 p99")),
    *(("tpot_ms", "mean p99"), ("itl_ms", "mean p99"), ("e2e_ms", "p50 p90 p99")),
)


def _level_row(lv: dict) -> list[str]:
    row = [lv["endpoint"], level_label(lv), lv["requests"], lv["errors"]]
    empty = dict.fromkeys(
        ("mean", "p50", "p90", "p95", "p99")
    )  # a level resumed from a partial file without the column
    row += [" / ".join(fmt(lv.get(key, empty)[q]) for q in stats.split()) for key, stats in LEVEL_STATS]
    row += [fmt(lv["output_tokens_per_s"]), fmt(lv["requests_per_s"], 3), fmt(lv["goodput_rps"], 3)]
    row += [f"{fmt(lv['tool_call_validity'], 3)} ({lv['tool_call_responses']})"]
    share = lv.get("prefix_cached_share")
    return row + [fmt(lv["identical_outputs"], 3), fmt(lv["mat"], 2), "–" if share is None else f"{share:.0%}"]


def write_markdown(report: dict, path: Path) -> None:
    cfg = report["config"]
    limit = f"{cfg['num_requests']} requests" + (f" or {cfg['duration']} s" if cfg.get("duration") else "")
    mode = (
        f"open loop, Poisson-like arrivals (burstiness {cfg['burstiness']})"
        if cfg.get("request_rate")
        else "closed loop (each client sends its next request when the last one finished)"
    )
    lines = [
        f"# Load test {report['name']}",
        "",
        f"- workload: **{report['workload']}** from "
        + ", ".join(f"`{d}`" for d in cfg["dataset"])
        + f" ({report['workload_units']} units, seed {cfg['seed']}"
        + (
            f", prompts of {cfg['prompt_chars'][0]}..{cfg['prompt_chars'][1] or ''} JSON characters"
            if cfg.get("prompt_chars")
            else ""
        )
        + f"); max_tokens {cfg['max_tokens']}, temperature 0, stream {cfg['stream']}"
        + ("; each level's prompts sent once before it (warm prefix cache)" if cfg.get("warm_prompts") else "")
        + (
            "; **unique prefix**: each prompt starts with a nonce line of its own, so no prefix cache covers any of it"
            if cfg.get("unique_prefix")
            else ""
        ),
        f"- {mode}; per level: {limit}, at most {cfg['max_seconds']} s; warm-up {cfg['warmup']} requests "
        f"(not counted); clients: {report['runner']}",
        f"- hardware: {report['hardware']}",
        "- endpoints: " + ", ".join(f"`{e['name']}` {e['url']} (model `{e['model']}`)" for e in report["endpoints"]),
        "- SLO: " + (", ".join(f"{k} ≤ {v:g} ms" for k, v in cfg["slo"].items()) if cfg.get("slo") else "none"),
        "",
        *md_table(LEVEL_HEAD, [_level_row(lv) for lv in report["levels"]], ["---"] * 2 + ["---:"] * 15),
    ]
    if report["speedup"]:
        rows = [
            [row["endpoint"], level_label(row)]
            + [f"{fmt(row[k], 2)}x" for k in ("throughput_speedup", "p50_latency_speedup", "p95_latency_speedup")]
            + [f"{row['identical_outputs']}/{row['compared_outputs']}"]
            for row in report["speedup"]
        ]
        head = ["endpoint", "level", "throughput speedup", "p50 latency speedup", "p95 latency speedup"]
        table = md_table(head + ["identical outputs"], rows, ["---"] * 2 + ["---:"] * 4)
        lines += md_section(f"Speedup vs `{report['baseline']}`", None, table)
    gaps = [lv for lv in report["levels"] if (lv.get("first_token_gap_ms") or {}).get("p50") is not None]
    if gaps:
        rows = [
            [lv["endpoint"], level_label(lv)]
            + [fmt(lv["first_token_gap_ms"][q]) for q in ("p50", "p90", "p99")]
            + [fmt(lv["first_token_gap_s_total"], 2)]
            for lv in gaps
        ]
        head = ["endpoint", "level", "p50 ms", "p90 ms", "p99 ms", "sum over the level's requests, s"]
        intro = (
            "From the server timelines: the end of the step that gave a request its first token to the "
            "start of its next step's forward (waiting there is in neither TTFT nor the server's forward time)."
        )
        lines += md_section("First token to next step", intro, md_table(head, rows, ["---"] * 2 + ["---:"] * 4))
    failed = [lv for lv in report["levels"] if lv["errors"] or lv["stopped_by_time"] or lv["invalid_calls"]]
    if failed:
        lines += md_section("Errors, invalid calls and time limits", None, [])
        for lv in failed:
            notes = [f"{k} × {v}" for k, v in lv["error_kinds"].items()]
            notes += [f"invalid call ({k}) × {v}" for k, v in lv["invalid_calls"].items()]
            if lv["stopped_by_time"]:
                notes.append(f"stopped at the {cfg['max_seconds']} s limit, {lv['unsent']} requests unsent")
            lines.append(f"- {lv['endpoint']} @ {level_label(lv)}: " + "; ".join(notes))
    if report.get("clients"):
        rows = [
            [f"{lv['endpoint']} @ {level_label(lv)}", node[:12], row["requests"], row["ok"], row["errors"]]
            + [", ".join(f"{k} × {v}" for k, v in row["error_kinds"].items()) or "-"]
            for lv in report["levels"]
            for node, row in lv.get("per_node", {}).items()
        ]
        head = ["level", "client node", "requests", "ok", "errors", "error kinds"]
        intro = f"{len(report['clients'])} client actors on {len({c['node'] for c in report['clients']})} nodes."
        lines += md_section(
            "Requests by client node", intro, md_table(head, rows, ["---"] * 2 + ["---:"] * 3 + ["---"])
        )
    lines += ["", f"![latency and throughput]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines))


def write_plot(report: dict, path: Path) -> None:
    """TTFT, TPOT and E2E percentiles and output tokens/s against concurrency or rate, a colour per endpoint."""
    plt = pyplot()
    open_loop = any(lv["request_rate"] is not None for lv in report["levels"])
    xkey = "request_rate" if open_loop else "concurrency"
    panels = (("ttft_ms", "TTFT", "ms"), ("tpot_ms", "TPOT", "ms"), ("e2e_ms", "E2E latency", "ms"))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    finite = sorted({lv[xkey] for lv in report["levels"] if lv[xkey] is not None and math.isfinite(lv[xkey])})
    for n, ep in enumerate(e["name"] for e in report["endpoints"]):
        rows = [lv for lv in report["levels"] if lv["endpoint"] == ep]
        xs = [lv[xkey] if math.isfinite(lv[xkey]) else (max(finite, default=1) * 2) for lv in rows]
        color = f"C{n}"
        for ax, (key, _, _) in zip(axes, panels, strict=False):
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ys = [lv[key][q] if lv[key][q] is not None else math.nan for lv in rows]
                ax.plot(xs, ys, style, color=color, alpha=1.0 if q == "p50" else 0.6, label=f"{ep} {q}")
        tps = [lv["output_tokens_per_s"] if lv["output_tokens_per_s"] is not None else math.nan for lv in rows]
        axes[3].plot(xs, tps, "o-", color=color, label=ep)
    titles = [(title, unit) for _, title, unit in panels] + [("output tokens / s", "tokens / s")]
    for ax, (title, unit) in zip(axes, titles, strict=True):
        if not open_loop:
            ax.set_xscale("log", base=2)
            ax.set_xticks(finite, [str(c) for c in finite])
        ax.set_xlabel("request rate (req/s)" if open_loop else "concurrency")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"toolspec loadtest {report['name']} ({report['workload']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def strict_json(value):
    """``value`` with every non-finite float as the string "inf" / "-inf" / "nan" (as vLLM's result
    files write an unbounded request rate): the reports stay JSON that any parser reads."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_reports(report: dict, records: dict, out: Path, save_records: bool) -> list[str]:
    """<name>.json/.md/.png (+ .records.jsonl); never overwrites an earlier run."""
    out.mkdir(parents=True, exist_ok=True)
    stem, n = out / report["name"], 1
    while stem.with_suffix(".json").exists():
        n += 1
        stem = out / f"{report['name']}-{n}"
    report["name"] = stem.name
    suffixes = [".json", ".md", ".png"] + ([".records.jsonl"] if save_records else [])
    report["files"] = [str(stem.with_suffix(s)) for s in suffixes]
    stem.with_suffix(".json").write_text(json.dumps(strict_json(report), indent=2, allow_nan=False) + "\n")
    write_markdown(report, stem.with_suffix(".md"))
    write_plot(report, stem.with_suffix(".png"))
    if save_records:
        with open(stem.with_suffix(".records.jsonl"), "w") as fh:
            for (ep, level_no), recs in records.items():
                lv = next(lv for lv in report["levels"] if lv["endpoint"] == ep and lv["level_no"] == level_no)
                where = {"endpoint": ep, "concurrency": lv["concurrency"], "request_rate": lv["request_rate"]}
                fh.writelines(json.dumps(strict_json({**r, **where}), allow_nan=False) + "\n" for r in recs)
    return report["files"]
