"""The committed load-test report: ToolSpec vs plain greedy served by the same app, on loopback.

Starts one local Ray cluster with two applications built from the same config except the method
(``toolspec`` at /toolspec, ``ar`` = plain greedy at /greedy), runs ``toolspec loadtest`` against
both side by side, then shuts everything down. Arguments it does not know go to
``toolspec loadtest`` unchanged (e.g. ``--workload conversations``, ``--request-rate``, ``--slo``).

    python -m benchmarks.loadtest_local --concurrency 1,2,4,8 --num-requests 8 --max-seconds 300
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadtest_local", description=__doc__)
    p.add_argument("--dataset", action="append", default=[], help="default: toolspec loadtest's for the workload")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--num-requests", "--requests-per-level", dest="num_requests", default="8")
    p.add_argument("--max-seconds", default="300")
    p.add_argument("--max-tokens", default="128")
    p.add_argument("--warmup", default="2")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "loadtest"))
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=JSON", help="extra ServeAppConfig keys for both apps"
    )
    ns, passthrough = p.parse_known_args(argv)

    import ray.serve._private.api as serve_api

    from deployments.cli import start_server, stop_server

    # Ray Serve gives its HTTP proxy 60 s to start and 5 s to answer a ready check; on a busy
    # 2-core box (a benchmark running beside) it can need more.
    serve_api.HTTP_PROXY_TIMEOUT = max(serve_api.HTTP_PROXY_TIMEOUT, 600)
    for var, value in (
        ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120"),
        ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60"),
    ):
        os.environ.setdefault(var, value)
    from deployments.config import ServeAppConfig

    from .loadtest import main as loadtest_main

    base = {"port": ns.port, "max_ongoing_requests": 8, "cost_model": "measure"}
    for item in ns.set:
        import json

        key, _, value = item.partition("=")
        base[key] = json.loads(value)
    import tempfile

    library = tempfile.mkdtemp(prefix="toolspec-loadtest-library-")  # starts empty: online, like a new deployment
    apps = (
        ("toolspec", {"method": "toolspec", "retrieval": {"store": {"backend": "edge", "path": library}}}),
        ("greedy", {"method": "ar", "retrieval": {"enabled": False}}),  # plain greedy needs no library
    )
    urls = {}
    try:
        for name, extra in apps:
            method = extra["method"]
            cfg = ServeAppConfig.model_validate({**base, **extra, "route_prefix": f"/{name}"})
            urls[name] = start_server(cfg, app_name=name, quiet=True)
            print(f"{name}: {urls[name]}/v1 (method {method})", flush=True)
        args = [a for path in ns.dataset for a in ("--dataset", path)] + [
            "--concurrency",
            ns.concurrency,
            "--num-requests",
            ns.num_requests,
            "--max-seconds",
            ns.max_seconds,
            "--max-tokens",
            ns.max_tokens,
            "--warmup",
            ns.warmup,
            "--stream",
            "--fresh-requests",
            "--out",
            ns.out,
            "--baseline",
            "greedy",
        ]
        for name, url in urls.items():
            args += ["--endpoint", f"{name}={url}/v1"]
        args += passthrough
        return loadtest_main(args)
    finally:
        stop_server()


if __name__ == "__main__":
    sys.exit(main())
