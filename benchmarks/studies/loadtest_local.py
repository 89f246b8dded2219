"""Study: the committed load tests, several apps served side by side on loopback. Result: benchmarks/results/loadtest/*.

The committed load-test reports: several apps from one config on loopback, side by side.

Starts one local Ray cluster with one application per ``--apps`` entry, built from the same config
except the method and its options (default: ``toolspec`` at /toolspec and plain greedy at
/greedy; ``+nocache`` serves an app without prefix caching, ``+lexical`` keys the library search
on hashed n-grams (no encoder on the cores), ``+hidden`` on the prompt's last hidden state (no
encoder either; the search starts after the prefill; what the default ``auto`` key is on a CPU
target), ``+qwen`` with the Retrieval deployment's Qwen encoder over the request text, ``+noretrieval`` has no Retrieval deployment, ``+threadsN`` with ``threads`` N, ``+chunkN`` with ``prefill_chunk_tokens``
N), runs ``toolspec loadtest`` against all of them, the last one the baseline, then shuts
everything down. Arguments it does not know go to
``toolspec loadtest`` unchanged (e.g. ``--workload conversations``, ``--request-rate``, ``--slo``).

    python -m benchmarks.studies.loadtest_local --concurrency 1,2,4,8 --num-requests 8 --max-seconds 300

``--scripted-target`` serves the target that costs nothing (``model: scripted``, method ``ar``,
a batch of up to 64): what the HTTP, Ray and streaming path itself carries on this machine.

    python -m benchmarks.studies.loadtest_local --scripted-target --concurrency 1,8,32 --duration 30 --num-requests 4000

``--unique-prefix`` (passed to ``toolspec loadtest``) starts every request's prompt with a nonce
line of its own, the same on every app (one run name salts them, so every pass of a
``--one-at-a-time`` run sends the same prompts): no prefix cache helps any server, and each
report row says the prefix-cached share its server saw. ``NAME=METHOD+graphs`` serves with CUDA
graphs (``cuda_graphs: true``); ``--no-ray`` serves each ToolSpec app without Ray
(:mod:`benchmarks.studies.serve_noray`, one at a time; ``benchmarks/gpu_serve_run.sh``).

vLLM side by side: an app ``vllm`` (``NAME=vllm[+suffix][+allcores]``) is vLLM's CPU build serving
the same model directory in the apps' dtype (float32 by default) from the venv ``benchmarks/studies/vllm_setup.sh`` makes
(``$TOOLSPEC_VLLM_VENV``, default ~/.cache/toolspec/vllm-venv); ``+suffix`` adds suffix decoding
(ArcticInference), ``+allcores`` gives its model threads every core (its default keeps one for its
API server). With any vLLM app, or with ``--one-at-a-time``, every app is started fresh, driven
alone on the same requests and stopped before the next one starts; a last pass merges the levels
into one report. Outputs are compared on token counts and on text with fenced calls read as calls
(``<name>.outputs.json``): vLLM's hermes parser leaves the 0.5B model's fenced JSON calls in
``content`` where ToolSpec returns them as tool calls. Without the venv, vLLM apps are skipped
with a note.

    python -m benchmarks.studies.loadtest_local --apps toolspec=toolspec,vllm=vllm,vllm-2c=vllm+allcores,\\
        vllm-suffix-2c=vllm+suffix+allcores,ar=ar --prompt-chars 2000:8000 --concurrency 1,8 --num-requests 16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

OPTIONS = {
    "nocache": {"prefix_caching": False},
    # decode steps replayed from CUDA graphs captured at the replica's start (a replica without a
    # GPU, device auto, runs them eager and says so)
    "graphs": {"cuda_graphs": True},
}
# the call library's search: keyed on hashed n-grams or the prompt's last hidden state (neither runs
# an encoder on the cores), on the Qwen encoder's vector of the request text, or none at all
RETRIEVAL_OPTIONS = {
    "lexical": {"key": "lexical"},
    "hidden": {"key": "hidden"},
    "qwen": {"key": "qwen"},
    "noretrieval": {"enabled": False},
}


VLLM_OPTIONS = ("suffix", "allcores")
VLLM_SPEC_TOKENS = 24  # suffix decoding's num_speculative_tokens (ArcticInference's usual setting)


def is_vllm(spec: str) -> bool:
    name, _, rest = spec.partition("=")
    return (rest or name).split("+")[0] == "vllm"


def vllm_app(spec: str) -> tuple[str, dict]:
    """``NAME=vllm[+suffix][+allcores]`` -> (name, {"suffix": bool, "allcores": bool})."""
    name, _, rest = spec.partition("=")
    _, *options = (rest or name).split("+")
    if not name or any(o not in VLLM_OPTIONS for o in options):
        raise SystemExit(f"--apps: cannot read {spec!r} (NAME=vllm[+suffix][+allcores])")
    return name, {o: o in options for o in VLLM_OPTIONS}


def vllm_venv() -> str:
    return os.environ.get("TOOLSPEC_VLLM_VENV") or os.path.expanduser("~/.cache/toolspec/vllm-venv")


def vllm_missing(venv: str, suffix: bool = False) -> str | None:
    """Why vLLM (and ArcticInference for suffix decoding) cannot run from ``venv``; None: it can.
    Reads the venv's files only, so the check costs nothing where vLLM was never installed."""
    import glob

    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return f"no vLLM venv at {venv} (bash benchmarks/studies/vllm_setup.sh makes it)"
    site = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))
    if not site or not os.path.isdir(os.path.join(site[0], "vllm")):
        return f"vLLM is not installed in {venv} (bash benchmarks/studies/vllm_setup.sh)"
    if not glob.glob(os.path.join(site[0], "vllm-*cpu.dist-info")):
        return f"{venv} lacks the vllm-<version>+cpu.dist-info vLLM finds its CPU platform by (vllm_setup.sh)"
    if suffix and not os.path.isdir(os.path.join(site[0], "arctic_inference")):
        return f"ArcticInference (suffix decoding) is not installed in {venv} (vllm_setup.sh)"
    return None


def vllm_command(
    venv: str,
    model_dir: str,
    port: int,
    served_name: str,
    suffix: bool,
    max_model_len: int = 8192,
    dtype: str = "float32",
) -> list[str]:
    """The vLLM server's command line: the model directory in ``dtype`` (the ToolSpec apps'),
    hermes tool parsing (what Qwen2.5's template asks for), each response's cached prompt tokens
    (``usage.prompt_tokens_details``, for the report's prefix-cached share), suffix decoding when
    asked."""
    import json

    cmd = [os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", model_dir, "--served-model-name", served_name, "--dtype", dtype]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len)]
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prompt-tokens-details"]
    if suffix:
        spec = {"method": "suffix", "num_speculative_tokens": VLLM_SPEC_TOKENS}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def vllm_env(venv: str, allcores: bool, kv_gib: int = 4, base: dict | None = None) -> dict:
    """vLLM's environment: offline, its KV cache size (GiB), Intel OpenMP preloaded (its CPU
    build expects it), and the thread placement -- its default (``auto``: the model's threads on
    all cores but one, that one left to the API server) or every core for the model."""
    import glob

    env = dict(os.environ if base is None else base)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
    env.pop("PYTHONPATH", None)  # the project's tree is not vLLM's
    iomp = glob.glob(os.path.join(venv, "lib", "libiomp5.so"))
    if iomp:
        env["LD_PRELOAD"] = iomp[0]
    if allcores:
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
        env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    return env


class ServerProcess:
    """One server process in its own session (stopping it ends its children too), ready when
    ``ready_path`` answers 200; its output goes to ``log_path``."""

    what = "the server"
    ready_path = "/v1/models"

    def __init__(self, cmd: list[str], env: dict, port: int, log_path: str):
        import subprocess

        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 900.0) -> None:
        import time
        import urllib.request

        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"{self.what} exited with {self.proc.returncode} before it was ready (log: {self.log.name})"
                )
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise SystemExit(f"{self.what} not ready after {timeout:.0f} s (log: {self.log.name})")

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class VllmServer(ServerProcess):
    """One vLLM server process (stopping it ends its engine core too)."""

    what = "vLLM"

    def __init__(
        self, venv: str, model_dir: str, port: int, served_name: str, opts: dict, log_path: str, dtype="float32"
    ):
        cmd = vllm_command(venv, model_dir, port, served_name, opts["suffix"], dtype=dtype)
        super().__init__(cmd, vllm_env(venv, opts["allcores"]), port, log_path)


class NorayServer(ServerProcess):
    """One ToolSpec app without Ray (:mod:`benchmarks.studies.serve_noray`): ``config``'s keys, the
    call library's deployment off; ready when its /health answers."""

    what = "ToolSpec (no Ray)"
    ready_path = "/health"

    def __init__(self, config: dict, port: int, log_path: str):
        import json
        import sys

        config = {k: v for k, v in config.items() if k not in ("port", "route_prefix")}
        config["retrieval"] = {"enabled": False}
        cmd = [sys.executable, "-m", "benchmarks.studies.serve_noray", "--config", json.dumps(config)]
        super().__init__(cmd + ["--port", str(port)], dict(os.environ), port, log_path)


def is_noray_engine(title: str) -> bool:
    """A ToolSpec app served without Ray (:class:`NorayServer`): the model and its KV pool."""
    return "benchmarks.studies.serve_noray" in title


def vllm_dtype(base: dict) -> str:
    """The dtype vLLM serves in: the ToolSpec apps' (``auto`` resolved as a CPU replica resolves it)."""
    dtype = base.get("dtype", "float32")
    if dtype == "auto":
        from toolspec_core.model.target import resolve_dtype

        return str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    return dtype


def app_config(spec: str, library: str) -> tuple[str, dict]:
    """``NAME=METHOD[+OPTION...]`` -> (name, ServeAppConfig keys). A method that drafts from the
    call library gets its own under ``library`` (an embedded Qdrant store that starts empty, like a
    new deployment)."""
    name, _, rest = spec.partition("=")
    method, *options = (rest or name).split("+")
    known = (*OPTIONS, *RETRIEVAL_OPTIONS)
    if not name or any(o not in known and not re.fullmatch(r"(chunk|threads)[1-9][0-9]*", o) for o in options):
        raise SystemExit(f"--apps: cannot read {spec!r} (NAME=METHOD[+{'|'.join(known)}|+chunkN|+threadsN])")
    extra: dict = {"method": method}
    from toolspec_core.drafters.methods import method_class

    if method_class(method).uses_library:
        extra["retrieval"] = {"store": {"backend": "edge", "path": os.path.join(library, name)}}
    else:
        extra["retrieval"] = {"enabled": False}
    for o in options:
        if o in OPTIONS:
            extra.update(OPTIONS[o])
        elif o in RETRIEVAL_OPTIONS:
            extra["retrieval"] = (
                {"enabled": False} if o == "noretrieval" else {**extra["retrieval"], **RETRIEVAL_OPTIONS[o]}
            )
        elif o.startswith("threads"):
            extra["threads"] = int(o[7:])  # the replica model's torch threads
        else:
            extra["prefill_chunk_tokens"] = int(o[5:])
    return name, extra


def is_engine_replica(title: str) -> bool:
    """A ToolSpec engine replica's process (``ray::ServeReplica:<app>:Replica``): the model and its KV pool."""
    return "ServeReplica:" in title and ":Replica" in title


def is_vllm_engine(title: str) -> bool:
    """vLLM's engine processes (``VLLM::EngineCore`` and its ``VLLM::Worker``, which holds the model and
    the KV cache on the CPU): together what one replica holds for us."""
    return "VLLM::EngineCore" in title or "VLLM::Worker" in title


class RssSampler:
    """Resident memory of every engine process (``match`` on its title: by default ToolSpec's
    engine replicas) every ``every`` seconds, in a thread, until ``stop`` writes the series and a
    summary; a sample is the sum over the matching processes (vLLM's engine is two). Only this run's processes: descendants of this process (the local Ray or the vLLM
    server it started), so another Ray instance on the same machine (a test suite's apps) is
    never sampled."""

    def __init__(self, every: float, match=is_engine_replica):
        import threading
        import time

        self.every, self.match, self.t0, self.samples = every, match, time.time(), []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            pids, rss = [], 0
            for proc in me.children(recursive=True):
                try:
                    if self.match(" ".join(proc.cmdline())):
                        rss += proc.memory_info().rss
                        pids.append(proc.pid)
                except psutil.Error:
                    continue
            if pids:
                self.samples.append({"t": round(time.time() - self.t0, 1), "pids": pids, "rss_mb": rss / 2**20})
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


@contextlib.contextmanager
def sampling_rss(every: float | None, path: str, match=is_engine_replica):
    """An :class:`RssSampler` of the processes ``match`` picks while the block runs, its series
    written to ``path`` after (nothing when ``every`` is None)."""
    sampler = RssSampler(every, match) if every else None
    try:
        yield
    finally:
        if sampler is not None:
            sampler.stop(path)


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
        help="sample the engine replicas' resident memory this often; the series goes to <out>/<name>.rss.json "
        "(with --one-at-a-time or a vLLM app: each app's engine process, ToolSpec's replica or vLLM's EngineCore, "
        "to <out>/<name>.<app>.rss.json)",
    )
    p.add_argument(
        "--apps",
        default=None,
        help="endpoints as NAME=METHOD[+OPTION...] (default toolspec=toolspec,greedy=ar), the last one the "
        "baseline; options: nocache (no prefix caching), chunkN (prefill N prompt rows a step), e.g. "
        "toolspec-c128=toolspec+chunk128,suffix=suffix,ar=ar; vLLM: NAME=vllm[+suffix][+allcores]",
    )
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="start each app fresh, drive it alone, stop it before the next (always so with a vLLM app)",
    )
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument(
        "--no-ray",
        action="store_true",
        help="serve each ToolSpec app without Ray (benchmarks.studies.serve_noray: the replica's own app, one "
        "replica, no call-library deployment), one at a time: for a machine without Ray",
    )
    ns, passthrough = p.parse_known_args(argv)
    specs = (ns.apps or "").split(",") if ns.apps else []
    if ns.one_at_a_time or ns.no_ray or any(is_vllm(spec) for spec in specs):
        return one_at_a_time(ns, specs, passthrough)

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

    base = base_config(ns)
    ns.apps = ns.apps or ("scripted=ar" if ns.scripted_target else "toolspec=toolspec,greedy=ar")
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
        args = loadtest_args(ns) + ["--baseline", apps[-1][0]]
        for name, url in urls.items():
            args += ["--endpoint", f"{name}={url}/v1"]
        args += passthrough
        name = passthrough[passthrough.index("--name") + 1] if "--name" in passthrough else "loadtest"
        with sampling_rss(ns.sample_rss, os.path.join(ns.out, f"{name}.rss.json")):
            rc = loadtest_main(args)
        for app, url in urls.items():
            save_health(url, os.path.join(ns.out, f"{name}.{app}.health.json"))
        return rc
    finally:
        stop_server()


def save_health(url: str, path: str) -> bool:
    """A ToolSpec app's /health after its levels (``url`` the app's base), to ``path``: its start-up,
    engine and the draft budget's cost curve -- a replica probes that curve at start-up and it
    decides how much each step drafts, so two runs' MAT compare only beside their curves. False
    (and nothing written) where the app does not answer with JSON."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=30) as resp:
            health = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        print(f"[loadtest_local] no /health from {url}: {exc}", flush=True)
        return False
    with open(path, "w") as f:
        json.dump(health, f, indent=1)
    return True


def base_config(ns) -> dict:
    """ServeAppConfig keys every ToolSpec app shares."""
    # every request of a level up to 16 reaches the replica (waiting for the batch counts as ongoing)
    # replicas ask Ray for no CPU: the local cluster has as many as the machine, and the apps take
    # turns (one endpoint is measured at a time)
    base = {"port": ns.port, "max_ongoing_requests": 16, "cost_model": "measure", "replica_num_cpus": 0}
    if ns.scripted_target:  # nothing to budget; the batch never the limit at the levels measured
        base.update(model="scripted", cost_model="none", max_ongoing_requests=64, max_num_seqs=64)
    for item in ns.set:
        import json

        key, _, value = item.partition("=")
        base[key] = json.loads(value)
    return base


def loadtest_args(ns, out: str | None = None) -> list[str]:
    """``toolspec loadtest``'s arguments every endpoint shares (no endpoints, no baseline)."""
    return [a for path in ns.dataset for a in ("--dataset", path)] + [
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
        out or ns.out,
    ]


def one_at_a_time(ns, specs: list[str], passthrough: list[str]) -> int:
    """Each app started fresh, driven alone on the same requests (``toolspec loadtest --resume``
    keeps each one's levels under one run name), stopped; then one pass that sends nothing merges
    them into ``<out>/<name>.json/.md/.png`` and the outputs are compared (:func:`compare_outputs`,
    ``<name>.outputs.json``). Scratch (one-app reports, vLLM's logs): ``<out>/<name>.apps/``."""
    import datetime as dt
    import json
    import tempfile

    from benchmarks.loadtest import main as loadtest_main
    from deployments.config import ServeAppConfig, served_name

    specs = specs or ["toolspec=toolspec", "greedy=ar"]
    kept = []
    for spec in specs:
        why = vllm_missing(vllm_venv(), vllm_app(spec)[1]["suffix"]) if is_vllm(spec) else None
        if why:
            print(f"[loadtest_local] skipping {spec}: {why}", flush=True)
        else:
            kept.append(spec)
    if not kept:
        print("[loadtest_local] nothing to run", flush=True)
        return 0
    if "--name" in passthrough:
        name = passthrough[passthrough.index("--name") + 1]
    else:
        name = "loadtest-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        passthrough = passthrough + ["--name", name]
    if "--resume" not in passthrough:
        passthrough = passthrough + ["--resume"]
    base = base_config(ns)
    library = tempfile.mkdtemp(prefix="toolspec-loadtest-library-")
    model_dir = None
    served = served_name(ServeAppConfig.model_validate(base))
    # each app's own pass keeps its levels in <scratch>/<name>.partial.jsonl (an interrupted run
    # resumes there) and writes its one-endpoint report there; the merged report goes to --out
    scratch = os.path.join(ns.out, f"{name}.apps")
    os.makedirs(scratch, exist_ok=True)
    common = loadtest_args(ns, scratch) + passthrough
    from benchmarks.datasets import JsonlStore

    rates = passthrough[passthrough.index("--request-rate") + 1] if "--request-rate" in passthrough else None
    n_levels = len([x for x in (rates or ns.concurrency).split(",") if x.strip()])
    urls = {}
    for spec in kept:
        app = (vllm_app(spec) if is_vllm(spec) else app_config(spec, library))[0]
        done = JsonlStore(os.path.join(scratch, f"{name}.partial.jsonl"), lambda r: (r["endpoint"], r["level_no"]))
        if all((app, k) in done.records for k in range(n_levels)):  # an earlier invocation ran it: not started
            urls[app] = f"http://127.0.0.1:{ns.vllm_port}" if is_vllm(spec) else f"http://127.0.0.1:{ns.port}"
            urls[app] += "" if is_vllm(spec) or ns.no_ray else f"/{app}"
            print(f"{app}: every level done in an earlier pass ({scratch})", flush=True)
            continue
        if is_vllm(spec) or ns.no_ray:  # a server process of its own: vLLM, or a ToolSpec app without Ray
            if is_vllm(spec):
                app, opts = vllm_app(spec)
                if model_dir is None:
                    model_dir = vllm_model_dir(base)
                log = os.path.join(scratch, f"{app}.vllm.log")
                server = VllmServer(vllm_venv(), model_dir, ns.vllm_port, served, opts, log, vllm_dtype(base))
                what, engine = f"vLLM {opts}", is_vllm_engine
            else:
                app, extra = app_config(spec, library)
                server = NorayServer({**base, **extra}, ns.port, os.path.join(scratch, f"{app}.serve.log"))
                what, engine = f"method {extra['method']}, no Ray", is_noray_engine
            try:
                server.wait_ready()
                urls[app] = server.url
                print(f"{app}: {server.url}/v1 ({what})", flush=True)
                with sampling_rss(ns.sample_rss, os.path.join(ns.out, f"{name}.{app}.rss.json"), engine):
                    rc = loadtest_main(common + ["--endpoint", f"{app}={server.url}/v1", "--baseline", app])
                if not is_vllm(spec):
                    save_health(server.url, os.path.join(ns.out, f"{name}.{app}.health.json"))
            finally:
                server.stop()
        else:
            from deployments.cli import start_server, stop_server

            app, extra = app_config(spec, library)
            cfg = ServeAppConfig.model_validate({**base, **extra, "route_prefix": f"/{app}"})
            try:
                urls[app] = start_server(cfg, app_name=app, quiet=True)
                print(f"{app}: {urls[app]}/v1 (method {extra['method']})", flush=True)
                with sampling_rss(ns.sample_rss, os.path.join(ns.out, f"{name}.{app}.rss.json")):
                    rc = loadtest_main(common + ["--endpoint", f"{app}={urls[app]}/v1", "--baseline", app])
                save_health(urls[app], os.path.join(ns.out, f"{name}.{app}.health.json"))
            finally:
                stop_server()
        if rc:
            return rc
    import shutil

    partial = os.path.join(ns.out, f"{name}.partial.jsonl")
    shutil.copyfile(os.path.join(scratch, f"{name}.partial.jsonl"), partial)
    endpoints = [a for app, url in urls.items() for a in ("--endpoint", f"{app}={url}/v1")]
    model = [] if "--model" in passthrough else ["--model", served]
    rc = loadtest_main(loadtest_args(ns) + passthrough + endpoints + model + ["--baseline", list(urls)[-1]])
    if rc:
        return rc
    summary = compare_outputs(partial, list(urls))
    os.remove(partial)  # the merged report holds it (with --save-records, every request)
    path = os.path.join(ns.out, f"{name}.outputs.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    for row in summary["levels"]:
        print(f"[outputs] {json.dumps(row)}", flush=True)
    print(f"[loadtest_local] output comparison -> {path}", flush=True)
    return 0


def vllm_model_dir(base: dict) -> str:
    """The HF directory vLLM serves: the ToolSpec apps' model, the embedded one's float32 directory
    by default."""
    model = base.get("model", "embedded")
    if model in ("", "embedded"):
        from toolspec_core.model.embedded import embedded_model_dir

        return str(embedded_model_dir())
    return model


def compare_outputs(partial_path: str, endpoints: list[str]) -> dict:
    """Per level, each endpoint against the first: requests both answered, how many with the same
    number of output tokens, the same text (calls read as calls wherever the server put them,
    :func:`benchmarks.loadtest.client.text_digest`) and the same response (calls where the server
    returned them); and each endpoint's output tokens in all."""
    from benchmarks.datasets import JsonlStore

    runs = JsonlStore(partial_path, lambda r: (r["endpoint"], r["level_no"])).records  # the runs that finished
    ref, levels = endpoints[0], []
    for level_no in sorted({k for _, k in runs}):
        theirs = {r["index"]: r for r in runs.get((ref, level_no), {}).get("records", []) if r["ok"]}
        for ep in endpoints:
            run = runs.get((ep, level_no))
            if run is None:
                continue
            mine = {r["index"]: r for r in run["records"] if r["ok"]}
            both = sorted(set(mine) & set(theirs))
            levels.append(
                {
                    "endpoint": ep,
                    "reference": ref,
                    "concurrency": run["summary"]["concurrency"],
                    "requests": len(mine),
                    "output_tokens": sum(r["completion_tokens"] or 0 for r in mine.values()),
                    "tool_calls": sum(1 for r in mine.values() if r["tool_calls"]),
                    "compared": len(both),
                    "same_token_count": sum(
                        mine[i]["completion_tokens"] == theirs[i]["completion_tokens"] for i in both
                    ),
                    "same_text": sum(
                        mine[i].get("text_digest") is not None
                        and mine[i].get("text_digest") == theirs[i].get("text_digest")
                        for i in both
                    ),
                    "same_response": sum(mine[i]["digest"] == theirs[i]["digest"] for i in both),
                }
            )
    return {"reference": ref, "levels": levels}


if __name__ == "__main__":
    sys.exit(main())
