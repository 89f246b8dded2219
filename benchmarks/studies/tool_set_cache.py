"""The compiled tool-set cache (``toolcall/compiled.py``) on the dev sets' request streams: each
set's items in file order sent through one ``ToolSetCache`` (as a server's drafter factory would
see them), and the multi-turn set (consecutive turns of one conversation resend its tools: the
agent workload: the conversations' turns in order). Reports hit rate, compile time per tool set
(p50 / p99), the estimated bytes per compiled set that the cache's bound counts (schema tables
only: token tables fill while drafting, the replay report's "Compiled tool sets" table gives them
after drafting) and the bytes a compiled set actually holds (``tracemalloc``: what compiling it
allocated and kept), so the estimate the bound uses is checked against memory.

    python -m benchmarks.studies.tool_set_cache --json benchmarks/runs/tool-set-cache.json

``--misses B``: also the token tables' misses on the replay target at batch B (the three dev sets,
16 items each, each once: fresh requests), each classified by whether its tokens depend on the
context tail at all. BPE never merges across a pre-token boundary, and the Qwen2 pre-tokenizer's
regex has no look-behind, so where head + text pre-tokenizes as the head's pieces then the text's,
after a tail that re-tokenizes to itself, the candidate's tokens are its text's own (``split``): a table keyed by the
candidate alone could answer it. Reported with how many misses resend a candidate already
tokenized after another tail -- the share such a table would turn into hits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.data import load_items
from benchmarks.datasets import dev_set
from toolspec_core.drafters.toolcall.boundary import TAIL_TOKENS
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


def miss_kind(bt, pattern, tail: tuple[int, ...], segs: tuple) -> str:
    """Whether a candidate's tokens after ``tail`` are its text's own: ``split`` (the head +
    text pre-tokenizes as the head alone, then the text, for the tail ``BoundaryTokenizer.continuation``
    settles on, or it settles on none), ``nosplit`` (BPE may merge across the boundary, or a
    look-ahead past it cuts the head otherwise: ``"a  "`` alone is a, '  ' but ``"a  1"`` is a, ' ',
    ' ', 1), ``nonascii`` (the regex rules are checked on ASCII only), ``runs`` (text after raw
    ids: later runs' tails include the first's)."""
    text = [isinstance(seg, str) for seg, _ in segs]
    first_raw = text.index(False) if False in text else len(text)
    if any(text[first_raw:]):
        return "runs"
    x = "".join(seg for seg, _ in segs[:first_raw])
    for k in range(min(TAIL_TOKENS, len(tail)), 0, -1):
        t = bt._decode(tuple(tail[-k:]))
        if "\ufffd" in t:
            continue
        if not (t + x).isascii():
            return "nonascii"
        head = [m.end() for m in pattern.finditer(t)]
        if [m.end() for m in pattern.finditer(t + x) if m.start() < len(t)] != head:
            return "nosplit"
        if tuple(bt._encode(t)) == tuple(tail[-k:]):
            return "split"  # continuation returns encode(x): the tail's tokens re-tokenize to themselves
    return "split"  # no clean tail: encode(x) as well


def token_misses(batch: int) -> dict:
    """The schema candidates the tool sets' token tables miss on a replay run at ``batch``."""
    import collections
    import tempfile

    import regex

    from benchmarks.batch import BatchRun
    from benchmarks.cli import parse
    from toolspec_core.drafters.toolcall import compiled

    missed: list[tuple] = []
    lookup = compiled.CompiledTools.candidate

    def recording(self, tokenize, tail, segs):
        if (tail, segs) not in self.tokens:
            missed.append((self, tail, segs))
        return lookup(self, tokenize, tail, segs)

    argv = ["--batch", str(batch), "--same-batch-reference", "--target", "replay", "--limit", "16"]
    argv += ["--methods", "ar,toolspec", "--cost", "benchmarks/results/curves/cost-h200-qwen2.5-7b.json"]
    compiled.CompiledTools.candidate = recording
    try:
        with tempfile.TemporaryDirectory() as out:
            run = BatchRun(parse(argv + ["--max-new-tokens", "128", "--out", out]))
            run.run()
    finally:
        compiled.CompiledTools.candidate = lookup
    from toolspec_core.drafters.toolcall.boundary import QWEN2_SPLIT, BoundaryTokenizer

    bt, pattern = BoundaryTokenizer(run.target.tokenizer), regex.compile(QWEN2_SPLIT)
    kinds, seen, again, again_split = collections.Counter(), set(), 0, 0
    for table, tail, segs in missed:
        kind = miss_kind(bt, pattern, tail, segs)
        kinds[kind] += 1
        if (id(table), segs) in seen:
            again += 1
            again_split += kind == "split"
        seen.add((id(table), segs))
    n = len(missed)
    return {
        "batch": batch,
        "misses": n,
        "kinds": dict(kinds),
        "split_share": kinds["split"] / max(1, n),
        "resent_share": again / max(1, n),
        "resent_split_share": again_split / max(1, n),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--json")
    ap.add_argument("--misses", type=int, metavar="B", help="also classify the token tables' misses at batch B")
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
    if a.misses:
        m = out["token_misses"] = token_misses(a.misses)
        print(
            f"token-table misses at B = {a.misses}: {m['misses']}, kinds {m['kinds']}; tail-free (split) "
            f"{m['split_share']:.3f}, resending a candidate seen after another tail {m['resent_share']:.3f}, "
            f"both {m['resent_split_share']:.3f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
