"""The compiled tool-set cache (``toolcall/compiled.py``) on the dev sets' request streams: each
set's items in file order sent through one ``ToolSetCache`` (as a server's drafter factory would
see them), and the multi-turn set (consecutive turns of one conversation resend its tools: the
agent workload). Reports hit rate, compile time per tool set (p50 / p99) and the estimated bytes
per compiled set (schema tables only: token tables fill while drafting).

    python -m benchmarks.studies.tool_set_cache --json benchmarks/runs/tool-set-cache.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.data import load_items
from benchmarks.datasets import dev_set
from toolspec_core.drafters.toolcall.compiled import ToolSetCache

SETS = ("api_bank", "bfcl_v3", "toolalpaca", "bfcl_v3_multi_turn")


def stream_stats(items: list[dict], tokenizer, max_bytes: int) -> dict:
    cache = ToolSetCache(max_bytes)
    for it in items:
        cache.get(it.get("tools") or [], None, tokenizer)
    return {"items": len(items), **cache.stats()}


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
        st = out[name] = stream_stats(load_items(dev_set(name)), tok, a.max_bytes)
        print(
            f"{name:20s} items {st['items']:5d}  sets {st['misses']:4d}  hit rate {st['hit_rate']:.3f}  "
            f"compile p50 {st['compile_ms_p50']:.2f} ms p99 {st['compile_ms_p99']:.2f} ms  "
            f"bytes/set mean {st['bytes_per_entry_mean'] / 1024:.1f} KiB max {st['bytes_per_entry_max'] / 1024:.1f} KiB"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
