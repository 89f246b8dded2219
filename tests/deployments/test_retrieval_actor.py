"""The Retrieval actor (``deployments.retrieval.RetrievalServer``) without a Serve cluster: its
batched encoder gives each caller its own key, the encoder's vectors are the same in every process,
tenants never see each other's calls, and one library is guaranteed by refusing several replicas
of a single-process store.

``@serve.batch`` keeps one batch queue per decorated function (so per class, not per instance),
bound to the event loop of its first call, and asks for the replica context when it is made: the
``batched`` fixture stands in for the replica context and gives each test a fresh queue.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import ValidationError

from deployments.config import EMBEDDED_ENCODER_LAYERS, RetrievalConfig, ServeAppConfig
from deployments.retrieval import RetrievalServer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "What's the weather like in Lima right now?\nTools: get_weather, get_time",
    "Book a table for two at 8pm\nTools: book_table",
    "convert 100 usd to eur",
    "Schedule a meeting with Ana tomorrow at 10 about the budget review\nTools: add_meeting, get_user_token",
    'factorial of 5\nTools: math.factorial\nCalls: math.factorial({"number": 4})',
    "Send an email to bob@example.com saying the report is late, and cc the whole finance team please",
]


def _queue_wrapper():
    return RetrievalServer._key_batch.set_max_batch_size.__self__  # serve.batch's per-class lazy queue


@pytest.fixture
def batched(monkeypatch):
    """``@serve.batch`` outside a replica: a stand-in replica context, and a fresh queue per test."""
    from ray import serve

    ctx = SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=256))
    monkeypatch.setattr(serve, "get_replica_context", lambda: ctx)
    wrapper = _queue_wrapper()
    wrapper._queue = None
    yield
    wrapper._queue = None


def _model(which: str, tiny_model_dir) -> str:
    from deployments.retrieval import encoder_dir

    return str(tiny_model_dir) if which == "tiny" else encoder_dir("embedded")


MODELS = ["tiny", pytest.param("embedded", marks=pytest.mark.slow)]


@pytest.mark.parametrize("which", MODELS)
def test_batching_returns_each_caller_its_own_key(which, tiny_model_dir, batched):
    cfg = RetrievalConfig(
        key="qwen",
        encoder={"model": _model(which, tiny_model_dir)},
        max_batch_size=len(TEXTS),
        batch_wait_timeout_s=0.2,
    )

    async def run():
        srv = RetrievalServer({"backend": "memory", "dim": 8}, cfg)  # the queue belongs to this loop
        keys = await asyncio.gather(*(srv.key_of(t) for t in TEXTS))
        return srv, keys

    srv, keys = asyncio.run(run())
    assert max(srv.batches) > 1 and sum(srv.batches) == len(TEXTS), srv.batches
    for text, key in zip(TEXTS, keys):
        alone = srv.keyer.encoder.encode([text])[0]  # the text encoded by itself
        assert np.asarray(key).shape == alone.shape
        assert np.abs(np.asarray(key, dtype=np.float32) - alone).max() < 1e-5, text
    # and the keys really differ between callers (no answer handed to the wrong one)
    assert all(np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3 for a, b in zip(keys, keys[1:]))


@pytest.mark.parametrize("which", MODELS)
def test_encoder_vectors_are_deterministic_across_processes(which, tiny_model_dir):
    import torch

    from retrieval_service.embedding import HFEmbedder

    model = _model(which, tiny_model_dir)
    threads = torch.get_num_threads()
    here = HFEmbedder(model).encode([TEXTS[0]])
    code = (
        "import hashlib, sys, torch\n"
        "torch.set_num_threads(int(sys.argv[3]))\n"
        "from retrieval_service.embedding import HFEmbedder\n"
        "v = HFEmbedder(sys.argv[1]).encode([sys.argv[2]])\n"
        "print(hashlib.sha256(v.tobytes()).hexdigest(), v.dtype, v.shape)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, model, TEXTS[0], str(threads)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    digest, dtype, _ = res.stdout.strip().splitlines()[-1].split(" ", 2)
    assert dtype == "float32" and digest == hashlib.sha256(here.tobytes()).hexdigest()


def test_tenant_filtering_holds_inside_the_store():
    srv = RetrievalServer({"backend": "memory", "dim": 1024}, RetrievalConfig(key="lexical"))
    text = TEXTS[0]

    async def run():
        async def add(tenant, city):
            return await srv.add(tenant, "get_weather", "h", f'{{"city": "{city}"}}', [1, 2], {"city": city}, text)

        await add("a", "Lima")
        await add("a/alice", "Quito")
        found = {}
        for tenant in ("a", "b", "a/alice", "a/bob", "b/alice"):
            found[tenant] = await srv.search(tenant, text, ["get_weather"], 10)
        return found

    found = asyncio.run(run())
    args = {t: [r["arguments"]["city"] for r in hits] for t, hits in found.items()}
    assert args["a"] == ["Lima"] and args["a/alice"] == ["Quito"]  # each finds its own
    assert args["b"] == [] and args["b/alice"] == []  # another tenant finds nothing
    assert args["a/bob"] == []  # a sibling user finds nothing of alice's (nor of the tenant's own)


@pytest.mark.parametrize("store", [{}, {"backend": "memory"}, {"backend": "edge"}])
def test_several_retrieval_replicas_need_a_server_store(store):
    with pytest.raises(ValidationError, match="num_replicas"):
        ServeAppConfig(retrieval={"num_replicas": 2, "store": store})
    ServeAppConfig(retrieval={"num_replicas": 1, "store": store})  # one replica is fine


def test_several_retrieval_replicas_with_qdrant_url():
    cfg = ServeAppConfig(qdrant_url="http://qdrant:6333", retrieval={"num_replicas": 2})
    assert cfg.store_config(896)["backend"] == "qdrant_url"
    ServeAppConfig(retrieval={"num_replicas": 2, "store": {"backend": "qdrant_url", "url": "http://qdrant:6333"}})
    with pytest.raises(ValidationError):
        ServeAppConfig(qdrant_url="http://qdrant:6333", retrieval={"num_replicas": 2, "store": {"backend": "memory"}})


def test_encoder_depth_is_its_own_vector_space(tiny_model_dir):
    """``encoder.layers``: the keyer's name (which names the collection) carries the depth, so a
    library keyed at one depth is never searched with vectors of another; 0 layers is refused."""
    from deployments.retrieval import make_keyer

    with pytest.raises(ValidationError):
        RetrievalConfig(encoder={"layers": 0})
    full = make_keyer(RetrievalConfig(encoder={"model": str(tiny_model_dir)}))
    cut = make_keyer(RetrievalConfig(encoder={"model": str(tiny_model_dir), "layers": 1}))
    assert full.name != cut.name and cut.name.endswith(":l1")
    assert full.dim == cut.dim
    # the embedded Qwen is read at its measured depth by default, any other model at its top
    assert RetrievalConfig().encoder.depth() == EMBEDDED_ENCODER_LAYERS
    assert RetrievalConfig(encoder={"model": str(tiny_model_dir)}).encoder.depth() is None
    assert RetrievalConfig(encoder={"layers": 24}).encoder.depth() == 24
