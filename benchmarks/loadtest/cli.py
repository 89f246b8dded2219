"""``toolspec loadtest``: the command line and the run over levels and endpoints."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import socket
import sys
import time
from pathlib import Path

from ..datasets import JsonlStore
from . import __doc__ as PACKAGE_DOC
from .client import chat_url, parse_endpoint
from .metrics import compare, parse_slo, summarize
from .report import fmt, level_label, write_reports
from .schedule import arrival_offsets, run_level_local
from .workloads import default_datasets, level_sessions, load_workload, unique_prefix_sessions

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "loadtest"  # not method runs: their own folder
REQUEST_OPTIONS = (
    "max_tokens",
    "stream",
    "api_key",
    "tool_choice",
    "timeout",
    "stream_usage",
    "timeline",
)  # of every request
DURATION_REQUEST_CAP = 100_000  # requests prepared per level when only --duration bounds it


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive integers: {text!r}")
    return levels


def parse_span(text: str) -> tuple[int, int | None]:
    low, _, high = text.partition(":")
    try:
        span = (int(low), int(high) if high else None)
    except ValueError:
        span = (-1, None)
    if span[0] < 0 or (span[1] is not None and span[1] < span[0]):
        raise argparse.ArgumentTypeError(f"expected MIN or MIN:MAX characters, MIN <= MAX: {text!r}")
    return span


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"request rates must be positive (inf allowed): {text!r}")
    return rates


OPTIONS = (  # group titles, each followed by its (flags, add_argument keywords), in --help order
    "workload",
    ("--workload", dict(choices=["single", "conversations"], default="single")),
    ("--dataset", dict(action="append", help="JSONL or .jsonl.gz (benchmarks/datasets format); repeat to mix")),
    ("--limit", dict(type=int, help="use only the first N items (conversations) of each dataset")),
    ("--seed", dict(type=int, default=0, help="chooses and orders the requests (same for every endpoint)")),
    ("--max-tokens", dict(type=int, default=128)),
    ("--tool-choice", dict(choices=["auto", "none", "required"], help="default: not sent")),
    ("--fresh-requests", dict(action="store_true", help="each level (and the warm-up) uses new requests")),
    ("--prompt-chars", dict(type=parse_span, metavar="MIN[:MAX]", help="only prompts of MIN..MAX JSON characters")),
    ("--warm-prompts", dict(action="store_true", help="send each level's requests once first (warm prefix cache)")),
    (
        "--unique-prefix",
        dict(
            action="store_true",
            help="start every request's first message with a nonce line of its own (the same on every endpoint): "
            "no two prompts share a prefix, so no prefix cache helps",
        ),
    ),
    (
        "--prefix-salt",
        dict(
            metavar="NAME",
            help="with --unique-prefix: salt the nonces with this run name instead of --name, so this run "
            "sends exactly the prompts of that earlier run (compare with its endpoints' rows)",
        ),
    ),
    "endpoints",
    (
        "--endpoint",
        dict(action="append", type=parse_endpoint, required=True, metavar="NAME=URL", help="OpenAI base URL …/v1"),
    ),
    ("--baseline", dict(help="endpoint the others are compared with (default: the last)")),
    ("--model", dict(help="model name sent in requests (default: first id of GET /v1/models)")),
    ("--stream", dict(action="store_true", help="stream (SSE): needed for TTFT, TPOT and ITL")),
    ("--no-stream-usage", dict(dest="stream_usage", action="store_false", help="count chunks, not usage")),
    ("--api-key", dict(default=os.environ.get("TOOLSPEC_API_KEY"), help="default: $TOOLSPEC_API_KEY")),
    ("--timeout", dict(type=float, default=600.0, help="per-request timeout, seconds")),
    "load",
    ("--concurrency", dict(type=parse_levels, default=[1, 2, 4, 8], help="closed loop levels, e.g. 1,2,4,8")),
    ("--request-rate", dict(type=parse_rates, help="open loop levels in requests/s, e.g. 1,2,inf")),
    ("--burstiness", dict(type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson)")),
    ("--max-concurrency", dict(type=int, help="open loop: at most this many requests in flight")),
    ("--num-requests --requests-per-level", dict(dest="num_requests", type=int, help="per level")),
    ("--duration", dict(type=float, help="per level: send no new request after this many seconds")),
    ("--max-seconds", dict(type=float, default=300.0, help="hard time limit per endpoint x level")),
    ("--warmup", dict(type=int, default=0, help="requests per endpoint first, not counted")),
    ("--slo", dict(type=parse_slo, help="goodput SLO, e.g. ttft:500,tpot:50,e2e:5000 (ms)")),
    "output",
    ("--out", dict(default=str(DEFAULT_OUT), help="directory for the reports")),
    ("--name", dict(help="report file name without suffix (default: loadtest-<stamp>)")),
    ("--hardware", dict(help="what the servers run on, for the report (default: this host)")),
    ("--save-records", dict(action="store_true", help="also write every request as JSONL")),
    (
        "--timeline",
        dict(
            action=argparse.BooleanOptionalAction,
            default=None,
            help="ask ToolSpec servers for each request's timeline (header X-ToolSpec-Timeline: 1), kept in the "
            "records (default: with --save-records)",
        ),
    ),
    ("--resume", dict(action="store_true", help="with --name: skip what <name>.partial.jsonl holds")),
    ("--quiet", dict(action="store_true")),
    "many nodes",
    ("--ray", dict(metavar="ADDRESS", help="clients as Ray actors: 'auto', 'ray://host:10001' or 'local'")),
    ("--clients-per-node", dict(type=int, help="client actors per alive node (default 1)")),
    ("--ray-actors", dict(type=int, help="client actors in all (overrides --clients-per-node)")),
    ("--ray-actor-cpus", dict(type=float, default=1.0)),
    ("--ray-local-cpus", dict(type=int, default=2, help="CPUs of the Ray started by --ray local")),
    (
        "--serve-app",
        dict(
            metavar="APP",
            help="with --ray on the serving cluster: sample this Serve app's replica count during each level "
            "(report: replicas over time beside throughput and latency, and a .replicas.png)",
        ),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="toolspec loadtest",
        description=PACKAGE_DOC.split("\n\n")[0],
        epilog="\n\n".join(PACKAGE_DOC.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for entry in OPTIONS:
        if isinstance(entry, str):
            group = p.add_argument_group(entry)
        else:
            group.add_argument(*entry[0].split(), **entry[1])
    return p


async def _discover_model(url: str, api_key: str | None, timeout: float) -> str | None:
    """First model id the endpoint lists; None when it cannot say."""
    import httpx

    models_url = chat_url(url).rsplit("/chat/completions", 1)[0] + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            response = await client.get(models_url, headers=headers)
            return response.json()["data"][0]["id"] if response.status_code == 200 else None
    except Exception:  # an unreachable endpoint is reported by the run itself
        return None


def resolve_endpoints(args: argparse.Namespace) -> tuple[list[dict], str]:
    """Endpoints with their chat URL and model name, and the baseline's name."""
    names = [n for n, _ in args.endpoint]
    if len(set(names)) != len(names):
        raise SystemExit("endpoint names must be unique")
    baseline = args.baseline or names[-1]
    if baseline not in names:
        raise SystemExit(f"--baseline {baseline!r} is not an endpoint")
    endpoints = []
    for name, url in args.endpoint:
        model = args.model or asyncio.run(_discover_model(url, args.api_key, 10.0)) or "default"
        endpoints.append({"name": name, "url": url, "chat_url": chat_url(url), "model": model})
    return endpoints, baseline


def level_plans(args: argparse.Namespace) -> list[dict]:
    """One plan per level (schedule.py) without its arrival offsets: closed loop by --concurrency,
    or open loop by --request-rate (offsets drawn per level once its sessions are known)."""
    base = {"max_seconds": args.max_seconds, "duration": args.duration, "offsets": None, "max_concurrency": None}
    if not args.request_rate:
        return [dict(base, concurrency=c, request_rate=None) for c in args.concurrency]
    return [
        dict(base, concurrency=None, request_rate=r, max_concurrency=args.max_concurrency) for r in args.request_rate
    ]


def run_levels(args, units, endpoints, runner, log) -> tuple[list[dict], dict]:
    """Each level, each endpoint in turn on the same requests; summaries and raw records."""
    from tqdm import tqdm

    base_opts = {k: getattr(args, k) for k in REQUEST_OPTIONS}
    n = args.num_requests
    partial = None  # finished endpoint x level summaries and records of a resumable run, one JSON line each
    if args.resume:
        partial = JsonlStore(Path(args.out) / f"{args.name}.partial.jsonl", lambda r: (r["endpoint"], r["level_no"]))
    n_levels = len(level_plans(args))
    warmup, used = level_sessions(units, args.warmup) if args.warmup else ([], 0)
    salt = getattr(args, "unique_prefix_salt", None)
    if salt is not None:
        warmup = unique_prefix_sessions(warmup, salt, "warmup")
    for ep in endpoints if warmup else []:
        if partial and all((ep["name"], k) in partial.records for k in range(n_levels)):
            continue  # every level of it resumes: nothing is sent to it
        plan = {"concurrency": 1, "offsets": None, "max_seconds": args.max_seconds, "duration": None}
        run_level_local(ep["chat_url"], warmup, plan, dict(base_opts, model=ep["model"]))
    offset = used if args.fresh_requests else 0
    levels, records = [], {}
    drawn, used = level_sessions(units, n, offset)
    for level_no, plan in enumerate(level_plans(args)):
        # --fresh-requests: no request repeats across warm-up and levels, so a server that learns
        # from history (ToolSpec's call library) cannot replay answers it saw at an earlier level
        if args.fresh_requests and level_no:
            offset += used
            drawn, used = level_sessions(units, n, offset)
        sessions = drawn
        if salt is not None:  # the same prompts on every endpoint of the level, no prefix shared with another
            sessions = unique_prefix_sessions(drawn, salt, level_no)
        if plan["request_rate"] is not None:
            plan = dict(plan, offsets=arrival_offsets(len(sessions), plan["request_rate"], args.burstiness, args.seed))
        for ep in endpoints:
            saved = partial.records.get((ep["name"], level_no)) if partial else None
            if saved is not None:
                lv, records[(ep["name"], level_no)] = saved["summary"], saved["records"]
                levels.append(lv)
                log(f"[loadtest] {ep['name']:>12s} {level_label(plan):<10s} resumed from {partial.path.name}")
                continue
            opts = dict(base_opts, model=ep["model"])
            level_runner = runner.run_level if runner else run_level_local
            if args.warm_prompts:
                level_runner(ep["chat_url"], sessions, dict(plan, offsets=None), dict(opts, max_tokens=1))
            desc, quiet = f"{ep['name']} {level_label(plan)}", args.quiet
            sampler = replica_sampler(args)
            t0 = time.time()
            with (
                sampler,
                tqdm(total=n, desc=desc, disable=quiet, leave=False, file=sys.stderr, dynamic_ncols=True) as bar,
            ):
                result = level_runner(ep["chat_url"], sessions, plan, opts, on_done=bar.update)
            lv = summarize(ep["name"], ep["url"], plan["concurrency"], plan["request_rate"], result, args.slo)
            if args.serve_app:
                from .cluster import over_time

                lv["over_time"] = over_time(result["records"], sampler.samples, t0)
            lv.update(level_no=level_no, max_concurrency=plan.get("max_concurrency"))
            levels.append(lv)
            records[(ep["name"], level_no)] = result["records"]
            if partial:
                partial.append(
                    {"endpoint": ep["name"], "level_no": level_no, "summary": lv, "records": result["records"]}
                )
            log(
                f"[loadtest] {ep['name']:>12s} {level_label(plan):<10s} requests={lv['requests']} "
                f"errors={lv['errors']} ttft_p50={fmt(lv['ttft_ms']['p50'])} "
                f"e2e_p50={fmt(lv['e2e_ms']['p50'])} req/s={lv['requests_per_s']:.3f}"
            )
    return levels, records


def replica_sampler(args: argparse.Namespace):
    """The Serve replica count sampler of ``--serve-app`` (a context that does nothing without it)."""
    if not args.serve_app:
        return contextlib.nullcontext()
    if not args.ray:
        raise ValueError("--serve-app reads Serve's status through the cluster: it needs --ray ADDRESS")
    from .cluster import ReplicaSampler

    return ReplicaSampler(args.serve_app)


def run(args: argparse.Namespace) -> dict:
    """Execute the whole load test; returns the report dict (also written to disk)."""
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    args.dataset = args.dataset or default_datasets(args.workload)
    args.num_requests = args.num_requests or (DURATION_REQUEST_CAP if args.duration else 32)
    units = load_workload(args.workload, args.dataset, args.limit, args.seed, args.prompt_chars)
    now = dt.datetime.now()
    stamp = now.strftime("%Y%m%d-%H%M%S")
    # the nonces' salt: the run's name (every pass of a resumed run sends the same prompts), else its start
    salt = getattr(args, "prefix_salt", None) or args.name or stamp
    args.unique_prefix_salt = f"{args.seed}:{salt}" if args.unique_prefix else None
    endpoints, baseline = resolve_endpoints(args)
    runner = None
    if args.ray:
        from .ray_clients import RayRunner

        runner = RayRunner(args.ray, args.clients_per_node, args.ray_actors, args.ray_actor_cpus, args.ray_local_cpus)
    try:
        levels, records = run_levels(args, units, endpoints, runner, log)
    finally:
        if runner:
            runner.close()
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "endpoint")}
    config["api_key"] = "set" if args.api_key else None
    report = {
        "tool": "toolspec loadtest",
        "name": args.name or f"loadtest-{stamp}",
        "stamp": stamp,
        "created": now.isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "hardware": args.hardware or f"{socket.gethostname()} ({platform.machine()}, {os.cpu_count()} CPUs)",
        "workload": args.workload,
        "workload_units": len(units),
        "runner": f"ray ({args.ray}, {len(runner.actors)} actors)" if runner else "local asyncio",
        "clients": runner.clients if runner else None,  # each Ray client actor's node id and ip:pid
        "config": config,
        "endpoints": [{k: e[k] for k in ("name", "url", "model")} for e in endpoints],
        "baseline": baseline,
        "levels": levels,
    }
    report["speedup"] = compare(levels, records, baseline)
    write_reports(report, records, Path(args.out), args.save_records)
    if args.serve_app:
        from .cluster import plot_over_time

        for lv in levels:
            stem = Path(report["files"][0]).with_suffix("")
            png = stem.parent / f"{stem.name}.{lv['endpoint']}-{lv['level_no']}.replicas.png"
            plot_over_time(
                lv["over_time"], png, title=f"{lv['endpoint']} {level_label(lv)}: Serve app {args.serve_app}"
            )
            report["files"].append(str(png))
    log(f"[loadtest] wrote {', '.join(report['files'])}")
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI entry (`toolspec loadtest`); 0 when the run completed, 2 on bad arguments."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.resume and not args.name:
            parser.error("--resume needs --name (the run it continues)")
        if args.unique_prefix and args.warm_prompts:
            parser.error("--warm-prompts sends each prompt once to fill the prefix cache; --unique-prefix keeps it out")
        if args.prefix_salt and not args.unique_prefix:
            parser.error("--prefix-salt salts --unique-prefix's nonces; without --unique-prefix there are none")
        if args.timeline is None:  # the records are where a timeline is kept
            args.timeline = args.save_records
        run(args)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(f"toolspec loadtest: {exc.code}", file=sys.stderr)
            return 2
        return int(exc.code or 0)
    except (OSError, ValueError) as exc:
        print(f"toolspec loadtest: {exc}", file=sys.stderr)
        return 2
    return 0
