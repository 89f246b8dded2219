"""Study: the committed load tests, several apps served side by side on loopback. Result: benchmarks/results/loadtest/*.

The committed load-test reports: several apps from one config on loopback, side by side.

Starts one local Ray cluster with one application per ``--apps`` entry, built from the same config
except the method and its options (default: ``toolspec`` at /toolspec and plain greedy at
/greedy; ``+nocache`` serves an app without prefix caching, ``+chunkN`` with ``prefill_chunk_tokens``
N), runs ``toolspec loadtest`` against all of them, the last one the baseline, then shuts
everything down. Arguments it does not know go to
``toolspec loadtest`` unchanged (e.g. ``--workload conversations``, ``--request-rate``, ``--slo``).

    python -m benchmarks.studies.loadtest_local --concurrency 1,2,4,8 --num-requests 8 --max-seconds 300

``--scripted-target`` serves the target that costs nothing (``model: scripted``, method ``ar``,
a batch of up to 64): what the HTTP, Ray and streaming path itself carries on this machine.

    python -m benchmarks.studies.loadtest_local --scripted-target --concurrency 1,8,32 --duration 30 --num-requests 4000
"""

from __future__ import annotations

import argparse
import os
import re
import sys

OPTIONS = {
    "nocache": {"prefix_caching": False},
}


def app_config(spec: str, library: str) -> tuple[str, dict]:
    """``NAME=METHOD[+OPTION...]`` -> (name, ServeAppConfig keys). A method that drafts from the
    call library gets its own under ``library`` (an embedded Qdrant store that starts empty, like a
    new deployment)."""
    name, _, rest = spec.partition("=")
    method, *options = (rest or name).split("+")
    if not name or any(o not in OPTIONS and not re.fullmatch(r"chunk[1-9][0-9]*", o) for o in options):
        raise SystemExit(f"--apps: cannot read {spec!r} (NAME=METHOD[+{'|'.join(OPTIONS)}|+chunkN])")
    extra: dict = {"method": method}
    from toolspec_core.drafters.methods import method_class

    if method_class(method).uses_library:
        extra["retrieval"] = {"store": {"backend": "edge", "path": os.path.join(library, name)}}
    else:
        extra["retrieval"] = {"enabled": False}
    for o in options:
        extra.update(OPTIONS[o] if o in OPTIONS else {"prefill_chunk_tokens": int(o[5:])})
    return name, extra


class RssSampler:
    """Resident memory of every engine replica process (``ray::ServeReplica:<app>:Replica``) every
    ``every`` seconds, in a thread, until ``stop`` writes the series and a summary. Only this
    run's replicas: descendants of this process (the local Ray it started), so another Ray
    instance on the same machine (a test suite's apps) is never sampled."""

    def __init__(self, every: float):
        import threading
        import time

        self.every, self.t0, self.samples = every, time.time(), []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            for proc in me.children(recursive=True):
                try:
                    title = " ".join(proc.cmdline())
                    if not ("ServeReplica:" in title and ":Replica" in title):
                        continue
                    rss = proc.memory_info().rss
                except psutil.Error:
                    continue
                self.samples.append({"t": round(time.time() - self.t0, 1), "pid": proc.pid, "rss_mb": rss / 2**20})
            self._stop.wait(self.every)

    def stop(self, path: str) -> None:
        import json

        self._stop.set()
        self._thread.join(timeout=30)
        rss = [s["rss_mb"] for s in self.samples]
        tail = [s["rss_mb"] for s in self.samples if s["t"] >= self.samples[-1]["t"] * 0.2] if self.samples else []
        summary = {
            "samples": len(rss),
            "every_s": self.every,
            "first_mb": rss[0] if rss else None,
            "max_mb": max(rss) if rss else None,
            "last_mb": rss[-1] if rss else None,
            # after the first fifth (warm-up: caches, the KV pool, compiled kernels)
            "after_warmup_min_mb": min(tail) if tail else None,
            "after_warmup_max_mb": max(tail) if tail else None,
        }
        with open(path, "w") as f:
            json.dump({"summary": summary, "series": self.samples}, f, indent=1)
        print(f"[rss] {json.dumps(summary)} -> {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.loadtest_local", description=__doc__)
    p.add_argument("--dataset", action="append", default=[], help="default: toolspec loadtest's for the workload")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--num-requests", "--requests-per-level", dest="num_requests", default="8")
    p.add_argument("--max-seconds", default="300")
    p.add_argument("--max-tokens", default="128")
    p.add_argument("--warmup", default="2")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "loadtest"))
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=JSON", help="extra ServeAppConfig keys for every app"
    )
    p.add_argument(
        "--scripted-target",
        action="store_true",
        help="serve the target that costs nothing (model: scripted; default apps scripted=ar): the serving "
        "stack's own ceiling",
    )
    p.add_argument("--no-stream", action="store_true", help="whole responses (default: streamed)")
    p.add_argument(
        "--sample-rss",
        type=float,
        default=None,
        metavar="SECONDS",
        help="sample the engine replicas' resident memory this often; the series goes to <out>/<name>.rss.json",
    )
    p.add_argument(
        "--apps",
        default=None,
        help="endpoints as NAME=METHOD[+OPTION...] (default toolspec=toolspec,greedy=ar), the last one the "
        "baseline; options: nocache (no prefix caching), chunkN (prefill N prompt rows a step), e.g. "
        "toolspec-c128=toolspec+chunk128,suffix=suffix,ar=ar",
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
    from benchmarks.loadtest import main as loadtest_main
    from deployments.config import ServeAppConfig

    # every request of a level up to 16 reaches the replica (waiting for the batch counts as ongoing)
    # replicas ask Ray for no CPU: the local cluster has as many as the machine, and the apps take
    # turns (one endpoint is measured at a time)
    base = {"port": ns.port, "max_ongoing_requests": 16, "cost_model": "measure", "replica_num_cpus": 0}
    if ns.scripted_target:  # nothing to budget; the batch never the limit at the levels measured
        base.update(model="scripted", cost_model="none", max_ongoing_requests=64, max_num_seqs=64)
    ns.apps = ns.apps or ("scripted=ar" if ns.scripted_target else "toolspec=toolspec,greedy=ar")
    for item in ns.set:
        import json

        key, _, value = item.partition("=")
        base[key] = json.loads(value)
    import tempfile

    library = tempfile.mkdtemp(prefix="toolspec-loadtest-library-")  # starts empty: online, like a new deployment
    apps = [app_config(spec, library) for spec in ns.apps.split(",")]
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
            *([] if ns.no_stream else ["--stream"]),
            "--fresh-requests",
            "--out",
            ns.out,
            "--baseline",
            apps[-1][0],
        ]
        for name, url in urls.items():
            args += ["--endpoint", f"{name}={url}/v1"]
        args += passthrough
        sampler = RssSampler(ns.sample_rss) if ns.sample_rss else None
        try:
            return loadtest_main(args)
        finally:
            if sampler is not None:
                name = passthrough[passthrough.index("--name") + 1] if "--name" in passthrough else "loadtest"
                sampler.stop(os.path.join(ns.out, f"{name}.rss.json"))
    finally:
        stop_server()


if __name__ == "__main__":
    sys.exit(main())
