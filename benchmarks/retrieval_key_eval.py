"""Does the target's hidden state beat a lexical key for retrieving past tool calls?

API-Bank dev in online order: item i queries a library holding the gold calls of items 0..i-1
(never its own), stored exactly as the service stores them (``MemoryStore``: one record per
distinct call, tenant-scoped, cosine). Three searches per item and key, as the service sees them:
``unfiltered``, ``offered`` (restricted to the request's offered tools — what the serving layer
sends before decoding) and ``tool`` (restricted to the gold tool — once the FSM has the name).
Over the top-k:

* ``tool_hit``: a retrieved call has the gold tool name;
* ``value_recall``: fraction of the gold argument values found among the arguments of retrieved
  calls *of the gold tool* — what retrieval drafting can reuse;
* ``exact``: a retrieved call equals the gold call (the whole call draftable in one step).

Baselines: ``recent`` (the k latest calls, no key) and ``oracle`` (every earlier call of the gold
tool: the ceiling any key can reach). Keys: ``hidden_last`` (``Prefilled.hidden``, the default
Qwen key), ``hidden_mean`` (mean last-layer state over the prompt, from the same prefill),
``lexical`` (``LexicalEmbedder``), ``X+lexical`` (mean of both cosines). Differences to lexical
come with 95% paired bootstrap intervals (eligible items: the gold tool was called before).

Phase 1 runs the embedded model once per item (prefill only, 3-10 s on this shared CPU) and caches the keys;
phase 2 is instant. Run in the background:

    nohup python -m benchmarks.retrieval_key_eval > /tmp/key_eval.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from deployments.hidden_keys import HiddenStateEmbedder
from retrieval_service.embedding import LexicalEmbedder, normalise
from retrieval_service.records import CallRecord, schema_hash
from retrieval_service.store import MemoryStore

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "api_bank.dev.jsonl"
KEYS = ("hidden_last", "hidden_mean", "lexical", "hidden_last+lexical", "hidden_mean+lexical")
# (column, metric) pairs the verdict compares, with paired bootstrap CIs vs the lexical key
HEADLINE = (
    ("unfiltered@1", "tool_hit"),
    ("offered@1", "tool_hit"),
    ("offered@1", "exact"),
    ("tool@1", "value_recall"),
    ("tool@1", "exact"),
)


def load_items(path: Path, stride: int, limit: int) -> list[dict]:
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return items[::stride][:limit]


def call_text(call: dict) -> str:
    return json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)


def _v(x) -> str:
    return json.dumps(x, sort_keys=True, ensure_ascii=False)


# ----------------------------------------------------------------------------- phase 1: keys


def compute_hidden_keys(items: list[dict], cache: Path, threads: int, log_every: int = 10) -> dict[str, np.ndarray]:
    """hidden_last / hidden_mean per item, resumable through ``cache`` (npz)."""
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.model.target import load_target

    done: dict[str, dict[str, np.ndarray]] = {}
    if cache.exists():
        z = np.load(cache, allow_pickle=False)
        for i, iid in enumerate(z["ids"].tolist()):
            done[iid] = {"hidden_last": z["hidden_last"][i], "hidden_mean": z["hidden_mean"][i]}
    todo = [it for it in items if it["id"] not in done]
    if todo:
        t0 = time.time()
        emb = HiddenStateEmbedder(load_target(threads=threads))
        print(f"loaded {emb.target.name} in {time.time() - t0:.1f}s; {len(todo)} items to prefill", flush=True)
        for n, it in enumerate(todo, 1):
            ids = render_prompt(emb.target.tokenizer, it["messages"], it["tools"])
            pre, states = emb.states(ids)
            done[it["id"]] = {"hidden_last": pre.hidden.float().numpy(), "hidden_mean": states.mean(0).numpy()}
            if n % log_every == 0 or n == len(todo):
                _save(cache, done)
                print(
                    f"{n}/{len(todo)} prompt_tokens={len(ids)} prefill_s={pre.seconds:.2f} elapsed={time.time() - t0:.0f}s",
                    flush=True,
                )
        _save(cache, done)
    return {k: np.stack([done[it["id"]][k] for it in items]) for k in ("hidden_last", "hidden_mean")}


def _save(cache: Path, done: dict) -> None:
    ids = list(done)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.stem + ".tmp.npz")
    np.savez(
        tmp,
        ids=np.array(ids),
        hidden_last=np.stack([done[i]["hidden_last"] for i in ids]),
        hidden_mean=np.stack([done[i]["hidden_mean"] for i in ids]),
    )
    tmp.replace(cache)


def all_keys(items: list[dict], hidden: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    lex = LexicalEmbedder(1024)
    keys = {
        "hidden_last": np.stack([normalise(v) for v in hidden["hidden_last"]]),
        "hidden_mean": np.stack([normalise(v) for v in hidden["hidden_mean"]]),
        "lexical": np.stack([lex.embed_request(it["messages"], it["tools"]) for it in items]),
    }
    for h in ("hidden_last", "hidden_mean"):  # cosine of the concatenation = mean of both cosines
        keys[f"{h}+lexical"] = np.concatenate([keys[h], keys["lexical"]], 1) / np.sqrt(2.0)
    return keys


# ----------------------------------------------------------------------------- phase 2: metrics


def _scores(gold: dict, retrieved: list[dict]) -> dict:
    """tool_hit / value_recall / exact of retrieved calls (dicts with name, arguments) vs gold."""
    same = [r for r in retrieved if r["name"] == gold["name"]]
    gvals = [_v(v) for v in gold["arguments"].values()]
    have = {_v(v) for r in same for v in r["arguments"].values()}
    return {
        "tool_hit": float(bool(same)),
        "value_recall": (sum(v in have for v in gvals) / len(gvals)) if gvals else None,
        "exact": float(any(_v(r["arguments"]) == _v(gold["arguments"]) for r in same)),
    }


def evaluate(items: list[dict], keys: dict[str, np.ndarray], order: list[int], ks=(1, 3, 10)) -> dict:
    """Online over ``order``: each item searches the library of earlier items, then joins it."""
    stores = {name: MemoryStore(dim=m.shape[1]) for name, m in keys.items()}
    history: list[dict] = []  # earlier gold calls, newest last
    rows = []
    for step, i in enumerate(order):
        it = items[i]
        gold = it["gold_calls"][0]
        row = {"eligible": float(any(h["name"] == gold["name"] for h in history)), "has_args": bool(gold["arguments"])}
        if step:
            for name, store in stores.items():
                offered = [t["function"]["name"] for t in it["tools"]]
                for filt, names in (("unfiltered", None), ("offered", offered), ("tool", gold["name"])):
                    hits = store.search("eval", keys[name][i], tool_name=names, k=max(ks))
                    calls = [{"name": r.tool_name, "arguments": r.arguments} for r, _ in hits]
                    for k in ks:
                        row[f"{name}/{filt}@{k}"] = _scores(gold, calls[:k])
            latest = list(dict.fromkeys(call_text(h) for h in reversed(history)))
            recent = [json.loads(t) for t in latest]
            recent_tool = [c for c in recent if c["name"] == gold["name"]]
            recent_offered = [c for c in recent if c["name"] in {t["function"]["name"] for t in it["tools"]}]
            for k in ks:
                row[f"recent/unfiltered@{k}"] = _scores(gold, recent[:k])
                row[f"recent/offered@{k}"] = _scores(gold, recent_offered[:k])
                row[f"recent/tool@{k}"] = _scores(gold, recent_tool[:k])
            row["oracle/tool@all"] = _scores(gold, recent_tool)
            rows.append(row)
        for calls in it["gold_calls"]:
            tool = next((t for t in it["tools"] if t["function"]["name"] == calls["name"]), {"name": calls["name"]})
            for name, store in stores.items():
                store.add(
                    CallRecord(
                        tenant="eval",
                        tool_name=calls["name"],
                        schema_hash=schema_hash(tool),
                        text=call_text(calls),
                        arguments=calls["arguments"],
                        embedding=keys[name][i],
                        created_at=float(step),
                    )
                )
            history.append(calls)
    out = summarise(rows)
    out["paired_vs_lexical"] = paired_vs_lexical([r for r in rows if r["eligible"]])
    return out


def paired_vs_lexical(rows: list[dict], n_boot: int = 2000, seed: int = 0) -> dict:
    """Mean difference key - lexical per headline metric, with a 95% paired bootstrap interval
    (same items resampled for both keys), on eligible items."""
    rng = np.random.default_rng(seed)
    out = {}
    for key in KEYS:
        if key == "lexical":
            continue
        for col, metric in HEADLINE:
            pairs = [
                (r[f"{key}/{col}"][metric], r[f"lexical/{col}"][metric])
                for r in rows
                if r.get(f"{key}/{col}", {}).get(metric) is not None
            ]
            if not pairs:
                continue
            d = np.array([a - b for a, b in pairs])
            boot = d[rng.integers(0, len(d), (n_boot, len(d)))].mean(1)
            out[f"{key}/{col}/{metric}"] = {
                "diff": round(float(d.mean()), 4),
                "ci95": [round(float(np.percentile(boot, 2.5)), 4), round(float(np.percentile(boot, 97.5)), 4)],
                "n": len(d),
            }
    return out


def summarise(rows: list[dict]) -> dict:
    cols = sorted({c for r in rows for c in r if "/" in c})
    out = {"items": len(rows), "n_eligible": int(sum(r["eligible"] for r in rows))}
    for subset in ("all", "eligible"):
        sel = [r for r in rows if subset == "all" or r["eligible"]]
        table = {}
        for c in cols:
            cell = {}
            for m in ("tool_hit", "value_recall", "exact"):
                vals = [r[c][m] for r in sel if c in r and r[c][m] is not None]
                cell[m] = round(float(np.mean(vals)), 4) if vals else None
            table[c] = cell
        out[subset] = table
    return out


def to_markdown(res: dict) -> str:
    lines = [
        "# Retrieval key evaluation (API-Bank dev, online)",
        "",
        f"{res['setup']['items']} items (every {res['setup']['stride']}th of api_bank.dev.jsonl), model "
        f"{res['setup']['model']}; library = gold calls of earlier items (MemoryStore, deduplicated). "
        "tool_hit / value_recall / exact as defined in `benchmarks/retrieval_key_eval.py`; value_recall "
        "counts only retrieved calls of the gold tool. `eligible` = items whose gold tool was called before.",
        "",
    ]
    for order, r in res["orders"].items():
        lines += [f"## order: {order} ({r['items']} queries, {r['n_eligible']} eligible) — eligible items", ""]
        lines += [
            "| key | unfiltered tool_hit@1 | tool_hit@10 | value_recall@10 | offered-tools tool_hit@1 | exact@1 | gold-tool value_recall@1 | @3 | exact@1 | exact@10 |",
            "|---" * 10 + "|",
        ]
        t = r["eligible"]
        for key in ("recent",) + KEYS:
            g = lambda c, m: t.get(c, {}).get(m)
            f = lambda x: "-" if x is None else f"{x:.3f}"
            lines.append(
                f"| {key} | {f(g(f'{key}/unfiltered@1', 'tool_hit'))} | {f(g(f'{key}/unfiltered@10', 'tool_hit'))} | "
                f"{f(g(f'{key}/unfiltered@10', 'value_recall'))} | {f(g(f'{key}/offered@1', 'tool_hit'))} | {f(g(f'{key}/offered@1', 'exact'))} | {f(g(f'{key}/tool@1', 'value_recall'))} | "
                f"{f(g(f'{key}/tool@3', 'value_recall'))} | {f(g(f'{key}/tool@1', 'exact'))} | {f(g(f'{key}/tool@10', 'exact'))} |"
            )
        o = t.get("oracle/tool@all", {})
        lines += [
            f"| oracle (all earlier calls of the tool) | - | 1.000 | {o.get('value_recall', 0):.3f} | 1.000 | - | - | - | - | {o.get('exact', 0):.3f} |",
            "",
        ]
        lines += [
            "Difference to `lexical` (eligible items, 95% paired bootstrap interval):",
            "",
            "| key | " + " | ".join(f"{c} {m}" for c, m in HEADLINE) + " |",
            "|---" * (len(HEADLINE) + 1) + "|",
        ]
        pv = r["paired_vs_lexical"]
        for key in KEYS:
            if key != "lexical":
                cells = [pv.get(f"{key}/{c}/{m}") for c, m in HEADLINE]
                lines.append(
                    f"| {key} | "
                    + " | ".join(
                        "-" if x is None else f"{x['diff']:+.3f} [{x['ci95'][0]:+.3f}, {x['ci95'][1]:+.3f}]"
                        for x in cells
                    )
                    + " |"
                )
        lines.append("")
    lines += ["## Verdict", "", res.get("verdict", ""), ""]
    return "\n".join(lines)


def verdict(res: dict) -> str:
    """Per Qwen key and headline metric: better / worse than lexical when the 95% paired interval
    excludes 0 in both orders, else 'tie'."""
    lines = []
    for key in ("hidden_last", "hidden_mean", "hidden_last+lexical", "hidden_mean+lexical"):
        parts = []
        for col, metric in HEADLINE:
            cis = [o["paired_vs_lexical"].get(f"{key}/{col}/{metric}") for o in res["orders"].values()]
            if any(c is None for c in cis):
                continue
            word = (
                "better"
                if all(c["ci95"][0] > 0 for c in cis)
                else "worse"
                if all(c["ci95"][1] < 0 for c in cis)
                else "tie"
            )
            diffs = ", ".join(f"{c['diff']:+.3f}" for c in cis)
            parts.append(f"{col} {metric} {word} ({diffs})")
        lines.append(f"- {key} vs lexical: " + "; ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default="/tmp/toolspec-key-eval/hidden.npz")
    ap.add_argument("--out", default="benchmarks/runs/retrieval-key-eval.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    items = load_items(Path(args.data), args.stride, args.limit)
    hidden = compute_hidden_keys(items, Path(args.cache), args.threads)
    keys = all_keys(items, hidden)
    shuffled = list(range(len(items)))
    random.Random(args.seed).shuffle(shuffled)
    from toolspec_core.model.embedded import EMBEDDED_MODEL_NAME

    res = {
        "setup": {
            "data": Path(args.data).name,
            "items": len(items),
            "stride": args.stride,
            "model": EMBEDDED_MODEL_NAME,
            "k": [1, 3, 10],
            "keys": list(KEYS),
            "lexical_dim": 1024,
            "hidden_dim": int(keys["hidden_last"].shape[1]),
        },
        "orders": {
            "file": evaluate(items, keys, list(range(len(items)))),
            f"shuffled_seed{args.seed}": evaluate(items, keys, shuffled),
        },
    }
    res["verdict"] = verdict(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(to_markdown(res))
    print(res["verdict"])


if __name__ == "__main__":
    main()
