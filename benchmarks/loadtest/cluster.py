"""A load test's view of the cluster: Serve's replica count sampled while a level runs, and the
level cut into time buckets (replicas, completions, failures, tokens/s, latency) for one plot.

The replica count is what Serve's controller reports (``serve.status()``: replicas RUNNING), read
by the driver, which must be connected to the cluster that serves the app (``--ray ADDRESS``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


def running_replicas(app: str, deployment: str = "Replica") -> int:
    """Replicas of ``deployment`` in Serve app ``app`` that are RUNNING (0 when it is not deployed)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return int(status.deployments[deployment].replica_states.get("RUNNING", 0))


class ReplicaSampler:
    """Samples :func:`running_replicas` every ``every_s`` on a thread, as (wall time, count)."""

    def __init__(self, app: str, deployment: str = "Replica", every_s: float = 0.25):
        self.app, self.deployment, self.every_s = app, deployment, every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="replica-sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), running_replicas(self.app, self.deployment)))
            except Exception:  # the controller busy or restarting: a gap in the series, not an error
                pass
            self._stop.wait(self.every_s)

    def __enter__(self) -> "ReplicaSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.every_s + 5)


def _p50(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def over_time(records: list[dict], samples: list[tuple[float, int]], t0: float, bucket_s: float = 1.0) -> list[dict]:
    """Per ``bucket_s`` from ``t0`` (wall time): Serve's replica count (the bucket's last sample),
    requests completed and failed in it (by when they ended), output tokens/s and the median
    end-to-end latency of those completed."""
    ends = []
    for r in records:
        if r.get("started") is None:
            continue
        took = (r.get("e2e_ms") or 0.0) / 1e3
        ends.append((r["started"] + took - t0, r))
    last = max([t for t, _ in ends] + [s - t0 for s, _ in samples] + [0.0])
    rows = []
    for b in range(int(last // bucket_s) + 1):
        lo, hi = b * bucket_s, (b + 1) * bucket_s
        done = [r for t, r in ends if lo <= t < hi]
        ok = [r for r in done if r["ok"]]
        counts = [n for s, n in samples if s - t0 < hi]
        rows.append(
            {
                "t": lo,
                "replicas": counts[-1] if counts else None,
                "completed": len(ok),
                "failed": len(done) - len(ok),
                "output_tokens_per_s": sum(r.get("completion_tokens") or 0 for r in ok) / bucket_s,
                "e2e_p50_ms": _p50([r["e2e_ms"] for r in ok if r.get("e2e_ms") is not None]),
            }
        )
    return rows


def plot_over_time(rows: list[dict], path: Path, events: list[tuple[float, str]] = (), title: str = "") -> None:
    """Replicas, throughput and latency over time, one above the other, events (e.g. a node
    killed) marked across all three."""
    from ..plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    t = [r["t"] for r in rows]
    axes[0].step(t, [r["replicas"] or 0 for r in rows], where="post", color="C0")
    axes[0].set_ylabel("Serve replicas\n(RUNNING)")
    width = (t[1] - t[0]) if len(t) > 1 else 1.0
    axes[1].step(t, [r["output_tokens_per_s"] for r in rows], where="post", color="C1")
    axes[1].set_ylabel("output tokens/s")
    failed = axes[1].twinx()
    failed.bar(t, [r["failed"] for r in rows], width=width, align="edge", color="C3", alpha=0.4)
    failed.set_ylabel("failed requests", color="C3")
    failed.set_ylim(0, max([r["failed"] for r in rows] + [1]) * 1.2)
    axes[2].plot(t, [r["e2e_p50_ms"] for r in rows], "o-", ms=3, color="C2")
    axes[2].set_ylabel("e2e p50 (ms)")
    axes[2].set_xlabel("seconds")
    for when, label in events:
        for ax in axes:
            ax.axvline(when, color="C3", ls="--", lw=1)
        axes[0].annotate(
            label,
            (when, 0.02),
            xycoords=("data", "axes fraction"),
            xytext=(3, 0),
            textcoords="offset points",
            fontsize=8,
            color="C3",
            rotation=90,
            va="bottom",
        )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class BackgroundLoad:
    """Closed-loop HTTP clients on threads, until stopped: each sends its next request when its
    last one ended (``body(i)``: request ``i``'s JSON). Every request ends as one record, never
    retried: ``ok``, its HTTP ``status`` (None when the connection failed), an ``error`` kind
    (``http_<status>``, ``connection_lost``, ``stream_cut``: a stream that closed without
    ``[DONE]``, ``stream_<code>``: a stream that ended with an error event, e.g.
    ``stream_replica_lost``, ``timeout``), the ``retry_after`` header, the serving ``replica`` (from the
    response's ``toolspec`` object) and the times :func:`over_time` reads."""

    def __init__(self, url: str, body, concurrency: int, timeout_s: float = 60.0, stagger_s: float = 0.0):
        self.url, self.body, self.concurrency, self.timeout_s = url, body, concurrency, timeout_s
        self.stagger_s = stagger_s  # client k sends its first request k * stagger_s after the first
        self.records: list[dict] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(concurrency)]

    def __enter__(self) -> "BackgroundLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> list[dict]:
        """Send nothing more, wait for the requests in flight to end; the records."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 10)
        return self.records

    def in_flight_at(self, when: float) -> list[dict]:
        return [r for r in self.records if r["started"] <= when < r["started"] + r["e2e_ms"] / 1e3]

    def _client(self, k: int) -> None:
        import httpx

        if self._stop.wait(k * self.stagger_s):
            return
        with httpx.Client(timeout=self.timeout_s) as http:
            while not self._stop.is_set():
                with self._lock:
                    i, self._next = self._next, self._next + 1
                rec = send_recorded(http, self.url, i, self.body(i))
                with self._lock:
                    self.records.append(rec)


def send_recorded(http, url: str, index: int, body: dict) -> dict:
    """One chat request through ``http`` (an ``httpx.Client``) -> its record (see BackgroundLoad)."""
    import json

    import httpx

    rec = {"index": index, "started": time.time(), "ok": False, "status": None, "error": None}
    rec.update(retry_after=None, replica=None, completion_tokens=None, stream=bool(body.get("stream")), detail=None)
    t0 = time.perf_counter()
    try:
        if body.get("stream"):
            with http.stream("POST", url, json=body) as resp:
                rec["status"], rec["retry_after"] = resp.status_code, resp.headers.get("retry-after")
                if resp.status_code != 200:
                    rec["detail"] = resp.read().decode(errors="replace")[:500]
                else:
                    done, stats, usage, error = False, {}, {}, None
                    for line in resp.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            event = json.loads(line[6:])
                            stats, usage = event.get("toolspec") or stats, event.get("usage") or usage
                            error = event.get("error") or error
                    if error is not None:
                        rec["error"], rec["detail"] = f"stream_{error.get('code') or error.get('type')}", error
                    elif not done:
                        rec["error"] = "stream_cut"
                    else:
                        rec.update(
                            ok=True, replica=stats.get("replica"), completion_tokens=usage.get("completion_tokens")
                        )
        else:
            resp = http.post(url, json=body)
            rec["status"], rec["retry_after"] = resp.status_code, resp.headers.get("retry-after")
            if resp.status_code != 200:
                rec["detail"] = resp.text[:500]
            else:
                out = resp.json()
                rec.update(ok=True, replica=(out.get("toolspec") or {}).get("replica"))
                rec["completion_tokens"] = (out.get("usage") or {}).get("completion_tokens")
        if not rec["ok"] and rec["error"] is None:
            rec["error"] = f"http_{rec['status']}"
    except httpx.TimeoutException:
        rec["error"] = "timeout"
    except httpx.RemoteProtocolError:
        rec["error"] = "connection_lost"
    except httpx.HTTPError as exc:
        rec["error"] = type(exc).__name__
    rec["e2e_ms"] = 1e3 * (time.perf_counter() - t0)
    return rec


def count(records: list[dict]) -> dict:
    """Sent, completed, failed by error kind."""
    failed: dict[str, int] = {}
    for r in records:
        if not r["ok"]:
            failed[r["error"]] = failed.get(r["error"], 0) + 1
    return {"sent": len(records), "completed": sum(r["ok"] for r in records), "failed": dict(sorted(failed.items()))}
