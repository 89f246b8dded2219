"""``toolspec loadtest``: replay dataset requests against OpenAI-compatible endpoints.

For every concurrency level, and for every endpoint in turn (so endpoints compared in one run
see the same requests under the same conditions), a fixed pool of clients sends
``/v1/chat/completions`` requests built from a dataset JSONL (messages + tools, temperature 0)
until ``--requests-per-level`` have been sent or ``--max-seconds`` have passed; requests still in
flight at the time limit are cancelled and counted as errors of kind ``deadline``, so
``requests == ok + errors`` always holds. Locally the clients are asyncio tasks in one process;
with ``--ray`` each level is split into slices run as Ray tasks spread over the cluster's nodes
and their raw records are aggregated here. Writes ``loadtest-<stamp>.json``, ``.md`` and
``.png`` into ``--out``.

Example:
  toolspec loadtest --dataset ../shared/data/api_bank.dev.jsonl \\
      --endpoint toolspec=http://127.0.0.1:8000/v1 --endpoint greedy=http://127.0.0.1:8001/v1 \\
      --concurrency 1,2,4,8 --requests-per-level 32 --max-seconds 300 --stream
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import hashlib
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "loadtest"  # not method runs: their own folder
ERROR_BODY_CHARS = 200


# ------------------------------------------------------------------ inputs


def parse_endpoint(spec: str) -> tuple[str, str]:
    """'name=url' -> (name, url); a bare URL is named after its host:port."""
    name, sep, url = spec.partition("=")
    if not sep:
        url = spec
        name = url.split("://")[-1].split("/")[0]
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"endpoint URL must start with http(s)://: {spec!r}")
    return name.strip(), url.strip()


def chat_url(base_url: str) -> str:
    """OpenAI base URL ('.../v1', as given to the openai client) -> its chat completions URL."""
    base = base_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive integers: {text!r}")
    return levels


def load_items(path: str | Path, limit: int | None = None) -> list[dict]:
    """Dataset items reduced to what a request needs (shared/data/README.md format)."""
    items = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            tools = row.get("tools") or []
            items.append(
                {
                    "id": row.get("id", str(len(items))),
                    "messages": row["messages"],
                    "tools": tools,
                    "tool_names": sorted({t["function"]["name"] for t in tools if "function" in t}),
                    "gold_names": [c["name"] for c in row.get("gold_calls") or []],
                }
            )
            if limit and len(items) >= limit:
                break
    if not items:
        raise ValueError(f"no items in {path}")
    return items


def build_payload(
    item: dict, model: str, max_tokens: int, stream: bool, tool_choice: str | None = None, stream_usage: bool = True
) -> dict:
    payload = {
        "model": model,
        "messages": item["messages"],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if item["tools"]:
        payload["tools"] = item["tools"]
        if tool_choice:
            payload["tool_choice"] = tool_choice
    if stream and stream_usage:
        payload["stream_options"] = {"include_usage": True}
    return payload


# ------------------------------------------------------------------ one request


def check_tool_calls(calls: list[dict], tool_names) -> bool:
    """Valid = every call names an offered tool and its arguments parse as a JSON object."""
    names = set(tool_names)
    for call in calls:
        fn = call.get("function") or {}
        if fn.get("name") not in names:
            return False
        try:
            args = json.loads(fn.get("arguments") or "")
        except (TypeError, ValueError):
            return False
        if not isinstance(args, dict):
            return False
    return True


def output_digest(content: str | None, calls: list[dict]) -> str:
    """Hash of what the model produced, to see whether two endpoints answered identically."""
    norm = [[(c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")] for c in calls]
    blob = json.dumps({"content": content or "", "calls": norm}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _merge_tool_call_deltas(acc: dict[int, dict], deltas: list[dict]) -> None:
    """OpenAI streams a call as deltas: id/name first, then argument fragments, keyed by index."""
    for d in deltas:
        slot = acc.setdefault(
            d.get("index", len(acc)), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if d.get("id"):
            slot["id"] = d["id"]
        fn = d.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]


async def _read_stream(response, started: float) -> dict:
    """Consume an SSE stream; note when the first content/tool-call token arrived."""
    first = None
    content, calls, usage, chunks, stats = [], {}, None, 0, None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("error"):
            raise _ServerError("stream_error", str(event["error"])[:ERROR_BODY_CHARS])
        usage = event.get("usage") or usage
        stats = event.get("toolspec") or stats
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
            if delta.get("content"):
                content.append(delta["content"])
            if delta.get("tool_calls"):
                _merge_tool_call_deltas(calls, delta["tool_calls"])
    return {
        "content": "".join(content),
        "tool_calls": [calls[k] for k in sorted(calls)],
        "usage": usage,
        "ttft_ms": None if first is None else (first - started) * 1e3,
        "chunks": chunks,
        "server_stats": stats,
    }


class _ServerError(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(detail)
        self.kind = kind


async def send_one(client, url: str, payload: dict, headers: dict) -> dict:
    """One request -> a result dict; raises _ServerError / httpx errors on failure."""
    started = time.perf_counter()
    if payload.get("stream"):
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise _ServerError(f"http_{response.status_code}", body[:ERROR_BODY_CHARS])
            out = await _read_stream(response, started)
    else:
        response = await client.post(url, json=payload, headers=headers)
        if response.status_code != 200:
            raise _ServerError(f"http_{response.status_code}", response.text[:ERROR_BODY_CHARS])
        body = response.json()
        try:
            message = body["choices"][0]["message"]
        except (KeyError, IndexError, TypeError) as exc:
            raise _ServerError("bad_response", str(body)[:ERROR_BODY_CHARS]) from exc
        out = {
            "content": message.get("content"),
            "tool_calls": message.get("tool_calls") or [],
            "usage": body.get("usage"),
            "ttft_ms": None,
            "chunks": None,
            "server_stats": body.get("toolspec"),
        }
    out["latency_ms"] = (time.perf_counter() - started) * 1e3
    return out


def _error_kind(exc: BaseException) -> str:
    import httpx

    if isinstance(exc, _ServerError):
        return exc.kind
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, (json.JSONDecodeError, httpx.DecodingError)):
        return "bad_response"
    if isinstance(exc, httpx.HTTPError):
        return "http_error"
    return type(exc).__name__


def _record(index: int, item: dict, started_wall: float, node: str) -> dict:
    return {
        "index": index,
        "item_id": item["id"],
        "ok": False,
        "error": None,
        "detail": None,
        "latency_ms": None,
        "ttft_ms": None,
        "completion_tokens": None,
        "tool_calls": 0,
        "tool_calls_valid": None,
        "gold_name_match": None,
        "mat": None,
        "digest": None,
        "started": started_wall,
        "finished": None,
        "node": node,
    }


def _fill_success(rec: dict, item: dict, out: dict) -> None:
    calls = out["tool_calls"]
    usage = out.get("usage") or {}
    stats = out.get("server_stats")
    if isinstance(stats, dict) and isinstance(stats.get("mat"), (int, float)):
        rec["mat"] = float(stats["mat"])  # ToolSpec servers report mean accepted tokens per step
    rec.update(
        ok=True,
        latency_ms=out["latency_ms"],
        ttft_ms=out["ttft_ms"],
        completion_tokens=usage.get("completion_tokens", out.get("chunks")),
        tool_calls=len(calls),
        digest=output_digest(out["content"], calls),
    )
    if calls:
        rec["tool_calls_valid"] = check_tool_calls(calls, item["tool_names"])
    if item["gold_names"]:
        rec["gold_name_match"] = [(c.get("function") or {}).get("name") for c in calls][:1] == item["gold_names"][:1]


# ------------------------------------------------------------------ one slice of clients


async def run_slice(url: str, jobs: list[tuple[int, dict]], concurrency: int, max_seconds: float, opts: dict) -> dict:
    """Run *jobs* (index, item) with *concurrency* clients until done or *max_seconds* passed.

    Returns raw records plus the slice's wall-clock span; records of requests still in flight at
    the deadline carry error 'deadline'.
    """
    import httpx

    node = opts.get("node") or socket.gethostname()
    headers = {"Authorization": f"Bearer {opts['api_key']}"} if opts.get("api_key") else {}
    pending = collections.deque(jobs)
    records: list[dict] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(opts.get("timeout", 600.0), connect=min(10.0, opts.get("timeout", 600.0)))
    started = time.time()

    async def client_loop(client):
        while pending and loop.time() < deadline:
            index, item = pending.popleft()
            payload = build_payload(
                item,
                opts["model"],
                opts["max_tokens"],
                opts["stream"],
                opts.get("tool_choice"),
                opts.get("stream_usage", True),
            )
            rec = _record(index, item, time.time(), node)
            records.append(rec)
            try:
                _fill_success(rec, item, await send_one(client, url, payload, headers))
            except asyncio.CancelledError:
                rec["error"] = "deadline"
                raise
            except Exception as exc:  # every failure is data: count it, keep going
                rec["error"], rec["detail"] = _error_kind(exc), str(exc)[:ERROR_BODY_CHARS]
            finally:
                rec["finished"] = time.time()

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = [asyncio.create_task(client_loop(client)) for _ in range(max(1, concurrency))]
        _, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception():
                raise task.exception()
    return {
        "records": records,
        "started": started,
        "finished": time.time(),
        "node": node,
        "timed_out": bool(late),
        "unsent": len(pending),
    }


def run_slice_sync(url, jobs, concurrency, max_seconds, opts) -> dict:
    """Blocking wrapper: the body of one Ray task."""
    return asyncio.run(run_slice(url, jobs, concurrency, max_seconds, opts))


# ------------------------------------------------------------------ levels, local or on Ray


def level_jobs(items: list[dict], n: int, offset: int = 0) -> list[tuple[int, dict]]:
    """*n* requests of a level: dataset items in order from ``offset``, cycling if needed."""
    return [(i, items[(offset + i) % len(items)]) for i in range(n)]


def split_jobs(jobs: list, concurrency: int, tasks: int) -> list[tuple[list, int]]:
    """Split a level over up to *tasks* client slices, requests in proportion to their clients."""
    k = max(1, min(tasks, concurrency, len(jobs) or 1))
    shares = [concurrency // k + (1 if i < concurrency % k else 0) for i in range(k)]
    # Client slots dealt round-robin over slices, requests dealt over slots.
    owner = [s for r in range(max(shares)) for s, share in enumerate(shares) if share > r]
    parts: list[list] = [[] for _ in range(k)]
    for j, job in enumerate(jobs):
        parts[owner[j % concurrency]].append(job)
    return [(part, share) for part, share in zip(parts, shares, strict=True) if part]


def merge_slices(outs: list[dict]) -> dict:
    """Aggregate slice results: records sorted by request index, span from first start to last end."""
    records = sorted((r for o in outs for r in o["records"]), key=lambda r: r["index"])
    return {
        "records": records,
        "started": min(o["started"] for o in outs) if outs else time.time(),
        "finished": max(o["finished"] for o in outs) if outs else time.time(),
        "nodes": sorted({o["node"] for o in outs}),
        "timed_out": any(o["timed_out"] for o in outs),
        "unsent": sum(o["unsent"] for o in outs),
    }


def run_level_local(url, jobs, concurrency, max_seconds, opts) -> dict:
    return merge_slices([run_slice_sync(url, jobs, concurrency, max_seconds, opts)])


class RayRunner:
    """Fans each level out as Ray tasks (SPREAD over nodes), one client slice per task."""

    def __init__(self, address: str, tasks: int | None, task_cpus: float, local_cpus: int | None):
        import ray
        from ray import cloudpickle

        # Ship this module's code by value: cluster nodes need httpx, not this exact checkout.
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        if not ray.is_initialized():
            if address == "local":
                ray.init(num_cpus=local_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        self.ray = ray
        alive = [n for n in ray.nodes() if n.get("Alive")]
        self.tasks = tasks or max(1, len(alive))
        self.remote = ray.remote(num_cpus=task_cpus, scheduling_strategy="SPREAD", max_retries=0)(_ray_slice)

    def run_level(self, url, jobs, concurrency, max_seconds, opts) -> dict:
        refs = [
            self.remote.remote(url, part, share, max_seconds, opts)
            for part, share in split_jobs(jobs, concurrency, self.tasks)
        ]
        return merge_slices(self.ray.get(refs))


def _ray_slice(url, jobs, concurrency, max_seconds, opts) -> dict:
    import ray

    opts = dict(opts, node=f"{ray.util.get_node_ip_address()}:{os.getpid()}")
    return run_slice_sync(url, jobs, concurrency, max_seconds, opts)


# ------------------------------------------------------------------ statistics


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(endpoint: str, url: str, concurrency: int, run: dict) -> dict:
    """Per endpoint x level numbers for the report."""
    recs = run["records"]
    ok = [r for r in recs if r["ok"]]
    lat = [r["latency_ms"] for r in ok]
    wall = max(run["finished"] - run["started"], 1e-9)
    tokens = [r["completion_tokens"] for r in ok if r["completion_tokens"] is not None]
    with_calls = [r for r in ok if r["tool_calls"]]
    gold = [r["gold_name_match"] for r in ok if r["gold_name_match"] is not None]
    errors = collections.Counter(r["error"] for r in recs if not r["ok"])
    return {
        "endpoint": endpoint,
        "url": url,
        "concurrency": concurrency,
        "requests": len(recs),
        "ok": len(ok),
        "errors": len(recs) - len(ok),
        "error_kinds": dict(sorted(errors.items())),
        "p50_ms": percentile(lat, 50),
        "p95_ms": percentile(lat, 95),
        "p99_ms": percentile(lat, 99),
        "mean_ms": _mean(lat),
        "mean_ttft_ms": _mean(r["ttft_ms"] for r in ok),
        "p50_ttft_ms": percentile([r["ttft_ms"] for r in ok if r["ttft_ms"] is not None], 50),
        "throughput_rps": len(ok) / wall,
        "tokens_per_s": sum(tokens) / wall if tokens else None,
        "completion_tokens": sum(tokens) if tokens else None,
        "tool_call_responses": len(with_calls),
        "tool_call_validity": (
            sum(bool(r["tool_calls_valid"]) for r in with_calls) / len(with_calls) if with_calls else None
        ),
        "gold_name_match": sum(gold) / len(gold) if gold else None,
        "mean_mat": _mean(r["mat"] for r in ok),
        "wall_s": wall,
        "stopped_by_time": run["timed_out"],
        "unsent": run["unsent"],
        "nodes": run["nodes"],
    }


def _ratio(num, den) -> float | None:
    return num / den if num is not None and den not in (None, 0) else None


def compare(levels: list[dict], records: dict, baseline: str) -> list[dict]:
    """Speedup of every other endpoint over *baseline* per level, and output agreement."""
    base = {lv["concurrency"]: lv for lv in levels if lv["endpoint"] == baseline}
    rows = []
    for lv in levels:
        ref = base.get(lv["concurrency"])
        if lv["endpoint"] == baseline or ref is None:
            continue
        mine = {r["index"]: r["digest"] for r in records[(lv["endpoint"], lv["concurrency"])] if r["ok"]}
        theirs = {r["index"]: r["digest"] for r in records[(baseline, lv["concurrency"])] if r["ok"]}
        both = sorted(set(mine) & set(theirs))
        rows.append(
            {
                "endpoint": lv["endpoint"],
                "baseline": baseline,
                "concurrency": lv["concurrency"],
                "throughput_speedup": _ratio(lv["throughput_rps"], ref["throughput_rps"]),
                "p50_latency_speedup": _ratio(ref["p50_ms"], lv["p50_ms"]),
                "p95_latency_speedup": _ratio(ref["p95_ms"], lv["p95_ms"]),
                "tokens_per_s_speedup": _ratio(lv["tokens_per_s"], ref["tokens_per_s"]),
                "compared_outputs": len(both),
                "identical_outputs": sum(mine[i] == theirs[i] for i in both),
            }
        )
    return rows


# ------------------------------------------------------------------ reports


def _fmt(value, digits=1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def write_markdown(report: dict, path: Path) -> None:
    cfg = report["config"]
    lines = [
        f"# Load test {report['stamp']}",
        "",
        f"- dataset: `{cfg['dataset']}` ({report['dataset_items']} items), "
        f"max_tokens {cfg['max_tokens']}, temperature 0, stream {cfg['stream']}",
        f"- per level: at most {cfg['requests_per_level']} requests and {cfg['max_seconds']} s; "
        f"clients: {report['runner']}; "
        + (
            "each level sends different dataset items (no request repeats)"
            if cfg.get("fresh_requests")
            else "every level replays the same requests (a server that learns from history sees repeats)"
        ),
        "- endpoints: " + ", ".join(f"`{e['name']}` {e['url']} (model `{e['model']}`)" for e in report["endpoints"]),
        "",
        "| endpoint | conc. | requests | errors | p50 ms | p95 ms | p99 ms | mean TTFT ms "
        "| req/s | tok/s | tool-call valid | gold tool | MAT |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in report["levels"]:
        lines.append(
            f"| {lv['endpoint']} | {lv['concurrency']} | {lv['requests']} | {lv['errors']} "
            f"| {_fmt(lv['p50_ms'])} | {_fmt(lv['p95_ms'])} | {_fmt(lv['p99_ms'])} "
            f"| {_fmt(lv['mean_ttft_ms'])} | {_fmt(lv['throughput_rps'], 3)} | {_fmt(lv['tokens_per_s'])} "
            f"| {_fmt(lv['tool_call_validity'], 3)} ({lv['tool_call_responses']}) "
            f"| {_fmt(lv['gold_name_match'], 3)} | {_fmt(lv['mean_mat'], 2)} |"
        )
    if report["speedup"]:
        lines += [
            "",
            f"## Speedup vs `{report['baseline']}`",
            "",
            "| endpoint | conc. | throughput speedup | p50 latency speedup | p95 latency speedup | identical outputs |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for row in report["speedup"]:
            lines.append(
                f"| {row['endpoint']} | {row['concurrency']} | {_fmt(row['throughput_speedup'], 2)}x "
                f"| {_fmt(row['p50_latency_speedup'], 2)}x | {_fmt(row['p95_latency_speedup'], 2)}x "
                f"| {row['identical_outputs']}/{row['compared_outputs']} |"
            )
    failed = [lv for lv in report["levels"] if lv["errors"] or lv["stopped_by_time"]]
    if failed:
        lines += ["", "## Errors and time limits", ""]
        for lv in failed:
            notes = [f"{k} × {v}" for k, v in lv["error_kinds"].items()]
            if lv["stopped_by_time"]:
                notes.append(f"stopped at the {cfg['max_seconds']} s limit, {lv['unsent']} requests unsent")
            lines.append(f"- {lv['endpoint']} @ {lv['concurrency']}: " + "; ".join(notes))
    lines += ["", f"![latency and throughput vs concurrency]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines))


def write_plot(report: dict, path: Path) -> None:
    """Latency (p50 solid, p95 dashed) and throughput vs concurrency, one colour per endpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n, ep in enumerate(e["name"] for e in report["endpoints"]):
        rows = sorted((lv for lv in report["levels"] if lv["endpoint"] == ep), key=lambda lv: lv["concurrency"])
        xs = [lv["concurrency"] for lv in rows]
        color = f"C{n}"
        ax_lat.plot(
            xs,
            [lv["p50_ms"] if lv["p50_ms"] is not None else math.nan for lv in rows],
            "o-",
            color=color,
            label=f"{ep} p50",
        )
        ax_lat.plot(
            xs,
            [lv["p95_ms"] if lv["p95_ms"] is not None else math.nan for lv in rows],
            "s--",
            color=color,
            alpha=0.6,
            label=f"{ep} p95",
        )
        ax_thr.plot(xs, [lv["throughput_rps"] for lv in rows], "o-", color=color, label=ep)
    levels = sorted({lv["concurrency"] for lv in report["levels"]})
    for ax, title, unit in ((ax_lat, "latency", "ms"), (ax_thr, "throughput", "requests / s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"toolspec loadtest {report['stamp']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ driver


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="toolspec loadtest",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dataset", required=True, help="JSONL with messages + tools per line")
    p.add_argument("--limit", type=int, help="use only the first N dataset items")
    p.add_argument(
        "--endpoint",
        action="append",
        type=parse_endpoint,
        required=True,
        metavar="NAME=URL",
        help="OpenAI base URL (…/v1); repeat to compare side by side",
    )
    p.add_argument("--baseline", help="endpoint the others are compared with (default: the last)")
    p.add_argument("--model", help="model name sent in requests (default: first id of GET /v1/models)")
    p.add_argument("--concurrency", type=parse_levels, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    p.add_argument("--requests-per-level", type=int, default=32)
    p.add_argument("--max-seconds", type=float, default=300.0, help="time limit per endpoint x level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tool-choice", choices=["auto", "none", "required"], help="default: not sent")
    p.add_argument("--stream", action="store_true", help="stream (SSE) and measure time to first token")
    p.add_argument(
        "--no-stream-usage",
        dest="stream_usage",
        action="store_false",
        help="do not send stream_options.include_usage (count streamed chunks instead)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TOOLSPEC_API_KEY"),
        help="bearer token (default: $TOOLSPEC_API_KEY); never written to reports",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--warmup", type=int, default=0, help="unrecorded requests per endpoint first")
    p.add_argument(
        "--fresh-requests",
        action="store_true",
        help="each level (and the warm-up) uses different dataset items, so no request repeats",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT), help="directory for the reports")
    p.add_argument("--save-records", action="store_true", help="also write every request as JSONL")
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run clients as Ray tasks: 'auto', 'ray://host:10001', or 'local' (new local Ray)",
    )
    p.add_argument("--ray-tasks", type=int, help="client slices per level (default: alive nodes)")
    p.add_argument("--ray-task-cpus", type=float, default=1.0)
    p.add_argument("--ray-local-cpus", type=int, default=2, help="CPUs of the Ray started by --ray local")
    p.add_argument("--quiet", action="store_true")
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


def run_levels(args, items, endpoints, runner, log) -> tuple[list[dict], dict]:
    """Each level, each endpoint in turn on the same requests; summaries and raw records."""
    base_opts = {
        "max_tokens": args.max_tokens,
        "stream": args.stream,
        "api_key": args.api_key,
        "tool_choice": args.tool_choice,
        "timeout": args.timeout,
        "stream_usage": args.stream_usage,
    }
    for ep in endpoints if args.warmup else []:
        opts = dict(base_opts, model=ep["model"])
        run_level_local(ep["chat_url"], level_jobs(items, args.warmup), 1, args.max_seconds, opts)
    levels, records = [], {}
    for li, concurrency in enumerate(args.concurrency):
        # --fresh-requests: no request repeats across warm-up and levels, so a server that learns
        # from history (ToolSpec's call library) cannot replay answers it saw at an earlier level
        offset = (args.warmup + li * args.requests_per_level) if args.fresh_requests else 0
        jobs = level_jobs(items, args.requests_per_level, offset)
        for ep in endpoints:
            opts = dict(base_opts, model=ep["model"])
            level_runner = runner.run_level if runner else run_level_local
            result = level_runner(ep["chat_url"], jobs, concurrency, args.max_seconds, opts)
            lv = summarize(ep["name"], ep["url"], concurrency, result)
            levels.append(lv)
            records[(ep["name"], concurrency)] = result["records"]
            log(
                f"[loadtest] {ep['name']:>12s} c={concurrency:<3d} requests={lv['requests']} "
                f"errors={lv['errors']} p50={_fmt(lv['p50_ms'])}ms rps={_fmt(lv['throughput_rps'], 3)}"
            )
    return levels, records


def write_reports(report: dict, records: dict, out: Path, save_records: bool) -> list[str]:
    """loadtest-<stamp>.json/.md/.png (+ .records.jsonl); never overwrites an earlier run."""
    out.mkdir(parents=True, exist_ok=True)
    stem, n = out / f"loadtest-{report['stamp']}", 1
    while stem.with_suffix(".json").exists():
        n += 1
        stem = out / f"loadtest-{report['stamp']}-{n}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, stem.with_suffix(".md"))
    write_plot(report, stem.with_suffix(".png"))
    if save_records:
        with open(stem.with_suffix(".records.jsonl"), "w") as fh:
            for (ep, conc), recs in records.items():
                for r in recs:
                    fh.write(json.dumps(dict(r, endpoint=ep, concurrency=conc)) + "\n")
    return [str(stem.with_suffix(s)) for s in (".json", ".md", ".png")]


def run(args: argparse.Namespace) -> dict:
    """Execute the whole load test; returns the report dict (also written to disk)."""
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    items = load_items(args.dataset, args.limit)
    endpoints, baseline = resolve_endpoints(args)
    runner = RayRunner(args.ray, args.ray_tasks, args.ray_task_cpus, args.ray_local_cpus) if args.ray else None
    levels, records = run_levels(args, items, endpoints, runner, log)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "endpoint")}
    config["api_key"] = "set" if args.api_key else None
    now = dt.datetime.now()
    report = {
        "tool": "toolspec loadtest",
        "stamp": now.strftime("%Y%m%d-%H%M%S"),
        "created": now.isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "runner": f"ray ({args.ray}, {runner.tasks} slices)" if runner else "local asyncio",
        "config": config,
        "dataset_items": len(items),
        "endpoints": [{k: e[k] for k in ("name", "url", "model")} for e in endpoints],
        "baseline": baseline,
        "levels": levels,
        "speedup": compare(levels, records, baseline),
    }
    report["files"] = write_reports(report, records, Path(args.out), args.save_records)
    log(f"[loadtest] wrote {', '.join(report['files'])}")
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI entry (`toolspec loadtest`); 0 when the run completed, 2 on bad arguments."""
    try:
        args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
