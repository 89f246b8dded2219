"""Study: the embedded store backends' add / search / reopen times. Result: benchmarks/results/retrieval/store-bench-cpu-xeon-26a95a4.{json,md}.

Embedded backends head to head: qdrant-edge-py vs qdrant-client local mode.

10k points (dim 896, random unit vectors), 20 tenants x 25 tools, top-10 search filtered by tenant
+ tool name (the retrieval service's query) and by tenant only; single adds on the full store;
reopening the store (a replica restart). One search thread (``OMP_NUM_THREADS=1``) on purpose:
the store shares the CPU with the model.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.bench_store --out benchmarks/results/retrieval/store-bench-cpu-xeon-26a95a4.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from retrieval_service.records import CallRecord
from retrieval_service.store import EdgeStore, QdrantStore


def _records(n: int, dim: int, tenants: int, tools: int, seed: int = 0, tag: str = "") -> list[CallRecord]:
    rng = np.random.default_rng(seed)
    vecs = rng.normal(size=(n, dim)).astype(np.float32)
    t0 = time.time() - n
    return [
        CallRecord(
            tenant=f"tenant{i % tenants}",
            tool_name=f"tool{(i // tenants) % tools}",
            text=f'{{"name": "tool{(i // tenants) % tools}", "arguments": {{"i": {i}}}}}{tag}',
            token_ids=list(range(40)),
            arguments={"i": i},
            embedding=vecs[i],
            created_at=t0 + i,
        )
        for i in range(n)
    ]


def _ms(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"median_ms": round(float(np.median(a)), 3), "p95_ms": round(float(np.percentile(a, 95)), 3), "n": len(xs)}


def bench(name: str, make, records: list[CallRecord], queries: int, adds: int, tenants: int, tools: int) -> dict:
    rng = np.random.default_rng(1)
    dim = len(records[0].embedding)
    t0 = time.perf_counter()
    store = make()
    for s in range(0, len(records), 500):
        store.add_many(records[s : s + 500])
    fill_s = time.perf_counter() - t0
    qv = rng.normal(size=(queries, dim)).astype(np.float32)
    both, tenant_only = [], []
    for j in range(queries):
        t, tool = f"tenant{j % tenants}", f"tool{j % tools}"
        a = time.perf_counter()
        hits = store.search(t, qv[j], tool_name=tool, k=10)
        both.append(time.perf_counter() - a)
        assert hits and all(r.tenant == t and r.tool_name == tool for r, _ in hits)
        a = time.perf_counter()
        hits = store.search(t, qv[j], k=10)
        tenant_only.append(time.perf_counter() - a)
        assert len(hits) == 10 and all(r.tenant == t for r, _ in hits)
    single = []
    for r in _records(adds, dim, tenants, tools, seed=2, tag=" new"):
        a = time.perf_counter()
        store.add(r)
        single.append(time.perf_counter() - a)
    n = store.count()
    store.close()
    a = time.perf_counter()
    store = make()
    reopen_s = time.perf_counter() - a
    assert store.count() == n
    store.close()
    return {
        "backend": name,
        "points": n,
        "fill_s_batches_of_500": round(fill_s, 3),
        "search_tenant_and_tool": _ms(both),
        "search_tenant_only": _ms(tenant_only),
        "add_one": _ms(single),
        "reopen_s": round(reopen_s, 3),
    }


def to_markdown(out: dict) -> str:
    st = out["setup"]
    lines = [
        "# Embedded store: qdrant-edge-py vs qdrant-client local mode",
        "",
        f"{st['points']} points, dim {st['dim']}, {st['tenants']} tenants x {st['tools']} tools, top-{st['k']}, "
        f"{st['queries']} queries, one search thread, shared 2-core CPU. Versions: "
        + ", ".join(f"{k} {v}" for k, v in out["versions"].items())
        + ".",
        "",
        "| backend | search tenant+tool median / p95 ms | tenant only median / p95 ms | one add median ms | fill (batches of 500) s | reopen s |",
        "|---|---|---|---|---|---|",
    ]
    for r in out["results"]:
        a, b = r["search_tenant_and_tool"], r["search_tenant_only"]
        lines.append(
            f"| {r['backend']} | {a['median_ms']} / {a['p95_ms']} | {b['median_ms']} / {b['p95_ms']} | "
            f"{r['add_one']['median_ms']} | {r['fill_s_batches_of_500']} | {r['reopen_s']} |"
        )
    lines += [
        "",
        "Embedded default: `edge` (`retrieval_service.store.EMBEDDED_BACKEND`). Produced by "
        "`OMP_NUM_THREADS=1 python -m benchmarks.studies.bench_store`.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=896)
    ap.add_argument("--tenants", type=int, default=20)
    ap.add_argument("--tools", type=int, default=25)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--adds", type=int, default=100)
    ap.add_argument("--out", default="benchmarks/runs/store-bench.json")
    args = ap.parse_args(argv)
    records = _records(args.points, args.dim, args.tenants, args.tools)
    root = Path(tempfile.mkdtemp(prefix="store-bench-"))
    try:
        results = [
            bench(
                "edge (qdrant-edge-py)",
                lambda: EdgeStore(str(root / "edge"), dim=args.dim),
                records,
                args.queries,
                args.adds,
                args.tenants,
                args.tools,
            ),
            bench(
                "qdrant_local (qdrant-client path=)",
                lambda: QdrantStore(path=str(root / "ql"), dim=args.dim),
                records,
                args.queries,
                args.adds,
                args.tenants,
                args.tools,
            ),
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "setup": vars(args) | {"k": 10, "search_threads": 1, "machine": platform.processor() or platform.machine()},
        "results": results,
    }
    from importlib.metadata import version

    import qdrant_client

    out["versions"] = {
        "qdrant-client": qdrant_client.__version__
        if hasattr(qdrant_client, "__version__")
        else version("qdrant-client"),
        "qdrant-edge-py": version("qdrant-edge-py"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(to_markdown(out))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
