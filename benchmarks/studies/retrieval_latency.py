"""Study: the Retrieval actor's search latency at concurrency 1 / 8 / 32. Result: benchmarks/results/measurements/retrieval-latency-{l6,l24}-cpu-epyc-7e64d4d.json.

Latency of the actor's search path: the ``Retrieval`` deployment keying request text (``qwen``).

What an engine replica pays per request before its drafter has the library's answer: one
``search`` through a Serve handle = the deployment's ``key_of`` (the text embedded by its Qwen
encoder, batched with concurrent queries by ``@serve.batch``) + the store search. A real Ray Serve
deployment of ``deployments.app.Retrieval`` (``serve.batch`` needs a replica: its queue asks for
the replica context), an in-memory store filled with ~200 calls of the dev sets, each keyed by its
request's text (through the deployment's ``key_of`` once, the same vectors for every mode); then queries with real dev-set request texts (``query_text``, restricted to the
offered tools as the replica sends them) from ``c`` concurrent callers, batching on
(``max_batch_size`` 16, ``batch_wait_timeout_s`` 0.005) and off (``max_batch_size`` 1).
Per cell: p50 / p95 latency (ms, send to answer, handle overhead included) and queries/s.

    RAY_AUTH_MODE=disabled python -m benchmarks.studies.retrieval_latency
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import time
from pathlib import Path

import numpy as np

from benchmarks.datasets import dev_set, read_jsonl
from retrieval_service.embedding import query_text

from .retrieval_key_eval import git_commit

SETS = ("api_bank", "bfcl_v3", "toolalpaca")
MODES = {"batching_on": (16, 0.005), "batching_off": (1, 0.005)}
TENANT = "bench"


def dev_items() -> list[dict]:
    """Items with tools and gold calls of the three dev sets, interleaved (set 1, set 2, set 3, ...)."""
    per = []
    for name in SETS:
        per.append([it for it in read_jsonl(dev_set(name)) if it.get("tools") and it.get("gold_calls")])
    out = []
    for i in range(max(map(len, per))):
        out += [items[i] for items in per if i < len(items)]
    return out


def split(items: list[dict], fill: int, queries: int) -> tuple[list[dict], list[dict]]:
    """Library calls from the even items, query requests from the odd ones (never the same request)."""
    return items[0::2][:fill], items[1::2][:queries]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)), 1) if xs else float("nan")


async def library_keys(handle, items: list[dict]) -> list[list[float]]:
    """The library calls' keys, from the deployment's own ``key_of`` (their request texts, batched)."""
    return list(await asyncio.gather(*(handle.key_of.remote(query_text(it["messages"], it["tools"])) for it in items)))


async def fill_library(handle, items: list[dict], keys: list[list[float]]) -> int:
    """Each item's gold call, stored under its request's key (as the replica's add sends it)."""
    from retrieval_service.records import schema_hash

    calls = []
    for it, key in zip(items, keys):
        g = it["gold_calls"][0]
        tool = next((t for t in it["tools"] if t["function"]["name"] == g["name"]), {"name": g["name"]})
        text = json.dumps({"name": g["name"], "arguments": g["arguments"]}, ensure_ascii=False)
        calls.append(handle.add.remote(TENANT, g["name"], schema_hash(tool), text, [], g["arguments"], key))
    await asyncio.gather(*calls)
    return len(calls)


async def measure(handle, queries: list[tuple[str, list[str]]], concurrency: int, n: int, k: int) -> dict:
    """``n`` searches from ``concurrency`` callers, each sending its next query when answered."""
    lat: list[float] = []
    hits: list[int] = []
    nxt = iter(range(n))

    async def caller():
        for i in nxt:
            text, names = queries[i % len(queries)]
            t0 = time.perf_counter()
            res = await handle.search.remote(TENANT, text, names, k)
            lat.append(1e3 * (time.perf_counter() - t0))
            hits.append(len(res))

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "queries": n,
        "p50_ms": _pct(lat, 50),
        "p95_ms": _pct(lat, 95),
        "mean_ms": round(float(np.mean(lat)), 1),
        "max_ms": round(float(np.max(lat)), 1),
        "qps": round(n / wall, 2),
        "wall_s": round(wall, 2),
        "mean_hits": round(float(np.mean(hits)), 2),
    }


async def run_mode(mode: str, args, library: list[dict], queries: list[tuple[str, list[str]]], keys: list) -> dict:
    from ray import serve

    from deployments.app import Retrieval, retrieval_dim
    from deployments.config import ServeAppConfig

    max_batch, wait = MODES[mode]
    cfg = ServeAppConfig(
        retrieval={
            "key": "qwen",
            "store": {"backend": "memory"},
            "max_batch_size": max_batch,
            "batch_wait_timeout_s": wait,
            "encoder": {"threads": args.threads, "layers": args.layers},
        }
    )
    t0 = time.perf_counter()
    app = Retrieval.options(ray_actor_options={"num_cpus": 0}).bind(cfg, retrieval_dim(cfg))
    handle = serve.run(app, name=f"latency-{mode}", route_prefix=None)
    started = time.perf_counter() - t0
    t0 = time.perf_counter()
    if not keys:  # the first mode keys the library (batched when batching is on); later ones reuse them
        keys += await library_keys(handle, library)
    filled = await fill_library(handle, library, keys)
    fill_s = time.perf_counter() - t0
    await measure(handle, queries, 1, args.warmup, args.k)  # first forwards (allocations, caches)
    cells = []
    for c in args.concurrency:
        n = max(args.min_queries, args.per_caller * c)
        cell = await measure(handle, queries, c, n, args.k)
        cell["loadavg_1m"] = round(os.getloadavg()[0], 2)
        print(f"{mode:13s} c={c:3d} {json.dumps(cell)}", flush=True)
        cells.append(cell)
    stats = await handle.stats.remote()
    serve.delete(f"latency-{mode}")
    return {
        "max_batch_size": max_batch,
        "batch_wait_timeout_s": wait,
        "deploy_s": round(started, 1),
        "library_calls": filled,
        "fill_s": round(fill_s, 1),
        "records": stats.get("records"),
        "key": stats.get("key"),
        "encoder_batches": stats.get("encoder_batches"),
        "cells": cells,
    }


def table(res: dict) -> str:
    lines = [
        "| batching | concurrency | queries | p50 ms | p95 ms | queries/s |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in res["modes"].items():
        for c in r["cells"]:
            lines.append(
                f"| {mode.split('_')[1]} (max_batch {r['max_batch_size']}) | {c['concurrency']} | {c['queries']} "
                f"| {c['p50_ms']:.1f} | {c['p95_ms']:.1f} | {c['qps']:.2f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fill", type=int, default=200, help="calls in the library")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--per-caller", type=int, default=2, help="queries per concurrent caller")
    ap.add_argument("--min-queries", type=int, default=16, help="queries per cell at least")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="the encoder's torch threads (retrieval.encoder.threads)")
    ap.add_argument("--layers", type=int, default=None, help="the encoder cut to its first N layers (encoder.layers)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--machine", default="cpu-epyc")
    ap.add_argument("--commit", default=None, help="the code's commit in the output name (default: git HEAD)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray
    from ray import serve

    from deployments.config import EncoderConfig

    commit = args.commit or git_commit()
    n_queries = max(args.min_queries, args.per_caller * max(args.concurrency))
    library, requests = split(dev_items(), args.fill, n_queries)
    queries = [
        (query_text(it["messages"], it["tools"]), [t["function"]["name"] for t in it["tools"]]) for it in requests
    ]
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
    res = {
        "what": "Retrieval deployment search latency (key qwen: key_of + memory store search, via a Serve handle)",
        "commit": commit,
        "machine": args.machine,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "encoder_threads": args.threads,
        "encoder_layers": EncoderConfig(layers=args.layers).depth(),
        "query_texts": {"n": len(queries), "mean_chars": round(float(np.mean([len(q) for q, _ in queries])), 1)},
        "modes": {},
    }
    try:
        keys: list = []
        for mode in args.modes:
            res["modes"][mode] = asyncio.run(run_mode(mode, args, library, queries, keys))
    finally:
        serve.shutdown()
        ray.shutdown()
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    layers = EncoderConfig(layers=args.layers).depth()
    depth = f"-l{layers}" if layers else ""
    out = Path(args.out or f"benchmarks/results/measurements/retrieval-latency{depth}-{args.machine}-{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
