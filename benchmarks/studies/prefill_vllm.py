"""Study: prefill rate of long tool prompts, ToolSpec against vLLM's CPU build. Result: benchmarks/results/measurements/prefill-vllm-*.json.

Where a long fresh prompt's first token goes: tokens a second of prefill on the load test's long
tool prompts (``--prompt-chars 2000:8000``: API-Bank, ToolAlpaca, BFCL v3), each prompt sent
once (no prefix-cache hit), alone.

* ``engine``: ToolSpec's prefill in this process (:func:`toolspec_core.engine.loop.prefill`), by
  torch thread count, the scheduler's 512-row chunks against the whole prompt at once, float32
  (GEMMs tuned as served) against bfloat16 (``--engine DTYPE:THREADS:CHUNK,...``), and the chat
  template + tokenization a prompt; the rest of the time to a first token over HTTP is the
  serving path's (Ray's hops, the replica's queue).
* ``server``: time to one output token over HTTP (``max_tokens`` 1, not streamed) from a server
  started fresh: ``toolspec`` (plain greedy, no retrieval: no drafting, no retrieval search, so
  only prefill and the serving path), ``vllm`` (its default thread placement: the model's
  threads on one core, the other left to its API server) and ``vllm+allcores`` (every core for
  its model). Prompt tokens from each server's usage.

The hardware line: a 0.5B model costs about 2 x 0.49e9 FLOP a prompt token (plus attention);
``--peak-gflops`` (default: cores x 3 GHz x 32 FP32 FLOP a cycle, AVX-512 on a double-pumped
256-bit unit) gives the ceiling a rate is set against.

    flock /tmp/toolspec-cpu.lock python -m benchmarks.studies.prefill_vllm --prompts 4 \\
        --out benchmarks/results/measurements/prefill-vllm-cpu-xeon-SHA.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

FLOP_PER_TOKEN = 2 * 0.494e9  # Qwen2.5-0.5B's parameters, tied embedding not multiplied
SERVERS = ("toolspec", "vllm", "vllm+allcores")


def long_prompts(n: int, span: tuple[int, int]) -> list[dict]:
    """The first ``n + 1`` requests of the load test's long-prompt workload (seed 0): the first is
    the warm-up."""
    from benchmarks.loadtest.workloads import default_datasets, load_workload

    units = load_workload("single", default_datasets("single"), None, 0, span)
    return [u[0] for u in units[: n + 1]]


ENGINE_CONFIGS = "float32:2:512,float32:2:4096,float32:1:512,bfloat16:2:512,bfloat16:2:4096"


def engine_rates(items: list[dict], configs: list[tuple[str, int, int]]) -> list[dict]:
    """Prefill tokens/s per (dtype, torch threads, chunk rows) configuration; one target per dtype."""
    import torch

    from benchmarks.data import prompt_ids
    from toolspec_core.engine.loop import prefill
    from toolspec_core.model.target import load_target

    rows = []
    for dtype in dict.fromkeys(d for d, _, _ in configs):
        target = load_target(dtype=getattr(torch, dtype))
        t0 = time.perf_counter()
        ids = [prompt_ids(target.tokenizer, it) for it in items]
        template_s = (time.perf_counter() - t0) / len(items)  # chat template + tokenization a prompt
        for _, threads, chunk in [c for c in configs if c[0] == dtype]:
            torch.set_num_threads(threads)
            prefill(target, ids[0], chunk=chunk)  # warm-up
            times = []
            for p in ids[1:]:
                t0 = time.perf_counter()
                prefill(target, p, chunk=chunk)
                times.append(time.perf_counter() - t0)
            tokens = sum(len(p) for p in ids[1:])
            row = {
                "part": "engine",
                "dtype": dtype,
                "threads": threads,
                "chunk": chunk,
                "tokens": tokens,
                "mean_prompt_tokens": tokens / len(times),
                "seconds": sum(times),
                "tokens_per_s": tokens / sum(times),
                "template_and_tokenize_s": template_s,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        del target
    return rows


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def server_rates(items: list[dict], servers: list[str], out_dir: str, port: int, vllm_port: int) -> list[dict]:
    from benchmarks.loadtest.client import build_payload
    from benchmarks.studies.loadtest_local import (
        VllmServer,
        app_config,
        base_config,
        vllm_app,
        vllm_missing,
        vllm_model_dir,
        vllm_venv,
    )
    from deployments.config import ServeAppConfig, served_name

    ns = argparse.Namespace(port=port, scripted_target=False, set=[])
    base = base_config(ns)
    served = served_name(ServeAppConfig.model_validate(base))
    rows = []
    for spec in servers:
        stop = None
        if spec.startswith("vllm"):
            why = vllm_missing(vllm_venv())
            if why:
                print(f"[prefill_vllm] skipping {spec}: {why}", flush=True)
                continue
            _, opts = vllm_app(spec)
            server = VllmServer(
                vllm_venv(), vllm_model_dir(base), vllm_port, served, opts, os.path.join(out_dir, "prefill-vllm.log")
            )
            server.wait_ready()
            url, stop = server.url, server.stop
        else:
            from deployments.cli import start_server, stop_server

            _, extra = app_config("toolspec=ar", "/nonexistent")
            cfg = ServeAppConfig.model_validate({**base, **extra, "route_prefix": "/toolspec"})
            url, stop = start_server(cfg, app_name="toolspec", quiet=True), stop_server
        try:
            chat = url + "/v1/chat/completions"
            opts = {"model": served, "max_tokens": 1, "stream": False}
            _post(chat, build_payload(items[0], opts))  # warm-up
            per = []
            for it in items[1:]:
                t0 = time.perf_counter()
                resp = _post(chat, build_payload(it, opts))
                per.append((resp["usage"]["prompt_tokens"], time.perf_counter() - t0))
            tokens, seconds = sum(p for p, _ in per), sum(s for _, s in per)
            row = {
                "part": "server",
                "server": spec,
                "tokens": tokens,
                "mean_prompt_tokens": tokens / len(per),
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "median_first_token_s": statistics.median(s for _, s in per),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6, help="prompts timed (one more is the warm-up)")
    ap.add_argument("--prompt-chars", default="2000:8000")
    ap.add_argument("--engine", default=ENGINE_CONFIGS, help="DTYPE:THREADS:CHUNK,... (empty: no engine part)")
    ap.add_argument("--servers", default=",".join(SERVERS), help="empty: no server part")
    ap.add_argument("--peak-gflops", type=float, default=None)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--vllm-port", type=int, default=8100)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch

    from benchmarks.cost import hardware_string

    low, _, high = args.prompt_chars.partition(":")
    items = long_prompts(args.prompts, (int(low), int(high)))
    cores = os.cpu_count() or 1
    peak = args.peak_gflops or cores * 3.0 * 32
    out = {
        "what": "prefill tokens/s of long fresh tool prompts, alone: ToolSpec's engine by threads/dtype/chunk, "
        "and time to one token over HTTP of ToolSpec (plain greedy, no retrieval) and vLLM (both placements)",
        "hardware": hardware_string("cpu"),
        "torch": torch.__version__,
        "items": [it["id"] for it in items[1:]],
        "peak_gflops_assumed": peak,
        "ceiling_tokens_per_s": peak * 1e9 / FLOP_PER_TOKEN,
        "rows": [],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    configs = [(d, int(t), int(c)) for d, t, c in (x.split(":") for x in args.engine.split(",") if x)]
    if configs:
        out["rows"] += engine_rates(items, configs)
        torch.set_num_threads(cores)
    servers = [s for s in args.servers.split(",") if s]
    if servers:
        out["rows"] += server_rates(items, servers, str(Path(args.out).parent), args.port, args.vllm_port)
    for row in out["rows"]:
        row["share_of_ceiling"] = row["tokens_per_s"] / out["ceiling_tokens_per_s"]
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
