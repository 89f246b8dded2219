"""The ``toolspec`` command: ``serve`` and ``demo`` run the Ray Serve app locally on embedded defaults;
the other subcommands live in the package that owns them and are imported when called."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time

DEMO_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]
DEMO_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
    {"role": "user", "content": "What's the weather like in Paris right now, in celsius?"},
]


def _parser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("--config", help="JSON or YAML file with ServeAppConfig keys (flags override it)")
    p.add_argument("--model", help='HF model directory, or "embedded" (default)')
    p.add_argument("--method", help="decoding method (default: toolspec)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--tensor-parallel-size", type=int, dest="tensor_parallel_size")
    p.add_argument("--cost-model", dest="cost_model", choices=["measure", "reference", "flat", "none"])
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "auto"],
        help="auto: bfloat16 where the device has it (faster; greedy output may leave plain greedy's at near-ties, float32 keeps it)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--attention", choices=["auto", "ragged", "per_sequence"], help="auto: ragged on cuda")
    p.add_argument(
        "--cuda-graphs",
        dest="cuda_graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps from CUDA graphs captured at start-up (cuda only)",
    )
    p.add_argument("--no-retrieval", action="store_true", help="serve without the call library")
    p.add_argument(
        "--address",
        help="attach to a running Ray cluster (ray://HEAD:10001, HEAD:6379 or auto; default: RAY_ADDRESS, "
        "else a fresh local instance) and deploy the app onto it, as KubeRay's head does",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="any other config key, e.g. --set max_ongoing_requests=4",
    )
    return p


FLAG_KEYS = (  # ServeAppConfig keys with a flag of their own
    *("model", "method", "host", "port", "tensor_parallel_size", "cost_model"),
    *("dtype", "device", "attention", "cuda_graphs"),
)


def config_from_args(ns: argparse.Namespace):
    """ServeAppConfig from --config, then flags (validated once, here)."""
    from .config import ServeAppConfig

    args: dict = {}
    if ns.config:
        with open(ns.config) as f:
            text = f.read()
        if ns.config.endswith((".yaml", ".yml")):
            import yaml

            args = yaml.safe_load(text) or {}
        else:
            args = json.loads(text)
    for key in FLAG_KEYS:
        if getattr(ns, key, None) is not None:
            args[key] = getattr(ns, key)
    if ns.no_retrieval:
        args.setdefault("retrieval", {})["enabled"] = False
    for item in ns.set:
        key, _, value = item.partition("=")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    return ServeAppConfig.model_validate(args)


def checked_config(ns: argparse.Namespace, prog: str):
    """:func:`config_from_args`, or None after printing why the config is refused (one line a
    problem, no traceback)."""
    from pydantic import ValidationError

    try:
        return config_from_args(ns)
    except ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "config"
            print(f"{prog}: invalid config ({where}): {err['msg']}", file=sys.stderr)
        return None


def start_server(cfg, app_name: str = "toolspec", quiet: bool = False, address: str | None = None) -> str:
    """Start Ray (a fresh local instance unless ``address`` or RAY_ADDRESS names a cluster) and the
    app; returns its URL. Serve's HTTP proxy runs on the head node only: on a cluster whose nodes
    share one machine (deployments/topology.py's local cluster) a proxy per node would contend for
    one port, and a RayService places its own proxies (serveConfigV2 ``proxy_location``). Serve
    already running on an attached cluster keeps its proxy where it is."""
    start_ray(quiet, address)
    from ray import serve

    from .app import build_app

    if quiet:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(proxy_location="HeadOnly", http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg), name=app_name, route_prefix=cfg.route_prefix, blocking=False)
    return f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}"


# Ray Serve settings of a local instance (its processes inherit this process's environment; a
# cluster sets them on its pods, k8s/base/rayservice.yaml): what Serve's own throughput-optimized
# mode sets, short of direct ingress and gRPC. A request's handler runs on the replica's main event
# loop, and the proxy's router on the proxy's -- no hand-over between threads on the way in or for
# each streamed message -- and the per-request access log is written in batches (errors at once).
SERVE_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}


def ray_address(address: str | None = None) -> str:
    """The cluster to attach to: ``address``, else RAY_ADDRESS, else "local" (a fresh instance)."""
    return address or os.environ.get("RAY_ADDRESS") or "local"


def start_ray(quiet: bool = False, address: str | None = None) -> None:
    """Connect to Ray: a fresh local instance unless ``address`` or RAY_ADDRESS names a cluster
    (no-op when connected). A local instance's processes get :data:`SERVE_ENV` where the
    environment does not say otherwise; a cluster's nodes have their own (k8s/base/rayservice.yaml)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if not ray.is_initialized():
        address = ray_address(address)
        kwargs = {"include_dashboard": False, "log_to_driver": not quiet}
        if address == "local":
            kwargs["num_cpus"] = max(2, os.cpu_count() or 2)
            for key, value in SERVE_ENV.items():
                os.environ.setdefault(key, value)
        ray.init(address=address, **kwargs)


def detach_server(app_name: str = "toolspec") -> None:
    """Delete the app from the attached cluster and disconnect; the cluster and Serve stay up."""
    import ray
    from ray import serve

    try:
        serve.delete(app_name)
    finally:
        ray.shutdown()


def stop_server(graceful: bool = True, wait_s: float = 10.0) -> None:
    """Stop the app and the local Ray instance (``graceful=False``: just end Ray, quietly). Every
    process this one started (Ray's GCS and raylet, and the raylet's workers, ``DashboardAgent``
    and ``RuntimeEnvAgent``, which outlive it for a while) is gone when this returns: given
    ``wait_s`` to end after Ray's shutdown, then killed."""
    import psutil
    import ray
    from ray import serve

    started = psutil.Process().children(recursive=True)
    try:
        if graceful:
            serve.shutdown()
    finally:
        ray.shutdown()
        end_processes(started, wait_s)


def end_processes(procs, wait_s: float) -> None:
    """Wait up to ``wait_s`` for ``procs`` to end, then SIGTERM the rest, then SIGKILL."""
    import psutil

    alive = [p for p in procs if p.is_running()]
    for sig in (None, "terminate", "kill"):
        for p in alive if sig else ():
            try:
                getattr(p, sig)()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=wait_s if sig is None else 3.0)
        if not alive:
            return


def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, Kubernetes, systemd) stops the server as Ctrl-C does: the app and every
    Ray process it started end with it. (Before it is set, ray.init's handler exits the process
    through ``SystemExit``, which stops the server on the way out as well.)"""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def serve_main(argv: list[str] | None = None) -> int:
    """Start the OpenAI-compatible server and block until Ctrl-C (on a cluster given by --address
    or RAY_ADDRESS: deploy the app onto it, and on Ctrl-C take the app off it)."""
    ns = _parser("toolspec serve", serve_main.__doc__).parse_args(argv)
    cfg = checked_config(ns, "toolspec serve")
    if cfg is None:
        return 2
    attached = ray_address(ns.address) != "local"
    t0 = time.time()
    try:
        start_ray(address=ns.address)
        _stop_on_sigterm()  # after ray.init, whose handlers would end this process without stopping Ray
        url = start_server(cfg, address=ns.address)
        print(
            f"ToolSpec is serving {cfg.model} (method {cfg.method}) at {url}/v1 after {time.time() - t0:.0f} s; Ctrl-C stops it.",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if attached:  # the cluster is not this process's: take the app off it, leave the rest
            detach_server()
        else:
            stop_server()
    return 0


def demo_main(argv: list[str] | None = None) -> int:
    """Start the server, make one real tool call with the openai client, print it, stop."""
    ns = _parser("toolspec demo", demo_main.__doc__).parse_args(argv)
    cfg = checked_config(ns, "toolspec demo")
    if cfg is None:
        return 2
    from .config import served_name

    t0 = time.time()
    print(f"starting ToolSpec ({cfg.model}, method {cfg.method}) on Ray Serve ...", flush=True)
    url = start_server(cfg, quiet=True)
    try:
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=cfg.resolved_api_key() or "none")
        print(f"server ready at {url}/v1 after {time.time() - t0:.0f} s\n")
        request = {
            "model": served_name(cfg),
            "messages": DEMO_MESSAGES,
            "tools": DEMO_TOOLS,
            "temperature": 0,
            "max_tokens": 128,
        }
        print("request (openai.chat.completions.create):")
        print(json.dumps(request, indent=2))
        t1 = time.time()
        resp = client.chat.completions.create(**request)
        choice = resp.choices[0]
        print(f"\nresponse after {time.time() - t1:.1f} s: finish_reason={choice.finish_reason!r}")
        if choice.message.tool_calls:
            for call in choice.message.tool_calls:
                args = json.loads(call.function.arguments)
                print(f"tool call: {call.function.name}({json.dumps(args)})  id={call.id}")
        else:
            print(f"no tool call; content: {choice.message.content!r}")
        stats = (resp.model_extra or {}).get("toolspec", {})
        print(
            f"toolspec stats: MAT {stats.get('mat', 0):.2f}, drafted {stats.get('drafted_tokens')}, accepted {stats.get('accepted_tokens')}, forwards {stats.get('forwards')}"
        )
        return 0 if choice.message.tool_calls else 1
    finally:
        stop_server(graceful=False)


# subcommand -> (module, function, help); function(argv) -> exit code
COMMANDS = {
    "serve": ("deployments.cli", "serve_main", "start the OpenAI-compatible server (Ray Serve) on embedded defaults"),
    "demo": ("deployments.cli", "demo_main", "start the server, make one real tool call against it, stop"),
    "bench": ("benchmarks.cli", "bench_main", "run the side-by-side benchmark and write a report"),
    "bench-cost": ("benchmarks.cost", "main", "measure the verify-cost curve of a model shape"),
    "loadtest": ("benchmarks.loadtest", "main", "load-test OpenAI-compatible endpoints"),
    "generate": ("benchmarks.generate", "main", "decode one prompt with a method and plain greedy, side by side"),
    "plan": ("deployments.plan", "main", "capacity plan: weights per GPU, KV pool, requests at full context"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: toolspec {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, _, doc) in COMMANDS.items():
            print(f"  {name:12s} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func, _ = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
