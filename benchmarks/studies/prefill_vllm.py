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
  started fresh, every one in ``--dtype`` (float32 by default): ``toolspec`` (plain greedy, no retrieval: no drafting, no retrieval search, so
  only prefill and the serving path), ``vllm`` (its default thread placement: the model's
  threads on one core, the other left to its API server) and ``vllm+allcores`` (every core for
  its model). Prompt tokens from each server's usage.

The hardware line: a prompt token costs 2 x 0.36e9 FLOP in the linears (the 0.5B model without its
embedding; plus ~5% attention), and torch's GEMM on the model's MLP shape, measured here per dtype
and thread count, is the ceiling a rate is set against (``ceiling_tokens_per_s``).

    flock /tmp/toolspec-cpu.lock python -m benchmarks.studies.prefill_vllm --prompts 4 \\
        --out benchmarks/results/measurements/prefill-vllm-cpu-HW-SHA.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

# Qwen2.5-0.5B's linears a prompt token goes through: 24 layers x (q, k, v, o, gate, up, down)
# = 24 x 896 x (896 + 128 + 128 + 896 + 3 x 4864); the embedding is a lookup and lm_head runs on
# the last row only. Attention adds ~4 x context x 896 x 24 FLOP (5% at 500 tokens of context).
FLOP_PER_TOKEN = 2 * 24 * 896 * (896 + 128 + 128 + 896 + 3 * 4864)
SERVERS = ("toolspec", "vllm", "vllm+allcores")


def long_prompts(n: int, span: tuple[int, int]) -> list[dict]:
    """The first ``n + 1`` requests of the load test's long-prompt workload (seed 0): the first is
    the warm-up."""
    from benchmarks.loadtest.workloads import default_datasets, load_workload

    units = load_workload("single", default_datasets("single"), None, 0, span)
    return [u[0] for u in units[: n + 1]]


ENGINE_CONFIGS = "float32:2:512,float32:2:4096,float32:1:512,bfloat16:2:512,bfloat16:2:4096"


def engine_rates(items: list[dict], configs: list[tuple[str, int, int]], rounds: int) -> list[dict]:
    """Prefill tokens/s per (dtype, torch threads, chunk rows) configuration, interleaved: every
    prompt runs under every configuration in turn, ``rounds`` times, so a machine shared with other
    work slows them alike; each configuration's rate is its median over prompts and rounds."""
    import torch

    from benchmarks.data import prompt_ids
    from toolspec_core.engine.loop import prefill
    from toolspec_core.model.cpu_linears import call_seconds
    from toolspec_core.model.target import load_target

    targets = {d: load_target(dtype=getattr(torch, d)) for d in dict.fromkeys(d for d, _, _ in configs)}
    tok = next(iter(targets.values())).tokenizer
    t0 = time.perf_counter()
    ids = [prompt_ids(tok, it) for it in items]
    template_s = (time.perf_counter() - t0) / len(items)  # chat template + tokenization, a prompt
    rates: dict[tuple, list[float]] = {c: [] for c in configs}
    for c in configs:  # warm-up: first calls of each shape and thread count
        torch.set_num_threads(c[1])
        prefill(targets[c[0]], ids[0], chunk=c[2])
    for _ in range(rounds):
        for p in ids[1:]:
            for c in configs:
                torch.set_num_threads(c[1])
                (seconds,) = call_seconds(lambda: prefill(targets[c[0]], p, chunk=c[2]), 1, warm=False)
                rates[c].append(len(p) / seconds)
    rows = []
    for (dtype, threads, chunk), r in rates.items():
        row = {
            "part": "engine",
            "dtype": dtype,
            "threads": threads,
            "chunk": chunk,
            "prompts": len(ids) - 1,
            "rounds": rounds,
            "mean_prompt_tokens": statistics.mean(len(p) for p in ids[1:]),
            "tokens_per_s": statistics.median(r),
            "tokens_per_s_min_max": [min(r), max(r)],
            "template_and_tokenize_s": template_s,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def gemm_gflops(threads: int, dtype: str, rows: int = 512, repeats: int = 20) -> float:
    """What torch's GEMM reaches here on the model's largest projection shape (MLP up/gate:
    [rows, 896] x [896, 4864]): the practical ceiling of a prompt's linears."""
    import torch

    from toolspec_core.model.cpu_linears import call_seconds

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    x, w = torch.randn(rows, 896, dtype=dt), torch.randn(4864, 896, dtype=dt)
    times = call_seconds(lambda: torch.nn.functional.linear(x, w), repeats)
    return 2 * rows * 896 * 4864 / statistics.median(times) / 1e9


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def server_rates(
    items: list[dict], servers: list[str], out_dir: str, port: int, vllm_port: int, dtype: str = "float32"
) -> list[dict]:
    from benchmarks.loadtest.client import build_payload
    from benchmarks.studies.loadtest_local import (
        VllmServer,
        app_config,
        base_config,
        vllm_app,
        vllm_dtype,
        vllm_missing,
        vllm_model_dir,
        vllm_venv,
    )
    from deployments.config import ServeAppConfig, served_name

    base = {**base_config(argparse.Namespace(port=port, scripted_target=False, set=[])), "dtype": dtype}
    served_dtype = vllm_dtype(base)  # ``auto`` resolved as a CPU replica resolves it
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
                vllm_venv(),
                vllm_model_dir(base),
                vllm_port,
                served,
                opts,
                os.path.join(out_dir, "prefill-vllm.log"),
                served_dtype,
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
                "dtype": served_dtype,
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
    ap.add_argument("--dtype", default="float32", help="server part: the dtype every server runs in (vLLM beside)")
    ap.add_argument("--rounds", type=int, default=2, help="engine part: times every prompt runs per configuration")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--vllm-port", type=int, default=8100)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch

    from benchmarks.cost import hardware_string

    low, _, high = args.prompt_chars.partition(":")
    items = long_prompts(args.prompts, (int(low), int(high)))
    cores = os.cpu_count() or 1
    out = {
        "what": "prefill tokens/s of long fresh tool prompts, alone: ToolSpec's engine by dtype/threads/chunk "
        "(interleaved, median), and time to one token over HTTP of ToolSpec (plain greedy, no retrieval) and "
        "vLLM (both placements); ceiling: torch's GEMM on the MLP shape / FLOP a token",
        "hardware": hardware_string("cpu"),
        "torch": torch.__version__,
        "items": [it["id"] for it in items[1:]],
        "flop_per_token": FLOP_PER_TOKEN,
        "rows": [],
    }
    configs = [(d, int(t), int(c)) for d, t, c in (x.split(":") for x in args.engine.split(",") if x)]
    ceilings = {}
    for dtype, threads in dict.fromkeys((d, t) for d, t, _ in configs) or [(args.dtype, cores)]:
        g = gemm_gflops(threads, dtype)
        ceilings[(dtype, threads)] = g * 1e9 / FLOP_PER_TOKEN
        out.setdefault("gemm", []).append(
            {"dtype": dtype, "threads": threads, "gflops": g, "ceiling_tokens_per_s": ceilings[(dtype, threads)]}
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if configs:
        out["rows"] += engine_rates(items, configs, args.rounds)
        torch.set_num_threads(cores)
    servers = [s for s in args.servers.split(",") if s]
    if servers:
        out["rows"] += server_rates(items, servers, str(Path(args.out).parent), args.port, args.vllm_port, args.dtype)
    best = ceilings.get(("float32", cores)) or max(ceilings.values())
    for row in out["rows"]:
        ceiling = ceilings.get((row.get("dtype", "float32"), row.get("threads", cores)), best)
        row["share_of_ceiling"] = row["tokens_per_s"] / ceiling
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
