"""Study: where the serving path's CPU goes, per process, per streamed token. Result: benchmarks/results/loadtest/serving-ceiling-*.cpu.json

Runs ``benchmarks.studies.loadtest_local`` (its arguments unchanged) and, in a thread, samples
the CPU time of every process it started -- Serve's HTTP proxy, the engine replicas, the Gate,
Serve's controller, Ray's raylet / GCS / agents -- and of this process (the load generator's
clients) every ``--every`` seconds. Each load level's CPU seconds per process, divided by the
completion tokens the level streamed, is the CPU each process spends per token. With
``--py-spy SECONDS`` it also records each replica's and the proxy's Python stacks for that long
in the middle of the last level (``py-spy record --gil --nonblocking -f raw``) and writes their
top functions by self and inclusive time of the GIL-holding thread beside the report.

    python -m benchmarks.studies.serving_cpu --scripted-target --concurrency 1,8,32 --duration 30 \\
        --num-requests 4000 --name serving-ceiling --py-spy 8
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time


def role(cmdline: str) -> str:
    """A process's part in the path, from its title."""
    for key, name in (
        ("ProxyActor", "proxy"),
        (":Replica", "replica"),
        (":Gate", "gate"),
        ("ServeController", "controller"),
        (":Retrieval", "retrieval"),
        ("raylet", "raylet"),
        ("gcs_server", "gcs"),
        ("dashboard", "ray-agents"),
        ("runtime_env", "ray-agents"),
        ("log_monitor", "ray-other"),
    ):
        if key in cmdline:
            return name
    return "ray-other"


class CpuSampler:
    def __init__(self, every: float):
        self.every, self.samples, self._stop = every, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, float]:
        import psutil

        me = psutil.Process()
        out: dict[str, float] = collections.Counter()
        t = me.cpu_times()
        out["client (load generator)"] += t.user + t.system
        for proc in me.children(recursive=True):
            try:
                t = proc.cpu_times()
                out[role(" ".join(proc.cmdline()))] += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                continue
        return dict(out)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.snapshot()))
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def per_level(samples, records_path: str) -> list[dict]:
    """CPU seconds per process over each level's span (its first request's start to its last's
    end), per completion token streamed in it."""
    levels: dict[str, list[dict]] = collections.defaultdict(list)
    with open(records_path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("e2e_ms") is not None:
                levels[f"c={r.get('concurrency')}"].append(r)
    out = []
    for level, recs in levels.items():
        t0 = min(r["started"] for r in recs)
        t1 = max(r["started"] + r["e2e_ms"] / 1000 for r in recs)
        a = min(samples, key=lambda s: abs(s[0] - t0))
        b = min(samples, key=lambda s: abs(s[0] - t1))
        tokens = sum(r.get("completion_tokens") or 0 for r in recs)
        span = b[0] - a[0]
        cpu = {k: b[1].get(k, 0.0) - a[1].get(k, 0.0) for k in b[1]}
        out.append(
            {
                "level": level,
                "span_s": span,
                "tokens": tokens,
                "tokens_per_s": tokens / span if span > 0 else None,
                "cpu_s": {k: round(v, 3) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])},
                "cpu_ms_per_token": {k: round(1000 * v / tokens, 4) for k, v in cpu.items() if tokens}
                if tokens
                else {},
                "cpu_busy_of_machine": sum(cpu.values()) / span / (os.cpu_count() or 1) if span > 0 else None,
            }
        )
    return out


def py_spy(pids: dict[str, int], seconds: float, out_dir: str, name: str) -> dict:
    """Each process's top functions over ``seconds`` (py-spy, raw stacks): by self time and by
    inclusive time, of the samples whose thread holds the GIL (``--gil``: a replica's Python work
    is one thread at a time, and its idle threads -- the worker pool waiting on its queue, Ray's
    loops in native code -- would otherwise fill the top). ``--nonblocking``: the process is not
    paused for each sample, so the recording does not slow down what it records. A process that
    yields no samples reports py-spy's own words (``error``)."""
    procs = {}
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    for who, pid in pids.items():
        path = os.path.join(out_dir, f"{name}.pyspy.{who}.txt")
        cmd = [exe, "record", "-p", str(pid), "-d", str(int(seconds)), "-f", "raw", "-o", path, "-r", "200"]
        procs[who] = (
            path,
            subprocess.Popen(cmd + ["--gil", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
        )
    tops = {}
    for who, (path, proc) in procs.items():
        try:
            _, err = proc.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        tops[who] = stack_tops(path) if os.path.exists(path) else {"samples": 0}
        if not tops[who]["samples"]:
            tops[who]["error"] = f"py-spy exit {proc.returncode}: " + err.decode(errors="replace").strip()[-500:]
    return tops


def stack_tops(path: str, n: int = 25) -> dict:
    """Self and inclusive shares of each function (``function (file)``, lines merged) in a py-spy
    raw file."""
    self_time, inclusive, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            k = int(count)
            frames = [frame.rsplit(":", 1)[0] + ")" if ":" in frame else frame for frame in stack.split(";")]
            self_time[frames[-1]] += k
            for frame in set(frames):
                inclusive[frame] += k
            total += k
    share = lambda c: [(key, round(v / total, 4)) for key, v in c.most_common(n)]  # noqa: E731
    return {"samples": total, "top": share(self_time) if total else [], "inclusive": share(inclusive) if total else []}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--every", type=float, default=1.0)
    p.add_argument("--py-spy", dest="py_spy", type=float, default=0.0)
    ns, rest = p.parse_known_args(argv)
    from benchmarks.studies import loadtest_local

    name = rest[rest.index("--name") + 1]
    out = rest[rest.index("--out") + 1] if "--out" in rest else os.path.join("benchmarks", "results", "loadtest")
    sampler = CpuSampler(ns.every)
    spy: dict = {}
    if ns.py_spy:
        levels = rest[rest.index("--concurrency") + 1].split(",")
        duration = float(rest[rest.index("--duration") + 1])

        def later():  # the middle of the last level: find its processes, record them
            import psutil

            time.sleep(5)
            while not any(":Replica" in " ".join(c.cmdline()) for c in psutil.Process().children(recursive=True)):
                time.sleep(1)
            # levels run one after the other with warm-up in between: aim at the last one
            time.sleep(duration * (len(levels) - 1) + 15)
            pids = {}
            for c in psutil.Process().children(recursive=True):
                r = role(" ".join(c.cmdline()))
                if r in ("replica", "proxy"):
                    pids[f"{r}-{c.pid}"] = c.pid
            spy.update(py_spy(pids, ns.py_spy, out, name))

        spy_thread = threading.Thread(target=later, daemon=True)
        spy_thread.start()
    try:
        # the records give each level's tokens; the responses stay lean (no timeline) unless asked
        extra = [] if "--save-records" in rest else ["--save-records"]
        extra += [] if {"--timeline", "--no-timeline"} & set(rest) else ["--no-timeline"]
        rc = loadtest_local.main(rest + extra)
    finally:
        sampler.stop()
    if ns.py_spy:
        spy_thread.join(timeout=ns.py_spy + 120)
    rec = os.path.join(out, f"{name}.records.jsonl")
    levels_out = per_level(sampler.samples, rec) if os.path.exists(rec) else []
    path = os.path.join(out, f"{name}.cpu.json")
    with open(path, "w") as f:
        json.dump({"levels": levels_out, "py_spy": spy, "cpus": os.cpu_count()}, f, indent=1)
    for lv in levels_out:
        ms = sorted(lv["cpu_ms_per_token"].items(), key=lambda kv: -kv[1])
        print(
            f"[cpu] {lv['level']}: {lv['tokens_per_s'] or 0:.0f} tok/s; ms/token "
            + ", ".join(f"{k} {v:.3f}" for k, v in ms)
        )
    print(f"[cpu] -> {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
