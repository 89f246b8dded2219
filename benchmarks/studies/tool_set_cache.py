"""The compiled tool-set cache (``toolcall/compiled.py``) on the dev sets' request streams: each
set's items in file order sent through one ``ToolSetCache`` (as a server's drafter factory would
see them), and the multi-turn set (consecutive turns of one conversation resend its tools: the
agent workload: the conversations' turns in order). Reports hit rate, compile time per tool set
(p50 / p99), the estimated bytes per compiled set that the cache's bound counts (schema tables
only: token tables fill while drafting, the replay report's "Compiled tool sets" table gives them
after drafting) and the bytes a compiled set actually holds (``tracemalloc``: what compiling it
allocated and kept), so the estimate the bound uses is checked against memory.

    python -m benchmarks.studies.tool_set_cache --json benchmarks/runs/tool-set-cache.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.data import load_items
from benchmarks.datasets import dev_set
from toolspec_core.drafters.toolcall.compiled import ToolSetCache, compile_tools, percentile, tool_set_key

SETS = ("api_bank", "bfcl_v3", "toolalpaca", "bfcl_v3_multi_turn")


def stream_stats(items: list[dict], tokenizer, max_bytes: int) -> dict:
    cache = ToolSetCache(max_bytes)
    for it in items:
        cache.get(it.get("tools") or [], None, tokenizer)
    return {"items": len(items), **cache.stats()}


def measured_bytes(items: list[dict]) -> dict:
    """Bytes each distinct tool set's compiled entry holds, measured (``tracemalloc``: allocated
    while compiling and still held after), beside the estimate the cache's bound counts."""
    import tracemalloc

    seen, measured, estimated = set(), [], []
    tracemalloc.start()
    try:
        for it in items:
            tools = it.get("tools") or []
            key = tool_set_key(tools, None, "")
            if key in seen:
                continue
            seen.add(key)
            before = tracemalloc.get_traced_memory()[0]
            entry = compile_tools(tools, None, key)
            measured.append(tracemalloc.get_traced_memory()[0] - before)
            estimated.append(entry.nbytes)
            del entry
    finally:
        tracemalloc.stop()
    ratio = sorted(e / max(1, m) for e, m in zip(estimated, measured))
    return {
        "sets": len(measured),
        "measured_bytes_mean": sum(measured) / max(1, len(measured)),
        "measured_bytes_max": max(measured, default=0),
        "estimated_bytes_mean": sum(estimated) / max(1, len(estimated)),
        "estimate_over_measured_p50": percentile(ratio, 0.5),
        "estimate_over_measured_min": ratio[0] if ratio else 0.0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    out = {}
    for name in a.sets.split(","):
        items = load_items(dev_set(name))
        st = out[name] = {**stream_stats(items, tok, a.max_bytes), "memory": measured_bytes(items)}
        mem = st["memory"]
        print(
            f"{name:20s} items {st['items']:5d}  sets {st['misses']:4d}  hit rate {st['hit_rate']:.3f}  "
            f"compile p50 {st['compile_ms_p50']:.2f} ms p99 {st['compile_ms_p99']:.2f} ms  "
            f"bytes/set mean {st['bytes_per_entry_mean'] / 1024:.1f} KiB max {st['bytes_per_entry_max'] / 1024:.1f} KiB  "
            f"measured mean {mem['measured_bytes_mean'] / 1024:.1f} KiB (estimate / measured p50 "
            f"{mem['estimate_over_measured_p50']:.2f}, min {mem['estimate_over_measured_min']:.2f})"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
