"""Study: toolspec's MAT per retrieval key in the online replay of a run. Result: benchmarks/results/retrieval/mat-by-key-3bench-cpu-epyc-7e64d4d.{json,md}.

MAT of ``toolspec`` per retrieval key, in the online replay of a recorded run.

The replay follows ``toolspec bench --library online`` (``benchmarks.runner``): one ``toolspec``
method per benchmark, the items in the run's stream order, each drafted against the library of
the earlier items' outputs and then observed. The target is replaced by the run's recorded
plain-greedy tokens (``toolspec_core.drafters.simulate``; greedy output is a function of the
prompt, and every method's output equals it), so a key costs its encoder and the drafting, not a
decode. Keys: ``qwen`` / ``hybrid`` / ``lexical`` -- the request text keyed as the Retrieval
deployment keys it (``deployments.retrieval.make_keyer``) in a retrieval_service memory store
(:class:`retrieval_service.library.ServiceLibrary`); ``hidden`` -- the target's last prompt state
(the run's ``prefill.jsonl``) in the core's ``MemoryLibrary``. Timing is not simulated: the
speedup is projected under the run's measured cost curve (greedy: one c(1) per token). Where the
run itself decoded ``toolspec`` with a key (its ``retrieval_key``), the measured MAT and decode
speedup on the same items stand beside the replay's, which checks the replay.

The grid (``--replicas``, ``--retrieve-k``) says where a key can matter at all: one replica's
suffix history already holds every earlier output, so only with several replicas behind a router
is the shared library the way to the others' calls; and a key only orders the offered tools' past
calls, so it changes the drafts only where there are more of them than the drafter takes (k).
``none`` (no library) is the baseline the lift is measured against.

    python -m benchmarks.studies.mat_by_key benchmarks/runs/RUN --replicas 1,4 --retrieve-k 1,8 --tool-search \\
        --name mat-by-key-3bench-cpu-epyc-$(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from benchmarks.cost import RESULTS
from benchmarks.data import load_stream, prompt_ids, response_schema
from benchmarks.runner import RETRIEVAL_KEYS, PrefillCache, decode_hidden
from toolspec_core.drafters.methods import RequestInfo, make_method
from toolspec_core.drafters.simulate import simulate
from toolspec_core.drafters.toolcall.library import as_past_call

from .offline_sim import Pruned, _cost
from .retrieval_key_eval import CACHE_DIR, cached_encoder

METHOD = "toolspec"


def keyers(keys: list[str], threads: int | None, cache_dir: Path = Path(CACHE_DIR)) -> dict:
    """``make_keyer`` per text key; qwen and hybrid share one encoder behind the key
    evaluation's on-disk cache (a text is encoded once, in any run of either tool)."""
    from deployments.config import EncoderConfig, RetrievalConfig
    from deployments.retrieval import make_keyer
    from retrieval_service.keys import TextKeyer
    from retrieval_service.library import CachedKeyer

    out, enc = {}, None
    for k in keys:
        if k == "hidden":
            continue
        cfg = RetrievalConfig(key=k, encoder=EncoderConfig(threads=threads))
        if k == "lexical":
            out[k] = CachedKeyer(make_keyer(cfg))
            continue
        if enc is None:
            enc = cached_encoder(cfg.encoder, cache_dir)
        out[k] = CachedKeyer(TextKeyer(k, enc, cfg.lexical_dim))
    return out


def stream_records(raw: Path, per_benchmark: int | None) -> list[tuple[dict, dict]]:
    """(item, plain-greedy record) in the run's stream order, the first ``per_benchmark`` items of
    each benchmark that have a greedy record."""
    cfg = json.loads((raw / "config.json").read_text())
    stream = load_stream(cfg["data"], cfg.get("limit"), cfg.get("seed"), cfg.get("structured", False))
    ar = {}
    for line in (raw / "items.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("method") == "ar" and not r.get("error"):
            ar[r["item"]] = r
    taken: collections.Counter = collections.Counter()
    out = []
    for item in stream:
        b = item["benchmark"]
        if item["id"] in ar and (per_benchmark is None or taken[b] < per_benchmark):
            taken[b] += 1
            out.append((item, ar[item["id"]]))
    return out


class _NoLibrary:
    """The ``none`` key: no shared library, so a replica drafts only from its own history."""

    def search(self, tenant, embedding, tool_names=None, k=10):
        return []

    def add(self, tenant, call, embedding, remember=True):
        return None


def _library(key: str, keyer):
    from retrieval_service.library import ServiceLibrary
    from toolspec_core.drafters.toolcall.library import MemoryLibrary

    if key == "none":
        return _NoLibrary()
    return MemoryLibrary() if key == "hidden" else ServiceLibrary(keyer)


def replay_key(
    key: str,
    recs,
    tokenizer,
    cost,
    keyer,
    hidden: dict,
    replicas: int = 1,
    retrieve_k: int = 8,
    tool_search: bool = False,
) -> dict:
    """Per benchmark and subset (all / calls): decoded tokens, steps, projected step cost.

    ``replicas`` engine replicas share one library per benchmark, the items of the stream going
    to them in turn: each replica's suffix history holds only its own earlier outputs, so from
    the second replica on the library is the only way to the others' calls (as behind a router).
    ``tool_search`` adds, to the first search's calls, a second search filtered to the tool the
    greedy output calls -- given from the start, an upper bound on what a second search made once
    the tool name is written can add."""
    from retrieval_service.embedding import query_text

    libraries: dict[str, object] = {}
    methods: dict[tuple[str, int], object] = {}
    turn: collections.Counter = collections.Counter()
    # tokens, steps, cost, items, items whose greedy output calls a tool, top-1 retrieved call of that tool
    agg = collections.defaultdict(lambda: [0, 0, 0.0, 0, 0, 0])
    cands = collections.defaultdict(list)  # past calls of the offered tools in the library, per item
    t0 = time.perf_counter()
    for item, ar in recs:
        b = item["benchmark"]
        if b not in libraries:
            libraries[b] = _library(key, keyer)
        lib = libraries[b]
        replica = (b, turn[b] % replicas)
        turn[b] += 1
        if replica not in methods:
            methods[replica] = make_method(METHOD, tokenizer, library=lib, retrieve_k=retrieve_k)
        method = methods[replica]
        emb = hidden.get(item["id"]) if key == "hidden" else query_text(item.get("messages") or [], item.get("tools"))
        req = RequestInfo(prompt_ids(tokenizer, item), item.get("tools") or [], embedding=emb)
        req.response_schema = response_schema(item)
        names = [t["function"]["name"] for t in req.tools if "function" in t]
        called = [c.get("name") for c in ar.get("calls") or []]
        top = (
            [as_past_call(c) for c in lib.search(req.tenant, emb, names or None, 1)]
            if called and emb is not None
            else []
        )
        n_cands = len(lib.search(req.tenant, emb, names or None, 100)) if emb is not None else 0
        if tool_search and called and emb is not None:
            first = [as_past_call(c) for c in lib.search(req.tenant, emb, names or None, retrieve_k)]
            texts = {c.text for c in first}
            second = [as_past_call(c) for c in lib.search(req.tenant, emb, [called[0]], retrieve_k)]
            second = [c for c in second if c.text not in texts]
            req.retrieved = first + second
        trace: list = []
        res = simulate(Pruned(method.drafter(req), cost), req.prompt_ids, ar["tokens"], trace, tokenizer=tokenizer)
        method.observe(req, ar["tokens"], ar["text"])
        for subset in ("all", "calls") if ar.get("has_call") else ("all",):
            a = agg[(b, subset)]
            a[0] += res["tokens"] - 1
            a[1] += res["steps"]
            a[2] += sum(cost.step_cost(size) for _, size, _, _ in trace)
            a[3] += 1
            a[4] += bool(called)
            a[5] += bool(top) and top[0].tool_name == called[0]
            cands[(b, subset)].append(n_cands)
    rows = {
        f"{b}/{s}": {
            "items": n,
            "tokens": tok,
            "steps": steps,
            "mat": tok / max(steps, 1),
            "projected_speedup": tok / max(c, 1e-9),
            "top1_tool": right / with_call if with_call else None,
            # how many past calls the offered-tools filter leaves: a key only orders these
            "items_with_candidates": sum(1 for c in cands[(b, s)] if c),
            "max_candidates": max(cands[(b, s)], default=0),
        }
        for (b, s), (tok, steps, c, n, with_call, right) in sorted(agg.items())
    }
    return {"rows": rows, "seconds": time.perf_counter() - t0}


def measured(raw: Path, items: set[str]) -> dict:
    """The run's own ``toolspec`` records on these items: MAT and decode speedup (Σ greedy / Σ method)."""
    recs, ar = [], {}
    for line in (raw / "items.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("error") or r["item"] not in items:
            continue
        if r["method"] == "ar":
            ar[r["item"]] = r
        elif r["method"] == METHOD:
            recs.append(r)
    agg = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0, 0])
    for r in recs:
        if r["item"] not in ar:
            continue
        for subset in ("all", "calls") if ar[r["item"]].get("has_call") else ("all",):
            a = agg[(r["benchmark"], subset)]
            a[0] += r["generated_tokens"] - 1
            a[1] += r["forwards"]
            a[2] += r["ar_decode_s"]
            a[3] += r["decode_s"]
            a[4] += 1
            a[5] += bool(r["exact_match"])
    return {
        f"{b}/{s}": {"items": n, "mat": tok / max(fw, 1), "decode_speedup": ars / max(ds, 1e-9), "exact": ex / n}
        for (b, s), (tok, fw, ars, ds, n, ex) in sorted(agg.items())
    }


def _variants(keys: list[str], tool_search: bool) -> list[tuple[str, str, bool]]:
    """(name, key, tool_search) per replayed column: ``none`` first (the lift's baseline)."""
    out = [("none", "none", False)] + [(k, k, False) for k in keys if k != "none"]
    if tool_search:
        out += [(f"{k}+tool", k, True) for k in keys if k != "none"]
    return out


def markdown(rep: dict) -> str:
    names = [v["name"] for v in rep["variants"]]
    lines = [
        f"# MAT of toolspec by retrieval key: {rep['name']}",
        "",
        f"- run: `{rep['run']}` ({rep['run_config'].get('retrieval_key')} key decoded; model {rep['model']}; "
        f"{rep['hardware']})",
        f"- items: {'the first ' + str(rep['per_benchmark']) if rep['per_benchmark'] else 'all'} per benchmark of "
        "the run's stream with a plain-greedy record; online library (one library per benchmark, stream order, each item observed after it is drafted)",
        "- replicas R: R engine replicas (one `toolspec` each, its own suffix history) take the stream's items "
        "in turn and share the library -- with R = 1 the replica's history already holds every earlier output, "
        "so the library can only reorder what the history offers; k = calls the drafter takes per search",
        "- cells: MAT (decoded tokens / verify steps in the replay along the recorded greedy output) and, in "
        "brackets, the speedup vs plain greedy projected under the run's measured cost curve (drafting time "
        "ignored); `none` = no library (the baseline of the lift)",
        "- keys: qwen / hybrid / lexical = request text keyed as the Retrieval deployment keys it "
        "(`make_keyer`), memory store; hidden = target's last prompt state, in-process MemoryLibrary; "
        "`KEY+tool` = plus a second search filtered to the tool the output calls, given from the start "
        "(an upper bound on a second search made once the tool name is written)",
        "",
    ]
    for subset in ("all", "calls"):
        lines += [
            f"## Subset `{subset}`",
            "",
            "| benchmark | items | replicas | k | "
            + " | ".join(f"MAT {n}" for n in names)
            + " | best lift over none |",
            "|---|---|---|---|" + "---|" * (len(names) + 1),
        ]
        benches = sorted({r.split("/")[0] for g in rep["grid"] for r in g["replay"]["none"]["rows"]})
        for b in benches:
            row = f"{b}/{subset}"
            for g in rep["grid"]:
                cells = [g["replay"][n]["rows"].get(row) for n in names]
                if not cells[0]:
                    continue
                base = cells[0]["mat"]
                best = max((c["mat"] / base, n) for c, n in zip(cells[1:], names[1:]) if c) if len(cells) > 1 else None
                lines.append(
                    f"| {b} | {cells[0]['items']} | {g['replicas']} | {g['retrieve_k']} | "
                    + " | ".join(f"{c['mat']:.2f} ({c['projected_speedup']:.2f}×)" if c else "–" for c in cells)
                    + (f" | {best[0]:.3f}× ({best[1]}) |" if best else " | – |")
                )
        lines.append("")
    g0 = rep["grid"][0]
    keyed = [n for n in names if n != "none" and not n.endswith("+tool")]
    lines += [
        "## Top-1 tool and candidates",
        "",
        "Share of items whose greedy output calls a tool where the library's top-1 call (searched among the "
        "offered tools, before the item is observed) is of that tool; the same library for any R and k:",
        "",
        "| benchmark | " + " | ".join(keyed) + " | items with past calls of the offered tools | at most |",
        "|---|" + "---|" * (len(keyed) + 2),
    ]
    for r, v in g0["replay"][keyed[0]]["rows"].items() if keyed else ():
        if not r.endswith("/all"):
            continue
        tops = [g0["replay"][n]["rows"][r]["top1_tool"] for n in keyed]
        lines.append(
            f"| {r.split('/')[0]} | "
            + " | ".join(f"{t:.2f}" if t is not None else "–" for t in tops)
            + f" | {v['items_with_candidates']} of {v['items']} | {v['max_candidates']} |"
        )
    lines += ["", "## The run's own decode (check of the replay: R = 1, k = the method's default)", ""]
    lines += [
        f"- {row}: MAT {m['mat']:.2f}, decode speedup {m['decode_speedup']:.2f}× "
        f"({rep['run_config'].get('retrieval_key')} key, {m['items']} items, {m['exact']:.0%} exact)"
        for row, m in rep["measured"].items()
    ]
    lines += [
        "",
        "Replay seconds (encoder + drafting), first grid cell: "
        + ", ".join(f"{n} {g0['replay'][n]['seconds']:.0f} s" for n in names),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.mat_by_key", description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="a toolspec bench run directory (items.jsonl with plain-greedy records)")
    ap.add_argument("--keys", default=",".join(RETRIEVAL_KEYS))
    ap.add_argument("--per-benchmark", type=int, default=None, help="the first N items of each benchmark")
    ap.add_argument("--replicas", default="1", help="comma list: engine replicas sharing the library")
    ap.add_argument("--retrieve-k", default=None, help="comma list: calls per search (default: the method's)")
    ap.add_argument("--tool-search", action="store_true", help="also replay KEY+tool (a second, tool-filtered search)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the text encoder")
    ap.add_argument("--cache-dir", default=CACHE_DIR, help="encoded texts, shared with retrieval_key_eval")
    ap.add_argument("--name", default=None)
    ap.add_argument("--results-dir", default=str(RESULTS / "retrieval"))
    a = ap.parse_args(argv)
    raw = Path(a.raw)
    keys = [k.strip() for k in a.keys.split(",") if k.strip()]
    bad = [k for k in keys if k not in RETRIEVAL_KEYS]
    if bad:
        ap.error(f"unknown key(s) {', '.join(bad)}; known: {', '.join(RETRIEVAL_KEYS)}")
    cfg = json.loads((raw / "config.json").read_text())
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(cfg.get("model") or embedded_model_dir()))
    cost = _cost(raw, "run")
    recs = stream_records(raw, a.per_benchmark)
    hidden = (
        {k: decode_hidden(v["hidden"]) for k, v in PrefillCache(raw / "prefill.jsonl").store.records.items()}
        if "hidden" in keys
        else {}
    )
    ks = keyers(keys, a.threads, Path(a.cache_dir))
    default_k = make_method(METHOD, tok).retrieve_k
    grid = [
        (int(r), int(k))
        for r in a.replicas.split(",")
        for k in (a.retrieve_k.split(",") if a.retrieve_k else [default_k])
    ]
    variants = _variants(keys, a.tool_search)
    rep = {
        "name": a.name or f"mat-by-key-{raw.name}",
        "run": str(raw),
        "run_config": {k: cfg.get(k) for k in ("data", "limit", "seed", "max_new_tokens", "retrieval_key", "cost")},
        "model": cfg.get("target"),
        "hardware": cfg.get("hardware"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "per_benchmark": a.per_benchmark,
        "items": len(recs),
        "variants": [{"name": n, "key": k, "tool_search": t} for n, k, t in variants],
        "grid": [],
    }
    for replicas, k in grid:
        cell = {"replicas": replicas, "retrieve_k": k, "replay": {}}
        for name, key, tool in variants:
            cell["replay"][name] = replay_key(key, recs, tok, cost, ks.get(key), hidden, replicas, k, tool)
            r = cell["replay"][name]["rows"]
            print(replicas, k, name, {row: round(v["mat"], 3) for row, v in r.items()}, flush=True)
        rep["grid"].append(cell)
    rep["measured"] = measured(raw, {it["id"] for it, _ in recs})
    out = Path(a.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{rep['name']}.json").write_text(json.dumps(rep, indent=1) + "\n")
    (out / f"{rep['name']}.md").write_text(markdown(rep))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
