"""The serving config's engine keys (deployments/config.py, engine_host.py, cli.py): ``dtype``
(``auto`` included), ``attention`` and ``cuda_graphs`` validated, given to the target, graphs
warmed when a replica starts (or turned off with one warning where no GPU is found), the
replica's start-up reported on /health and /metrics, and the first token's time on every
response."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from deployments import cli, engine_host
from deployments.config import ServeAppConfig
from deployments.engine_host import warm_grids, warm_replica_graphs
from toolspec_core.engine.scheduler import BatchLimits


def test_cuda_graphs_are_refused_where_they_cannot_run():
    with pytest.raises(ValidationError, match="cuda_graphs needs a GPU: device is cpu"):
        ServeAppConfig(cuda_graphs=True, device="cpu")
    with pytest.raises(ValidationError, match="attention per_sequence cannot use them"):
        ServeAppConfig(cuda_graphs=True, device="cuda", attention="per_sequence")
    with pytest.raises(ValidationError, match="scripted target runs no model"):
        ServeAppConfig(cuda_graphs=True, model="scripted")
    with pytest.raises(ValidationError, match="attention"):
        ServeAppConfig(attention="flash")
    ok = ServeAppConfig(cuda_graphs=True, device="cuda", attention="ragged", dtype="auto")
    assert (ok.cuda_graphs, ok.attention, ok.dtype) == (True, "ragged", "auto")
    assert ServeAppConfig(cuda_graphs=True).device == "auto"  # the replica decides (and falls back, logged)
    assert ServeAppConfig(cuda_graphs="true", cuda_graphs_warm_tokens="0").cuda_graphs is True  # `serve run` strings


def test_serve_flags_set_the_engine_keys_and_a_bad_config_is_one_clear_line(capsys):
    p = cli._parser("toolspec serve", "")
    cfg = cli.checked_config(
        p.parse_args(["--dtype", "auto", "--device", "cuda", "--attention", "ragged", "--cuda-graphs"]), "x"
    )
    assert (cfg.dtype, cfg.device, cfg.attention, cfg.cuda_graphs) == ("auto", "cuda", "ragged", True)
    assert cli.checked_config(p.parse_args(["--no-cuda-graphs"]), "x").cuda_graphs is False
    assert cli.checked_config(p.parse_args([]), "x").dtype == "float32"  # the config's own defaults stand
    # refused before anything starts (no Ray): exit 2 and the reason, no traceback
    assert cli.serve_main(["--cuda-graphs", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("toolspec serve: invalid config") and "cuda_graphs needs a GPU" in err
    assert "Traceback" not in err


def test_warm_grids_cover_the_batch_the_tree_and_the_first_kv_buckets():
    pool = SimpleNamespace(capacity_tokens=1 << 20, block_tokens=16)
    grids = warm_grids(BatchLimits(max_running=16, tree_rows=64), 2048, pool)
    assert len(grids) == 5 * 7 * 4  # B 1..16, rows 1..64, KV 256..2048
    assert (1, 1, 256) in grids and (16, 64, 2048) in grids and max(s for *_, s in grids) == 2048
    small = warm_grids(BatchLimits(max_running=3, tree_rows=5), 600, pool)
    assert {b for b, _, _ in small} == {1, 2, 4} and {n for _, n, _ in small} == {1, 2, 4, 8}
    assert {s for *_, s in small} == {256, 512, 1024}  # 1024 holds the 600th row
    assert warm_grids(BatchLimits(), 0, pool) == []
    tiny = SimpleNamespace(capacity_tokens=300, block_tokens=16)  # a pool below the next power of two
    assert {s for *_, s in warm_grids(BatchLimits(), 4096, tiny)} == {256, 300}


def test_a_graphed_replica_captures_its_shapes_at_start():
    captured = []
    target = SimpleNamespace(cuda_graphs=True, warm_graphs=lambda pool, grids: captured.extend(grids))
    pool = SimpleNamespace(capacity_tokens=4096, block_tokens=16)
    cfg = ServeAppConfig(cuda_graphs=True, device="cuda", cuda_graphs_warm_tokens=512)
    out = warm_replica_graphs(target, pool, cfg, BatchLimits(max_running=2, tree_rows=2))
    assert out == {"cuda_graphs": "on", "graph_shapes": 2 * 2 * 2} and len(captured) == 8
    assert warm_replica_graphs(SimpleNamespace(cuda_graphs=False), pool, ServeAppConfig(), BatchLimits()) == {
        "cuda_graphs": "off",
        "graph_shapes": 0,
    }


def test_a_replica_that_finds_no_gpu_runs_eager_and_says_why_once(tiny_model_dir, caplog, monkeypatch):
    """``device: auto`` with graphs on a machine without CUDA: the target loads without graphs,
    one warning says so, and the replica's start-up report (on /health) says it too."""
    from deployments.engine_host import EngineHost

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = ServeAppConfig(
        model=tiny_model_dir,
        device="auto",
        attention="ragged",
        cuda_graphs=True,
        method="ar",
        cost_model="none",
        retrieval={"enabled": False},
        kv_pool_tokens=4096,
    )
    with caplog.at_level(logging.INFO, logger="toolspec.serve"):
        host = EngineHost.build(cfg)
    try:
        assert host.target.cuda_graphs is False and host.target.attention_mode == "ragged"
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "cuda_graphs off" in r.message]
        assert len(warned) == 1 and "no CUDA device" in warned[0].message
        startup = host.info()["startup"]
        assert startup["cuda_graphs"] == "off (no CUDA device)" and startup["graph_shapes"] == 0
        assert startup["dtype"] == "float32" and startup["total_s"] >= startup["load_s"] > 0
        assert any("ready in" in r.message for r in caplog.records)
    finally:
        host.close()


def _scripted_host():
    from deployments.engine_host import EngineHost

    return EngineHost.build(
        ServeAppConfig(model="scripted", method="ar", cost_model="none", retrieval={"enabled": False})
    )


def test_startup_time_is_on_health_and_metrics_and_first_token_on_every_response():
    import httpx

    from deployments.http import LocalBackend, make_api

    host = _scripted_host()
    app = make_api(LocalBackend(host), host.cfg)
    body = {"model": host.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            health = (await http.get("/health")).json()
            metrics = (await http.get("/metrics")).text
            whole = (await http.post("/v1/chat/completions", json=body)).json()
            last = None
            async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        last = chunk.get("toolspec") or last
            return health, metrics, whole, last

    try:
        health, metrics, whole, streamed = asyncio.run(run())
    finally:
        host.close()
    startup = health["engine"]["startup"]
    assert startup["total_s"] > 0 and startup["cuda_graphs"] == "off"
    assert "toolspec_replica_startup_seconds{" in metrics
    for stats in (whole["toolspec"], streamed):
        assert 0 < stats["first_token_ms"] < 60_000 and "first_token_at" not in stats


def test_dtype_auto_is_bfloat16_where_the_cpu_computes_it(monkeypatch):
    from toolspec_core.model import target as target_mod
    from toolspec_core.model.target import resolve_dtype

    monkeypatch.setattr(target_mod, "cpu_has_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(target_mod, "cpu_has_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float32", "cuda") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16  # a plan made where no GPU is visible


def test_a_bfloat16_replica_loads_and_answers(tiny_model_dir):
    """``dtype: bfloat16`` on the CPU through the replica: a bf16 target (one-row linears padded,
    attention in float32) whose answer is the same as plain greedy's of the same target."""
    from deployments.engine_host import EngineHost
    from deployments.protocol import parse_request

    base = dict(model=tiny_model_dir, device="cpu", dtype="bfloat16", cost_model="none", kv_pool_tokens=4096)
    base["retrieval"] = {"enabled": False}
    body = {"messages": [{"role": "user", "content": "call the tool"}], "max_tokens": 24}
    texts = []
    for method in ("ar", "suffix"):
        host = EngineHost.build(ServeAppConfig(method=method, **base))
        try:
            assert host.target.dtype == torch.bfloat16 and host.info()["startup"]["dtype"] == "bfloat16"
            done = asyncio.run(host.generate(parse_request({**body, "model": host.name}, host.name, 4096)))
            texts.append((done.text, done.completion_tokens))
        finally:
            host.close()
    assert texts[0] == texts[1] and texts[0][1] > 0


def test_first_token_ms_is_taken_from_the_replicas_mark():
    from deployments.http import first_token_ms

    extra = {"first_token_at": 100.25}
    first_token_ms(extra, 100.0)
    assert extra == {"first_token_ms": 250.0}
    none = {"first_token_at": None}
    first_token_ms(none, 100.0)
    assert none == {"first_token_ms": None}
    first_token_ms(None, 1.0)  # a response without the field: nothing to do


def test_warm_graphs_of_a_tensor_parallel_target_are_the_ranks_own():
    group_target = SimpleNamespace(group=object(), cuda_graphs=False)
    cfg = ServeAppConfig(cuda_graphs=True, device="cuda")
    out = warm_replica_graphs(group_target, None, cfg, BatchLimits())
    assert out == {"cuda_graphs": "on the ranks, captured at first use", "graph_shapes": 0}
    assert engine_host.graphs_unusable(cfg, "cpu") is not None and engine_host.graphs_unusable(cfg, "cuda") is None


def test_graphs_that_cannot_be_captured_leave_the_replica_eager_with_one_warning(caplog):
    runner = SimpleNamespace(graphs=object())

    def fail(pool, grids):
        raise RuntimeError("operation not permitted when stream is capturing")

    target = SimpleNamespace(cuda_graphs=True, warm_graphs=fail, runner=lambda pool: runner)
    pool = SimpleNamespace(capacity_tokens=4096, block_tokens=16)
    with caplog.at_level(logging.WARNING, logger="toolspec.serve"):
        out = warm_replica_graphs(target, pool, ServeAppConfig(cuda_graphs=True, device="cuda"), BatchLimits())
    assert out == {"cuda_graphs": "off (capture failed: RuntimeError)", "graph_shapes": 0}
    assert target.cuda_graphs is False and runner.graphs is None
    assert [r.message for r in caplog.records if "cuda_graphs off" in r.message] == [
        "cuda_graphs off: capturing the decode steps failed (operation not permitted when stream is capturing); "
        "decode steps run eager"
    ]
