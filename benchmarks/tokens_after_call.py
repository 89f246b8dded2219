"""Share of plain-greedy output tokens written after the first complete call (made-up tool results,
further calls), per benchmark, from a run's raw records -- where schema drafting of calls cannot help.

    python -m benchmarks.tokens_after_call benchmarks/runs/RUN
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from toolspec_core.drafters.toolcall.fsm import CallTracker, ToolIndex
from toolspec_core.engine.detokenize import Detokenizer
from toolspec_core.model.prompting import turn_end_ids

from .data import run_items


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


def first_call_end(tokenizer, tools: list[dict], tokens: list[int]) -> int | None:
    """Number of tokens up to and including the one that completes the first call (None: no call)."""
    bounds = call_bounds(tokenizer, tools, tokens)
    return bounds[1] if bounds else None


def main() -> None:
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    raw = Path(sys.argv[1])
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    items = run_items(raw)
    agg = collections.defaultdict(lambda: [0, 0, 0])
    for line in open(raw / "items.jsonl"):
        r = json.loads(line)
        if r["method"] != "ar" or not r.get("has_call"):
            continue
        end = first_call_end(tok, items[r["item"]]["tools"], r["tokens"])
        a = agg[r["benchmark"]]
        a[0] += 1
        a[1] += len(r["tokens"])
        a[2] += len(r["tokens"]) - end if end else 0
    out = {
        b: {"items_with_calls": n, "tokens": t, "tokens_after_first_call": after, "share": round(after / t, 3)}
        for b, (n, t, after) in agg.items()
    }
    print(json.dumps({"source": str(raw / "items.jsonl") + " (ar records)", "by_benchmark": out}, indent=1))


if __name__ == "__main__":
    main()
