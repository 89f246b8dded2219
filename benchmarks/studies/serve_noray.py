"""One ToolSpec app served without Ray: the replica's own app on uvicorn, in this process.

The engine replica's FastAPI app (``make_api(LocalBackend(EngineHost))``: the same validation,
engine thread, streaming and /health as under Ray Serve, one replica, no autoscaling, no
Retrieval deployment) on ``--port``, until SIGTERM or Ctrl-C. For a machine without Ray -- the
lent GPU machine of ``benchmarks/gpu_serve_run.sh`` -- and what ``loadtest_local --no-ray``
starts for each ToolSpec app. The replica's start-up (weights, KV pool, CUDA graphs) is logged
and on /health.

    python -m benchmarks.studies.serve_noray --config '{"model": "embedded", "method": "ar"}' --port 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.serve_noray", description=__doc__)
    p.add_argument("--config", required=True, help="ServeAppConfig keys as JSON (retrieval must be off)")
    p.add_argument("--port", type=int, default=8000)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import uvicorn

    from deployments.config import ServeAppConfig
    from deployments.engine_host import EngineHost
    from deployments.http import LocalBackend, make_api

    cfg = ServeAppConfig.model_validate(json.loads(ns.config))
    if cfg.retrieval.enabled:  # the Retrieval deployment is a Ray actor
        raise SystemExit("serve_noray: set retrieval.enabled false (the call library's deployment needs Ray)")
    host = EngineHost.build(cfg)
    print(f"[serve_noray] startup {json.dumps(host.startup)}", flush=True)
    try:
        uvicorn.run(make_api(LocalBackend(host), cfg), host="127.0.0.1", port=ns.port, log_level="warning")
    finally:
        host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
