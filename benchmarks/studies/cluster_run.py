"""Study: one load test on a local multi-node Ray cluster with the embedded model, a node killed
in the middle. Result: benchmarks/runs/cluster/<name>/ (report.json, report.md, two PNGs).

The cluster is the cpu-cluster overlay's node groups started on this machine
(deployments/topology.py: the head, two cpu-replicas nodes offering one ``replica`` each, one
retrieval node), the app its own args with the embedded Qwen2.5-Coder-0.5B on every replica, the
call library on Qdrant edge on disk (Qdrant's server in the overlay), Serve autoscaling 1..2
replicas on queue length. Three phases of closed-loop clients:

1. ``--clients`` clients for ``--load-s`` seconds: Serve adds the second replica on the other
   cpu-replicas node; ``--kill-at`` seconds in (at the earliest: once both replicas run), the node
   of a replica that has served requests is killed (its raylet and every process on it) and a
   fresh cpu-replicas node joins, as KubeRay replaces a lost pod;
2. one client for ``--tail-s`` seconds: Serve removes a replica (graceful drain).

Recorded: Serve's RUNNING replica count (``serve.status()``) every 0.25 s, every request (start,
latency, tokens, status, error kind, replica), the RSS of each node's processes every second
(raylet and its workers; the head's GCS too). Counted: requests sent, completed, failed by kind,
duplicated (the library's adds beyond its distinct records, every request its own tenant).

    python -m benchmarks.studies.cluster_run                   # ~8 minutes on 2 cores
    python -m benchmarks.studies.cluster_run --clients 6 --load-s 300 --kill-at 150 --key qwen
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APP = "toolspec"
SERVE_ENV = {  # Serve's queue-length reports every 0.5 s (default 10 s): a short run scales
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_rss(node) -> int:
    """Bytes resident in a local node's processes: what Ray started for it and their children
    (the raylet's workers, replicas among them)."""
    import psutil

    seen, total = set(), 0
    for infos in node.all_processes.values():
        for info in infos:
            try:
                root = psutil.Process(info.process.pid)
                for p in [root, *root.children(recursive=True)]:
                    if p.pid not in seen:
                        seen.add(p.pid)
                        total += p.memory_info().rss
            except psutil.Error:
                continue
    return total


class RssSampler:
    """RSS of every live node of a LocalCluster every ``every_s``: [(wall time, {label: bytes})]."""

    def __init__(self, lc, every_s: float = 1.0):
        self.lc, self.every_s, self.samples = lc, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            row = {}
            for group, nodes in list(self.lc.members.items()):
                for node in list(nodes):
                    row[f"{group}:{node.node_id[:6]}"] = node_rss(node)
            self.samples.append((time.time(), row))
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


def kill_candidate(lc, records: list[dict], running: int):
    """The replica whose node to kill: once both replicas are RUNNING, one that has answered a
    request (a replica still loading its model is not what a node loss under load is about)."""
    if running < 2:
        return None
    served = {r["replica"].rsplit(":", 1)[-1] for r in records if r["ok"] and r.get("replica")}
    return next((a for a in lc.serve_actors(APP).get("Replica", []) if str(a["pid"]) in served), None)


def request_bodies(workload_rows: list[dict], max_tokens: int):
    """Request ``i``: dataset item ``i`` (round robin), its own library tenant, every other one streamed."""

    def body(i: int) -> dict:
        item = workload_rows[i % len(workload_rows)]
        out = {"model": APP, "messages": item["messages"], "tools": item["tools"], "max_tokens": max_tokens}
        out.update(stream=i % 2 == 1, user=f"run{i}")
        if i % 2:
            out["stream_options"] = {"include_usage": True}
        return out

    return body


def load_items(path: str, limit: int) -> list[dict]:
    """The dataset's requests (messages and tools), in the load tester's seeded order."""
    from benchmarks.loadtest.workloads import load_workload

    return [{"messages": u[0]["messages"], "tools": u[0]["tools"]} for u in load_workload("calls", [path], limit, 0)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--load-s", type=float, default=240.0)
    p.add_argument(
        "--kill-at",
        type=float,
        default=120.0,
        help="seconds into the load, at the earliest: the node is killed once both replicas run; 0: none is",
    )
    p.add_argument("--tail-s", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--bucket-s", type=float, default=5.0, help="the time buckets of the over-time table and plot")
    p.add_argument("--key", choices=["lexical", "qwen"], default="lexical", help="retrieval key (qwen: the encoder)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--dataset", default=str(ROOT / "benchmarks" / "datasets" / "api_bank.dev.jsonl.gz"))
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "runs" / "cluster"))
    p.add_argument("--name")
    args = p.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.path.insert(0, str(ROOT / "k8s"))
    import k8s_render
    from ray import serve

    from benchmarks.loadtest.cluster import (
        BackgroundLoad,
        ReplicaSampler,
        count,
        over_time,
        plot_over_time,
        running_replicas,
    )
    from benchmarks.plots import pyplot
    from deployments.app import build_app
    from deployments.config import ServeAppConfig
    from deployments.topology import LocalCluster, node_groups, placement, rayservice_args

    rs = next(d for d in k8s_render.render(ROOT / "k8s" / "overlays" / "cpu-cluster") if d["kind"] == "RayService")
    groups = node_groups(rs)
    library = tempfile.mkdtemp(prefix="cluster-run-library-")
    overrides = {
        "model": "embedded",
        "method": "toolspec",
        "threads": args.threads,
        "served_model_name": APP,
        "max_tokens_default": args.max_tokens,
        "qdrant_url": None,
        "qdrant_api_key_env": None,
        "api_key_env": None,
        "autoscaling": {"upscale_delay_s": 0, "downscale_delay_s": 5, "look_back_period_s": 2},
        "retrieval": {"key": args.key, "store": {"backend": "edge", "path": library}, "timeout_s": 2.0},
    }
    if args.key == "qwen":
        overrides["retrieval"]["encoder"] = {"model": "embedded", "device": "cpu", "threads": 1}
    cfg = ServeAppConfig.model_validate(rayservice_args(rs, overrides))
    items = load_items(args.dataset, args.limit)
    name = args.name or f"cluster-run-{dt.datetime.now():%Y%m%d-%H%M%S}"
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    env = {**SERVE_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t_start = time.time()
    lc = LocalCluster(groups, env=env)
    events: list[tuple[float, str]] = []
    try:
        lc.connect()
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(cfg), name=APP, route_prefix="/", blocking=False)
        chat = f"http://127.0.0.1:{port}/v1/chat/completions"
        while running_replicas(APP) < 1 or running_replicas(APP, "Retrieval") < 1:
            if time.time() - t_start > 900:
                raise TimeoutError("the app did not start in 15 minutes")
            time.sleep(1.0)
        startup_s = time.time() - t_start
        print(f"[cluster_run] app up after {startup_s:.0f} s; load {args.clients} clients for {args.load_s:.0f} s")
        lib = serve.get_deployment_handle("Retrieval", app_name=APP)
        lib0 = lib.stats.remote().result()
        body = request_bodies(items, args.max_tokens)
        t0 = time.time()
        with ReplicaSampler(APP) as replicas, RssSampler(lc) as rss:
            with BackgroundLoad(chat, body, args.clients, timeout_s=300) as heavy:
                killed = None
                while time.time() - t0 < args.load_s:
                    victim = kill_candidate(lc, heavy.records, running_replicas(APP))
                    due = args.kill_at and killed is None and time.time() - t0 >= args.kill_at
                    if due and victim is not None:
                        events.append((time.time() - t0, f"node {victim['node_id'][:6]} killed"))
                        lc.remove_node(lc.node(victim["node_id"]))
                        fresh = lc.add_node("cpu-replicas")
                        events.append((time.time() - t0, f"node {fresh.node_id[:6]} joined"))
                        killed = {"node": victim["node_id"], "replica_pid": victim["pid"], "at_s": events[-2][0]}
                    time.sleep(0.2)
            events.append((time.time() - t0, "load falls to 1 client"))
            with BackgroundLoad(chat, body, 1, timeout_s=300) as light:
                # indices after the heavy phase's: every request its own library tenant
                light._next = heavy._next
                time.sleep(args.tail_s)
        records = heavy.records + light.records
        if killed:
            killed["in_flight"] = len(heavy.in_flight_at(t0 + killed["at_s"]))
        lib1 = lib.stats.remote().result()
        rows = over_time(records, replicas.samples, t0, bucket_s=args.bucket_s)
        tally = count(records)
        tally["duplicated"] = (lib1["adds"] - lib0["adds"]) - (lib1["records"] - lib0["records"])
        where = {d: sorted({a["group"] for a in xs}) for d, xs in lc.serve_actors(APP).items()}
        report = {
            "name": name,
            "created": dt.datetime.now().isoformat(timespec="seconds"),
            "hardware": f"{os.uname().nodename} ({os.cpu_count()} CPUs), every node on this one machine",
            "config": {**vars(args), "app": cfg.model_dump(mode="json", exclude={"api_key"})},
            "groups": [g.__dict__ for g in groups],
            "placement_expected": placement(cfg, groups),
            "placement_at_end": where,
            "startup_s": startup_s,
            "counts": tally,
            "killed": killed,
            "events": events,
            "library": {"before": lib0, "after": lib1},
            "over_time": rows,
            "replicas": [(t - t0, n) for t, n in replicas.samples],
            "rss": [(t - t0, row) for t, row in rss.samples],
            "requests": records,
        }
    finally:
        lc.shutdown()
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    plot_over_time(rows, out / "over_time.png", events, title=f"{name}: Serve replicas, throughput, latency")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = sorted({k for _, row in rss.samples for k in row})
    for label in labels:
        pts = [(t - t0, row[label] / 2**30) for t, row in rss.samples if label in row]
        ax.plot([a for a, _ in pts], [b for _, b in pts], label=label)
    for when, label in events:
        ax.axvline(when, color="C3", ls="--", lw=1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (GiB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=110)
    plt.close(fig)
    write_markdown(report, out / "report.md")
    print(f"[cluster_run] {json.dumps(tally)}; wrote {out}")
    return 0


def write_markdown(report: dict, path: Path) -> None:
    c = report["counts"]
    peak = {}
    for _, row in report["rss"]:
        for k, v in row.items():
            peak[k] = max(peak.get(k, 0), v)
    lines = [
        f"# Local multi-node cluster run {report['name']}",
        "",
        f"- {report['hardware']}; app up after {report['startup_s']:.0f} s",
        "- node groups: "
        + ", ".join(
            f"{g['name']} x{g['count']} ({g['num_cpus']:g} CPUs, {dict(g['resources'])})" for g in report["groups"]
        ),
        f"- placement expected (topology.placement): {report['placement_expected']}; at the end: {report['placement_at_end']}",
        f"- requests: sent {c['sent']}, completed {c['completed']}, failed {c['failed'] or 0}, duplicated {c['duplicated']}",
        f"- node killed: {report['killed']}",
        "- events (s): " + "; ".join(f"{t:.1f} {label}" for t, label in report["events"]),
        "",
        "| node | peak RSS (GiB) |",
        "|---|---:|",
        *[f"| {k} | {v / 2**30:.2f} |" for k, v in sorted(peak.items())],
        "",
        "![replicas, throughput, latency](over_time.png)",
        "",
        "![RSS per node](rss.png)",
        "",
    ]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
