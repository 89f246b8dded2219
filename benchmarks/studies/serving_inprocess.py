"""Study: the replica's HTTP path in one process, without Ray: CPU per streamed token.

The replica's own app (``make_api(LocalBackend(EngineHost))``: validation, request preparation,
the engine thread, the bridge, OpenAI chunks, SSE) serving ``model: scripted`` (no forward, so
what remains is the path's own work), driven over httpx's ASGI transport by ``--concurrency``
streamed clients sending the load test's dev-set items (tools offered), 128 tokens each. Prints
the rate and the process's CPU seconds (user + system, the clients included) per streamed token, and writes
them to ``--out`` (JSON). Run it under ``py-spy record --gil`` to see where the time goes; run two
trees alternately (each on its own ``PYTHONPATH``) for an A/B. Result:
benchmarks/results/loadtest/serving-ab-inprocess-*.md

    python -m benchmarks.studies.serving_inprocess --concurrency 8 --requests 256 --out F.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.serving_inprocess", description=__doc__)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens-per-step", type=int, default=1, help="the scripted target's tokens a step")
    p.add_argument(
        "--out", default=None, help="the report (JSON); default benchmarks/runs/serving-inprocess-<time>.json"
    )
    ns = p.parse_args(argv)

    import httpx

    from benchmarks.cost import hardware_string
    from benchmarks.loadtest.client import build_payload
    from benchmarks.loadtest.workloads import default_datasets, load_items
    from deployments.config import ServeAppConfig
    from deployments.engine_host import EngineHost
    from deployments.http import LocalBackend, make_api

    cfg = ServeAppConfig(
        model="scripted",
        method="ar",
        cost_model="none",
        max_num_seqs=64,
        served_model_name="scripted",
        retrieval={"enabled": False},
        scripted_tokens_per_step=ns.tokens_per_step,
    )
    host = EngineHost.build(cfg)
    app = make_api(LocalBackend(host), cfg)
    datasets = default_datasets("single")  # the load test's dev-set items (tools offered)
    items = [it for path in datasets for it in load_items(path)]
    opts = {"model": "scripted", "max_tokens": 128, "stream": True}

    async def run(count: int) -> None:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=600)
        gate = asyncio.Semaphore(ns.concurrency)

        async def one(i: int) -> None:
            async with gate:
                body = build_payload(items[(i * 7) % len(items)], opts)
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for _ in r.aiter_lines():
                        pass

        await asyncio.gather(*(one(i) for i in range(count)))

    asyncio.run(run(8))  # warm-up
    t0, c0 = time.perf_counter(), os.times()
    asyncio.run(run(ns.requests))
    dt, c1 = time.perf_counter() - t0, os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    tokens = ns.requests * 128
    print(
        f"{ns.requests} requests x 128 tokens at c={ns.concurrency}, k={ns.tokens_per_step}: {dt:.2f} s, "
        f"{tokens / dt:.0f} tok/s, process CPU {cpu:.2f} s = {1000 * cpu / tokens:.4f} ms/token",
        flush=True,
    )
    host.close()
    here = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
    report = {
        "what": "the replica's HTTP app in one process without Ray (scripted target): streamed tokens/s and "
        "the process's CPU per streamed token (clients included)",
        "commit": commit.stdout.strip() or None,
        "hardware": hardware_string("cpu"),
        "datasets": [os.path.relpath(d, here) for d in datasets],
        "concurrency": ns.concurrency,
        "requests": ns.requests,
        "tokens_per_request": 128,
        "tokens_per_step": ns.tokens_per_step,
        "seconds": dt,
        "tokens_per_s": tokens / dt,
        "cpu_s": cpu,
        "cpu_ms_per_token": 1000 * cpu / tokens,
    }
    out = Path(ns.out or here / "benchmarks" / "runs" / f"serving-inprocess-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[serving_inprocess] -> {out}", flush=True)


if __name__ == "__main__":
    main()
