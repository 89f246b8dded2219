"""Study: which retrieval key ranks past calls best, three dev sets online. Result: benchmarks/results/retrieval/retrieval-key-eval-3bench-cpu-epyc-7e64d4d.{json,md}.

Which key should the retrieval library rank past tool calls by? Three dev sets, online.

Each dev set (API-Bank, BFCL v3, ToolAlpaca: items with tools and gold calls, every ``--every``-th,
at most ``--limit``) is replayed in online order: item i queries a library holding the gold calls
of items 0..i-1 (never its own), stored as the service stores them (``MemoryStore``: one record per
distinct call, tenant-scoped, cosine), each keyed like the request that produced it. Three
searches per item and key, as the service sees them: ``unfiltered``, ``offered`` (restricted to the
request's offered tools -- what the serving layer sends before decoding) and ``tool`` (restricted
to the gold tool -- once the FSM has the name). Over the top-k:

* ``tool_hit``: a retrieved call has the gold tool name;
* ``value_recall``: fraction of the gold argument values found among the arguments of retrieved
  calls *of the gold tool* -- what retrieval drafting can reuse;
* ``exact``: a retrieved call equals the gold call (the whole call draftable in one step).

Keys. The Retrieval deployment's, computed exactly as it computes them: ``TextKeyer`` (from
``deployments.retrieval.make_keyer``'s config, ``RetrievalConfig``) over
``retrieval_service.embedding.query_text(messages, tools)`` -- what an engine replica sends:

* ``qwen``: the deployment's encoder (``HFEmbedder``, embedded Qwen2.5-Coder-0.5B, mean pooling,
  read at its default depth ``EncoderConfig.depth()``; the serving default), ``qwen_last``: the
  same with ``encoder.pooling: last``; ``qwen_lN`` (``--encoder-layers N``): mean pooling after
  the first N layers;
* ``hybrid``: ``TextKeyer("hybrid")`` (qwen vector beside the hashed lexical one: mean of cosines);
* ``lexical``: ``TextKeyer("lexical")`` (hashed n-grams of the query text) -- the paired baseline;
* ``rrf``: reciprocal rank fusion, score = sum 1 / (60 + rank), rank from 1, of a ``qwen`` and a
  ``lexical`` search of the same store filter, each fetching ``--prefetch`` candidates -- what
  Qdrant's Query API gives for ``prefetch=[dense, sparse], query=RrfQuery(rrf=Rrf(k=61))`` (its
  ranks start at 0); ``rrf_k2``: the same with Qdrant's default ``k=2`` (1 / (2 + rank - 1)).
  Computed here from the two rankings.

The target's own keys, as before: ``hidden_last`` (the prompt's last state, ``loop.prefill``'s ``Prompt.hidden``), ``hidden_mean`` (mean
last-layer state over the prompt, same prefill), and ``lexical_req`` (``LexicalEmbedder.embed_request``:
last user message + offered tool names, the replica-side lexical key of earlier releases).
Baselines: ``recent`` (the k latest calls, no key) and ``oracle`` (every earlier call of the gold
tool: the ceiling any key can reach). Differences to ``lexical`` come with 95% paired bootstrap
intervals (eligible items: the gold tool was called before).

Phase 1 computes the keys and caches them on disk (``--cache-dir``; a rerun resumes): the target's
prefill per item for the hidden keys (``--no-hidden`` skips them), the encoder over the query texts
in length-sorted batches of ``--batch``. Phase 2 is instant. Run in the background:

    nohup python -m benchmarks.studies.retrieval_key_eval > /tmp/key_eval.log 2>&1 &
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmarks.datasets import dev_set, read_jsonl
from retrieval_service.embedding import LexicalEmbedder, normalise, query_text
from retrieval_service.records import CallRecord, schema_hash
from retrieval_service.store import MemoryStore

# dev set -> (every, limit): ~450 items, under 25 min of a 2-core CPU for all keys
SETS = {"api_bank": (2, 200), "bfcl_v3": (6, 210), "toolalpaca": (1, 100)}
TEXT_KEYS = ("qwen", "qwen_last", "hybrid", "lexical")
HIDDEN_KEYS = ("hidden_last", "hidden_mean")
KEYS = ("qwen", "qwen_last", "hybrid", "lexical", "rrf", "rrf_k2", "hidden_last", "hidden_mean", "lexical_req")
FUSED = ("rrf", "rrf_k2")


def ordered(names) -> list[str]:
    """Key names in table order: ``KEYS``'s, with the shallow encoders (``qwen_lN``, by depth)
    after ``qwen_last``."""
    names = set(names)
    shallow = sorted((n for n in names if n.startswith("qwen_l") and n[6:].isdigit()), key=lambda n: int(n[6:]))
    order = [k for k in KEYS[:2] if k in names] + shallow + [k for k in KEYS[2:] if k in names]
    return order


BASELINE = "lexical"
RRF_K = 60
CACHE_DIR = "/tmp/toolspec-key-eval"  # encoded texts and hidden keys, reused by reruns (and mat_by_key)
# (column, metric) pairs compared with paired bootstrap CIs vs the lexical key
HEADLINE = (
    ("unfiltered@1", "tool_hit"),
    ("offered@1", "tool_hit"),
    ("offered@1", "exact"),
    ("offered@10", "value_recall"),
    ("tool@1", "value_recall"),
    ("tool@1", "exact"),
)


def load_items(path: Path, every: int, limit: int) -> list[dict]:
    items = read_jsonl(path)
    items = [it for it in items if it.get("tools") and it.get("gold_calls")]
    return items[::every][:limit]


def call_text(call: dict) -> str:
    return json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)


def _v(x) -> str:
    return json.dumps(x, sort_keys=True, ensure_ascii=False)


# ----------------------------------------------------------------------------- phase 1: keys


def compute_hidden_keys(items: list[dict], cache: Path, threads: int, log_every: int = 10) -> dict[str, np.ndarray]:
    """hidden_last / hidden_mean per item, resumable through ``cache`` (npz)."""
    done: dict[str, dict[str, np.ndarray]] = {}
    if cache.exists():
        z = np.load(cache, allow_pickle=False)
        for i, iid in enumerate(z["ids"].tolist()):
            done[iid] = {"hidden_last": z["hidden_last"][i], "hidden_mean": z["hidden_mean"][i]}
    todo = [it for it in items if it["id"] not in done]
    if todo:
        from deployments.hidden_keys import HiddenStateEmbedder
        from toolspec_core.model.prompting import render_prompt
        from toolspec_core.model.target import load_target

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
                    f"  hidden {n}/{len(todo)} prompt_tokens={len(ids)} prefill_s={pre.seconds:.2f} "
                    f"elapsed={time.time() - t0:.0f}s",
                    flush=True,
                )
        _save(cache, done)
        del emb
    return {k: np.stack([done[it["id"]][k] for it in items]) for k in HIDDEN_KEYS}


def _cached_all(cache: Path, items: list[dict]) -> bool:
    if not cache.exists():
        return False
    have = set(np.load(cache, allow_pickle=False)["ids"].tolist())
    return all(it["id"] in have for it in items)


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


class CachedEncoder:
    """The deployment's ``HFEmbedder`` behind an on-disk cache of text -> vector: what
    ``TextKeyer`` calls, so the keys are the deployment's, and a rerun encodes only new texts.
    Misses are encoded in length-sorted batches of ``batch`` (little padding)."""

    def __init__(self, encoder, cache: Path, batch: int = 8):
        self.encoder, self.cache, self.batch = encoder, cache, batch
        self.dim, self.name = encoder.dim, encoder.name
        self.vecs: dict[str, np.ndarray] = {}
        if cache.exists():
            z = np.load(cache, allow_pickle=False)
            self.vecs = dict(zip(z["ids"].tolist(), z["vecs"]))

    @staticmethod
    def _id(text: str) -> str:
        return hashlib.sha1(text.encode("utf-8")).hexdigest()

    def encode(self, texts) -> np.ndarray:
        texts = list(texts)
        todo = sorted({t for t in texts if self._id(t) not in self.vecs}, key=len)
        t0 = time.time()
        for n in range(0, len(todo), self.batch):
            chunk = todo[n : n + self.batch]
            for t, v in zip(chunk, self.encoder.encode(chunk)):
                self.vecs[self._id(t)] = v
            self._save()
            print(f"  {self.name}: {n + len(chunk)}/{len(todo)} texts, {time.time() - t0:.0f}s", flush=True)
        return np.stack([self.vecs[self._id(t)] for t in texts])

    def _save(self) -> None:
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache.with_name(self.cache.stem + ".tmp.npz")
        ids = list(self.vecs)
        np.savez(tmp, ids=np.array(ids), vecs=np.stack([self.vecs[i] for i in ids]))
        tmp.replace(self.cache)


def text_keys(
    sets: dict[str, list[dict]], cache_dir: Path, batch: int, layers: tuple[int, ...] = ()
) -> dict[str, dict[str, np.ndarray]]:
    """qwen / qwen_last / hybrid / lexical (and ``qwen_lN``: the encoder cut to its first N
    layers) per item of each set, through ``TextKeyer`` built from the deployment's
    ``RetrievalConfig`` over ``query_text`` (what a replica sends)."""
    from deployments.config import RetrievalConfig
    from retrieval_service.keys import TextKeyer

    texts = {name: [query_text(it["messages"], it["tools"]) for it in items] for name, items in sets.items()}
    everything = [t for ts in texts.values() for t in ts]
    out: dict[str, dict[str, np.ndarray]] = {name: {} for name in sets}
    variants = [("mean", None, ("qwen", "hybrid")), ("last", None, ("qwen_last",))]
    variants += [("mean", n, (f"qwen_l{n}",)) for n in layers]
    for pooling, depth, names in variants:
        cfg = RetrievalConfig(key="qwen", encoder={"pooling": pooling, "layers": depth})
        enc = cached_encoder(cfg.encoder, cache_dir, batch)
        enc.encode(everything)  # fill the cache once, batched across the sets
        for key in names:
            keyer = TextKeyer("hybrid" if key == "hybrid" else "qwen", enc, cfg.lexical_dim)
            for name in sets:
                out[name][key] = keyer.keys(texts[name])
    lex = TextKeyer("lexical", None, RetrievalConfig().lexical_dim)
    for name in sets:
        out[name]["lexical"] = lex.keys(texts[name])
    return out


def cached_encoder(e, cache_dir: Path, batch: int = 8) -> CachedEncoder:
    """The encoder of ``EncoderConfig`` ``e`` behind its on-disk cache in ``cache_dir`` (one file
    per model, pooling, length, prefix and depth: the settings that change a vector), loaded only
    when a text is missing."""
    tag = f"{Path(e.model).name}-{e.pooling}-{e.max_length}-{hashlib.sha1(e.prefix.encode()).hexdigest()[:6]}"
    tag += f"-l{e.depth()}" if e.depth() is not None else ""
    return CachedEncoder(_LazyEncoder(e), cache_dir / f"encoder-{tag}.npz", batch)


class _LazyEncoder:
    """``HFEmbedder`` with the deployment's encoder settings, loaded on the first miss only."""

    def __init__(self, e):
        self.e, self._enc = e, None
        self.dim = _hidden_size(e.model)
        self.name = f"hf:{Path(e.model).name}:{e.pooling}"

    def encode(self, texts):
        if self._enc is None:
            from deployments.retrieval import build_encoder

            t0 = time.time()
            self._enc = build_encoder(self.e)
            print(f"loaded encoder {self._enc.name} in {time.time() - t0:.1f}s", flush=True)
        return self._enc.encode(texts)


def _layers_total(model: str) -> int:
    from transformers import AutoConfig

    from deployments.retrieval import encoder_dir

    return int(AutoConfig.from_pretrained(encoder_dir(model)).num_hidden_layers)


def _hidden_size(model: str) -> int:
    from deployments.retrieval import hidden_size

    return hidden_size(model)


def all_keys(items: list[dict], hidden: dict[str, np.ndarray] | None, text: dict[str, np.ndarray]) -> dict:
    keys = {k: np.stack([normalise(v) for v in m]) for k, m in text.items()}
    lex = LexicalEmbedder(1024)
    keys["lexical_req"] = np.stack([lex.embed_request(it["messages"], it["tools"]) for it in items])
    for k in HIDDEN_KEYS:
        if hidden is not None:
            keys[k] = np.stack([normalise(v) for v in hidden[k]])
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


def rrf(rankings: list[list], k: int = RRF_K) -> list:
    """Reciprocal rank fusion of record lists (best first): score = sum over lists of
    1 / (k + rank), rank from 1; ties keep the first list's order."""
    score: dict[str, float] = {}
    first: dict[str, tuple[int, int]] = {}
    recs: dict[str, object] = {}
    for li, ranking in enumerate(rankings):
        for rank, rec in enumerate(ranking, 1):
            score[rec.id] = score.get(rec.id, 0.0) + 1.0 / (k + rank)
            first.setdefault(rec.id, (li, rank))
            recs[rec.id] = rec
    order = sorted(score, key=lambda i: (-score[i], first[i]))
    return [recs[i] for i in order]


def evaluate(items: list[dict], keys: dict[str, np.ndarray], order: list[int], ks=(1, 3, 10), prefetch=20) -> dict:
    """Online over ``order``: each item searches the library of earlier items, then joins it."""
    stores = {name: MemoryStore(dim=m.shape[1]) for name, m in keys.items()}
    history: list[dict] = []  # earlier gold calls, newest last
    rows = []
    for step, i in enumerate(order):
        it = items[i]
        gold = it["gold_calls"][0]
        row = {"eligible": float(any(h["name"] == gold["name"] for h in history)), "has_args": bool(gold["arguments"])}
        if step:
            offered = [t["function"]["name"] for t in it["tools"]]
            for filt, names in (("unfiltered", None), ("offered", offered), ("tool", gold["name"])):
                ranked = {
                    name: [r for r, _ in store.search("eval", keys[name][i], tool_name=names, k=max(max(ks), prefetch))]
                    for name, store in stores.items()
                }
                if "qwen" in ranked and "lexical" in ranked:
                    ranked["rrf"] = rrf([ranked["qwen"], ranked["lexical"]], RRF_K)
                    ranked["rrf_k2"] = rrf([ranked["qwen"], ranked["lexical"]], 1)  # Qdrant's default k=2
                for name, recs in ranked.items():
                    calls = [{"name": r.tool_name, "arguments": r.arguments} for r in recs[: max(ks)]]
                    for k in ks:
                        row[f"{name}/{filt}@{k}"] = _scores(gold, calls[:k])
            latest = list(dict.fromkeys(call_text(h) for h in reversed(history)))
            recent = [json.loads(t) for t in latest]
            recent_tool = [c for c in recent if c["name"] == gold["name"]]
            recent_offered = [c for c in recent if c["name"] in set(offered)]
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
    for key in ordered({k.split("/")[0] for r in rows for k in r if "/" in k}):
        if key == BASELINE:
            continue
        for col, metric in HEADLINE:
            pairs = [
                (r[f"{key}/{col}"][metric], r[f"{BASELINE}/{col}"][metric])
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


# ----------------------------------------------------------------------------- report


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def to_markdown(res: dict) -> str:
    s = res["setup"]
    lines = [
        "# Retrieval key evaluation (three dev sets, online)",
        "",
        f"Model {s['model']}, commit {s['commit']}, {s['machine']}. Library = gold calls of earlier items "
        "(MemoryStore, deduplicated), each keyed like its request. Text keys are the Retrieval deployment's "
        "(`TextKeyer` over `query_text`, encoder settings from `RetrievalConfig`"
        + (
            f"; `qwen`, `qwen_last`, `hybrid` read the encoder at its default depth, {d} layers"
            if (d := s.get("qwen_depth"))
            else ""
        )
        + (f"; `qwen_lN` after its first N of {t} layers" if (t := s.get("encoder_layers_total")) else "")
        + "); `rrf` fuses a `qwen` and a "
        f"`lexical` search (k={RRF_K}, {s['prefetch']} candidates each). tool_hit / value_recall / exact as "
        "defined in `benchmarks/studies/retrieval_key_eval.py`; value_recall counts only retrieved calls of the gold "
        "tool. `eligible` = items whose gold tool was called before; tables are of eligible items. "
        f"Phase 1 (keys) took {s.get('phase1_s', 0):.0f} s"
        + (
            f" (this run, from cached keys; computing them took {sum(first.values()):.0f} s wall on the shared CPU: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in first.items())
            + ")."
            if (first := s.get("phase1_first_run_wall_s"))
            else "."
        ),
        "",
    ]
    for bench, b in res["benchmarks"].items():
        present = b.get("keys", s["keys"])
        lines += [f"## {bench} ({b['items']} items: every {b['every']}th of {b['data']})", ""]
        for order, r in b["orders"].items():
            lines += [f"### order: {order} ({r['items']} queries, {r['n_eligible']} eligible)", ""]
            lines += [
                "| key | unfiltered tool_hit@1 | tool_hit@10 | offered tool_hit@1 | offered exact@1 "
                "| offered value_recall@10 | gold-tool value_recall@1 | @3 | gold-tool exact@1 | exact@10 |",
                "|---" * 10 + "|",
            ]
            t = r["eligible"]
            for key in ("recent",) + tuple(present):

                def g(c, m, key=key):
                    return t.get(f"{key}/{c}", {}).get(m)

                lines.append(
                    f"| {key} | {_f(g('unfiltered@1', 'tool_hit'))} | {_f(g('unfiltered@10', 'tool_hit'))} | "
                    f"{_f(g('offered@1', 'tool_hit'))} | {_f(g('offered@1', 'exact'))} | "
                    f"{_f(g('offered@10', 'value_recall'))} | {_f(g('tool@1', 'value_recall'))} | "
                    f"{_f(g('tool@3', 'value_recall'))} | {_f(g('tool@1', 'exact'))} | {_f(g('tool@10', 'exact'))} |"
                )
            o = t.get("oracle/tool@all", {})
            lines += [
                f"| oracle (all earlier calls of the tool) | - | 1.000 | 1.000 | - | {_f(o.get('value_recall'))} "
                f"| - | - | - | {_f(o.get('exact'))} |",
                "",
                f"Difference to `{BASELINE}` (eligible items, 95% paired bootstrap interval):",
                "",
                "| key | " + " | ".join(f"{c} {m}" for c, m in HEADLINE) + " |",
                "|---" * (len(HEADLINE) + 1) + "|",
            ]
            pv = r["paired_vs_lexical"]
            for key in present:
                if key == BASELINE:
                    continue
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


VERDICT_METRICS = (("offered@1", "tool_hit"), ("tool@1", "value_recall"), ("offered@10", "value_recall"))


def verdict(res: dict) -> str:
    """The best key per verdict metric (eligible items, mean of both orders, per set and the mean
    over sets), and per key and headline metric: better / worse than lexical where the 95% paired
    interval excludes 0 in both orders of a set, else tie."""
    keys = ordered(res["setup"]["keys"])
    lines = []
    for col, metric in VERDICT_METRICS:
        per: dict[str, dict[str, float]] = {}
        for bench, b in res["benchmarks"].items():
            for key in keys:
                vals = [o["eligible"].get(f"{key}/{col}", {}).get(metric) for o in b["orders"].values()]
                vals = [v for v in vals if v is not None]
                if vals:
                    per.setdefault(key, {})[bench] = float(np.mean(vals))
        mean = {k: float(np.mean(list(v.values()))) for k, v in per.items() if len(v) == len(res["benchmarks"])}
        if not mean:
            continue
        best = max(mean, key=mean.get)
        cells = ", ".join(f"{bench} {max(per, key=lambda k: per[k].get(bench, -1))}" for bench in res["benchmarks"])
        rank = "; ".join(f"{k} {mean[k]:.3f}" for k in sorted(mean, key=mean.get, reverse=True))
        lines.append(
            f"- **best for {col} {metric}: `{best}`** (mean over sets, both orders, eligible items: {rank}); "
            f"best per set: {cells}"
        )
    lines.append("")
    for bench, b in res["benchmarks"].items():
        for key in b.get("keys", keys):
            if key == BASELINE:
                continue
            parts = []
            for col, metric in HEADLINE:
                cis = [o["paired_vs_lexical"].get(f"{key}/{col}/{metric}") for o in b["orders"].values()]
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
            lines.append(f"- {bench}: {key} vs {BASELINE}: " + "; ".join(parts))
    return "\n".join(lines)


def git_commit() -> str:
    """The checkout's short commit, which names a result file (``unknown`` outside git)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def _parse_set(spec: str, every: int | None, limit: int | None) -> tuple[str, Path, int, int]:
    """``name[:every[:limit]]`` or a path to a JSONL file (same suffixes)."""
    head, *rest = spec.split(":")
    path = Path(head) if head.endswith((".jsonl", ".jsonl.gz")) else dev_set(head)
    name = path.name.split(".")[0]
    d_every, d_limit = SETS.get(name, (1, 100))
    e = int(rest[0]) if len(rest) > 0 and rest[0] else (every or d_every)
    lim = int(rest[1]) if len(rest) > 1 and rest[1] else (limit or d_limit)
    return name, path, e, lim


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", nargs="+", default=list(SETS), help="name|path.jsonl[.gz][:every[:limit]] per dev set")
    ap.add_argument("--every", type=int, default=None, help="stride over each set's items (default per set)")
    ap.add_argument("--limit", type=int, default=None, help="items per set at most (default per set)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared CPU)")
    ap.add_argument("--batch", type=int, default=8, help="texts per encoder forward")
    ap.add_argument("--prefetch", type=int, default=20, help="candidates per search fused by rrf")
    ap.add_argument("--no-hidden", action="store_true", help="skip the target's hidden keys (no prefill)")
    ap.add_argument(
        "--encoder-layers", type=int, nargs="*", default=[], help="also key with the encoder cut to N layers (qwen_lN)"
    )
    ap.add_argument("--hidden-if-cached", action="store_true", help="hidden keys only of sets fully cached")
    ap.add_argument("--cache-dir", default=CACHE_DIR)
    ap.add_argument("--machine", default="cpu-epyc")
    ap.add_argument("--out", default=None, help="JSON path (.md beside it); default results/retrieval/...")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None, help="the code's commit in the output name (default: git HEAD)")
    args = ap.parse_args(argv)
    commit = args.commit or git_commit()
    import torch

    torch.set_num_threads(args.threads)  # the encoder's too (its config leaves threads unset)
    cache_dir = Path(args.cache_dir)
    specs = [_parse_set(s, args.every, args.limit) for s in args.sets]
    sets = {name: load_items(path, e, lim) for name, path, e, lim in specs}
    t0 = time.time()
    text = text_keys(sets, cache_dir, args.batch, tuple(args.encoder_layers))
    hidden = {}
    for name, items in sorted(sets.items(), key=lambda kv: len(kv[1])):  # smallest set first
        cache = cache_dir / f"hidden-{name}.npz"
        if args.no_hidden or (args.hidden_if_cached and not _cached_all(cache, items)):
            continue
        print(f"{name}: hidden keys of {len(items)} items", flush=True)
        hidden[name] = compute_hidden_keys(items, cache, args.threads)
    phase1 = time.time() - t0
    from deployments.config import RetrievalConfig
    from toolspec_core.model.embedded import EMBEDDED_MODEL_NAME

    keys_of = {name: all_keys(items, hidden.get(name), text[name]) for name, items in sets.items()}
    res = {
        "setup": {
            "model": EMBEDDED_MODEL_NAME,
            "commit": commit,
            "machine": args.machine,
            "k": [1, 3, 10],
            "keys": ordered([*FUSED, *(k for kk in keys_of.values() for k in kk)]),
            "lexical_dim": 1024,
            "qwen_depth": RetrievalConfig().encoder.depth(),
            "encoder_layers_total": _layers_total(RetrievalConfig().encoder.model),
            "rrf_k": RRF_K,
            "prefetch": args.prefetch,
            "batch": args.batch,
            "phase1_s": round(phase1, 1),
            "dims": {k: int(m.shape[1]) for k, m in next(iter(keys_of.values())).items()},
        },
        "benchmarks": {},
    }
    for (name, path, e, _lim), items in zip(specs, sets.values()):
        keys = keys_of[name]
        shuffled = list(range(len(items)))
        random.Random(args.seed).shuffle(shuffled)
        res["benchmarks"][name] = {
            "keys": ordered([*keys, *FUSED]),
            "data": path.name,
            "items": len(items),
            "every": e,
            "orders": {
                "file": evaluate(items, keys, list(range(len(items))), prefetch=args.prefetch),
                f"shuffled_seed{args.seed}": evaluate(items, keys, shuffled, prefetch=args.prefetch),
            },
        }
    res["verdict"] = verdict(res)
    out = Path(
        args.out or f"benchmarks/results/retrieval/retrieval-key-eval-{len(sets)}bench-{args.machine}-{commit}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(to_markdown(res))
    print(res["verdict"])
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
