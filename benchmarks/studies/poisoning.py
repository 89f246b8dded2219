"""Study: exactness and slowdown under a library of wrong calls. Result: benchmarks/results/measurements/poisoning-cpu-epyc-b187ed0.json.

What a poisoned call library costs: a tenant's library filled with wrong calls of the very tools
a request offers (every argument value wrong, written in the model's own layout, stored under the
request's own retrieval key so they are the top hits) against an empty one. Output must stay
identical to plain greedy (drafts are only verified); the price is the time spent verifying
rejected drafts, reported as the poisoned / clean decode-time ratio.

    python -m benchmarks.studies.poisoning --limit 12 --out benchmarks/results/measurements/poisoning-cpu-epyc-SHA.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SETS = ("api_bank", "bfcl_v3", "toolalpaca")


def wrong_value(schema: dict, n: int):
    """A value of the schema's type that the request will not ask for."""
    typ = schema.get("type")
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[(n + 1) % len(enum)]
    if typ == "integer":
        return 987650 + n
    if typ == "number":
        return 98765.5 + n
    if typ == "boolean":
        return n % 2 == 0
    if typ == "array":
        return [f"wrong-{n}"]
    if typ == "object":
        return {"wrong": n}
    return f"WRONG value {n} for this argument"


def poisoned_calls(tools: list[dict], per_tool: int) -> list[dict]:
    out = []
    for t in tools:
        fn = t.get("function", t)
        props = (fn.get("parameters") or {}).get("properties") or {}
        for n in range(per_tool):
            out.append({"name": fn["name"], "arguments": {k: wrong_value(v, n) for k, v in props.items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=12, help="items with a gold call per dev set")
    ap.add_argument("--per-tool", type=int, default=8, help="wrong calls stored per offered tool")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from benchmarks.cost import hardware_string
    from benchmarks.data import load_items, prompt_ids, select_items
    from benchmarks.datasets import dev_set
    from benchmarks.prompts import PromptPool
    from retrieval_service.embedding import LexicalEmbedder
    from toolspec_core.drafters.methods import RequestInfo, make_method
    from toolspec_core.drafters.toolcall.library import MemoryLibrary, PastCall
    from toolspec_core.engine.budget import CostModel
    from toolspec_core.engine.loop import DecodeConfig
    from toolspec_core.model.target import load_target
    from toolspec_core.spec.layouts import FENCE, render_calls

    target = load_target()
    tok = target.tokenizer
    embedder = LexicalEmbedder(1024)
    cost = CostModel.cpu_reference()
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens)
    rows = []
    for name in SETS:
        items = [it for it in load_items(dev_set(name)) if it.get("gold_calls")]
        for item in select_items(items, args.limit, 0):
            ids = prompt_ids(tok, item)
            prompts = PromptPool(target, 2 * len(ids) + 2 * args.max_new_tokens + 256)
            prompts.warm(item["id"], ids)  # the prompt prefilled once; each decode starts from its blocks
            emb = embedder.embed_request(item["messages"], item["tools"]).tolist()
            plain = prompts.decode(ids, None, cfg)[0]
            row = {"item": item["id"], "benchmark": name, "tokens": len(plain.tokens)}
            for label in ("clean", "poisoned"):
                library = MemoryLibrary()
                if label == "poisoned":
                    for call in poisoned_calls(item["tools"], args.per_tool):
                        text = render_calls([call], FENCE)
                        library.add("t", PastCall(call["name"], tok.encode(text), text, call["arguments"]), emb)
                method = make_method("toolspec", tok, library=library)
                req = RequestInfo(ids, item["tools"], "t", emb)
                res, row[f"{label}_s"] = prompts.decode(ids, lambda: method.drafter(req), cfg, cost)
                row[f"{label}_mat"] = res.stats.mat
                row[f"{label}_exact"] = res.tokens == plain.tokens
            rows.append(row)
            print(json.dumps(row), flush=True)
    clean = sum(r["clean_s"] for r in rows)
    poisoned = sum(r["poisoned_s"] for r in rows)
    out = {
        "what": "toolspec decode time with a library of wrong calls of the request's own tools vs an empty one",
        "hardware": hardware_string("cpu"),
        "per_tool": args.per_tool,
        "items": len(rows),
        "exact_clean": sum(r["clean_exact"] for r in rows),
        "exact_poisoned": sum(r["poisoned_exact"] for r in rows),
        "slowdown": poisoned / clean if clean else None,
        "worst_item_slowdown": max((r["poisoned_s"] / r["clean_s"] for r in rows if r["clean_s"]), default=None),
        "mat_clean": sum(r["clean_mat"] for r in rows) / len(rows) if rows else None,
        "mat_poisoned": sum(r["poisoned_mat"] for r in rows) / len(rows) if rows else None,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
