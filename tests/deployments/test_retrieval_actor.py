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


# one completed call as a replica sends it to the library (tenant "t")
CALL = dict(tenant="t", tool_name="get_weather", schema_hash="h", text='{"city": "Lima"}', token_ids=[1, 2])
CALL.update(arguments={"city": "Lima"}, embedding=TEXTS[0], remember=True)


class _FlakyHandle:
    """A Serve handle stand-in over a RetrievalServer whose ``add`` first fails ``fail`` times the
    way a lost or restarting replica does, and then takes ``slow_s`` to answer."""

    def __init__(self, server, fail: int = 0, slow_s: float = 0.0, error=ConnectionError, landed: bool = False):
        self.server, self.fail, self.slow_s, self.error, self.sent = server, fail, slow_s, error, 0
        outer = self

        class _Add:
            def remote(self, **kw):
                async def call():
                    outer.sent += 1
                    if outer.fail > 0:
                        outer.fail -= 1
                        if landed:  # the write reached the store, its answer was lost on the way back
                            await outer.server.add(**kw)
                        raise outer.error("replica unavailable")
                    await asyncio.sleep(outer.slow_s)
                    return await outer.server.add(**kw)

                return call()

        self.add = _Add()


def _client_add(handle, cfg: RetrievalConfig, tenant: str = "t"):
    """One completed call through ``RetrievalClient.add_nowait``, waited for; the client's counters."""
    from deployments.retrieval import RetrievalClient

    client = RetrievalClient(handle, cfg)
    kw = {**CALL, "tenant": tenant}

    async def run():
        client.add_nowait(**kw)
        while client._tasks:
            await asyncio.gather(*client._tasks)
        return client.counters()

    return asyncio.run(run())


def test_a_library_write_outlives_a_slow_or_lost_retrieval_replica():
    """A completed call's write is nobody's wait: one slower than a search's ``timeout_s`` is waited
    for (not cut off at it), one the deployment lost on the way goes again after a backoff, each
    stored once; a write the store refuses is not sent again, and one past ``add_deadline_s`` is
    dropped and counted."""
    cfg = RetrievalConfig(key="lexical", timeout_s=0.05, add_deadline_s=5.0)

    def server():
        return RetrievalServer({"backend": "memory", "dim": 1024}, cfg)

    slow = _FlakyHandle(server(), slow_s=0.3)  # 6x the search bound
    counts = _client_add(slow, cfg)
    assert counts["adds"] == 1 and counts["add_errors"] == 0 and counts["adds_pending"] == 0
    assert slow.server.svc.tenant_stats("t")["records"] == 1 and slow.sent == 1

    lost = _FlakyHandle(server(), fail=2)
    counts = _client_add(lost, cfg)
    assert (counts["adds"], counts["add_retries"], counts["add_errors"]) == (1, 2, 0)
    assert lost.server.svc.tenant_stats("t")["records"] == 1 and lost.sent == 3
    lib = lost.server.svc.stats()
    assert (lib["adds"], lib["resends"], lib["resends_held"], lib["rewrites"]) == (1, 1, 0, 0)

    # a try that landed but whose answer was lost: sent again, one record, and the library counts
    # the second write as a resend that found its call held -- not as the call written twice
    landed = _FlakyHandle(server(), fail=1, landed=True)
    counts = _client_add(landed, cfg)
    assert (counts["adds"], counts["add_retries"]) == (1, 1) and landed.sent == 2
    lib = landed.server.svc.stats()
    assert lib["records"] == 1 and (lib["adds"], lib["resends"], lib["resends_held"], lib["rewrites"]) == (1, 1, 1, 0)
    _client_add(landed, cfg)  # the same call written again on a first try: a rewrite
    assert landed.server.svc.stats()["rewrites"] == 1

    refused = _FlakyHandle(server(), fail=5, error=ValueError)
    counts = _client_add(refused, cfg)
    assert (counts["adds"], counts["add_retries"], counts["add_errors"]) == (0, 0, 1) and refused.sent == 1

    late = _FlakyHandle(server(), slow_s=1.0)
    counts = _client_add(late, RetrievalConfig(key="lexical", add_deadline_s=0.2))
    assert (counts["adds"], counts["add_errors"]) == (0, 1)


def test_a_replica_leaving_gracefully_lets_its_library_writes_finish():
    """Serve's graceful shutdown calls the replica's ``__del__`` on its event loop once its requests
    have ended: with a write still under way it returns a coroutine (Serve awaits it) that lets the
    write land before the engine closes; with none, or outside a loop (the garbage collector), it
    closes at once, and only once."""
    from deployments.app import ReplicaServer
    from deployments.retrieval import RetrievalClient

    cfg = RetrievalConfig(key="lexical")
    handle = _FlakyHandle(RetrievalServer({"backend": "memory", "dim": 1024}, cfg), slow_s=0.3)

    class Host:
        def __init__(self, retrieval):
            self.retrieval, self.closed, self.stored_at_close = retrieval, 0, None

        def close(self):
            self.closed += 1
            self.stored_at_close = handle.server.svc.tenant_stats("t")["records"]

    def replica(host):
        r = object.__new__(ReplicaServer)
        r.host = host
        return r

    async def leave():
        client = RetrievalClient(handle, cfg)
        host = Host(client)
        client.add_nowait(**CALL)
        r = replica(host)
        pending = r.__del__()
        assert pending is not None and host.closed == 0  # Serve awaits it
        await pending
        assert r.__del__() is None  # once
        return host

    host = asyncio.run(leave())
    assert host.closed == 1 and host.stored_at_close == 1

    idle = Host(RetrievalClient(handle, cfg))
    assert replica(idle).__del__() is None and idle.closed == 1  # outside a loop: closed at once


@pytest.mark.parametrize(
    "target,encoder,dedicated,model,want",
    [
        ("cpu", "cpu", False, "embedded", "hidden"),  # the encoder would share the CPU target's cores
        ("cpu", "cuda", False, "embedded", "qwen"),  # the encoder on a GPU of its own
        ("cpu", "cpu", True, "embedded", "qwen"),  # the deployment placed on its own node group
        ("cuda", "cpu", False, "embedded", "qwen"),  # the target's forward on a GPU
        ("cpu", "cpu", False, "scripted", "qwen"),  # no model to take a hidden state from
    ],
)
def test_auto_key_is_hidden_only_where_the_encoder_shares_a_cpu_targets_cores(target, encoder, dedicated, model, want):
    from deployments.config import resolve_key

    assert resolve_key("auto", target, encoder, dedicated, model) == want
    for key in ("qwen", "hybrid", "lexical", "hidden"):  # a key written out is kept
        assert resolve_key(key, target, encoder, dedicated, model) == key


def test_app_config_resolves_the_auto_key():
    """The app's config is validated with ``auto`` resolved (no cluster here: ``device: auto`` is a
    CPU), so the Retrieval deployment, its actor options and the replicas see one concrete key; a
    retrieval config alone, with no target, keys text (``qwen``)."""
    assert RetrievalConfig().key == "auto" and RetrievalConfig().text_key()
    assert ServeAppConfig().retrieval.key == "hidden" and not ServeAppConfig().retrieval.text_key()
    assert ServeAppConfig(device="cuda").retrieval.key == "qwen"
    gpu_encoder = ServeAppConfig(retrieval={"encoder": {"device": "cuda", "num_gpus": 0.25}})
    assert gpu_encoder.retrieval.key == "qwen" and gpu_encoder.retrieval_actor_options()["num_gpus"] == 0.25
    assert ServeAppConfig(retrieval={"resources": {"retrieval": 1}}).retrieval.key == "qwen"
    assert ServeAppConfig(retrieval={"key": "qwen"}).retrieval.key == "qwen"
    from deployments.retrieval import RetrievalClient

    assert RetrievalClient(None, ServeAppConfig().retrieval).counters()["key"] == "hidden"  # /health says which


def test_each_key_space_has_its_own_collection():
    """A library kept on disk is searched only with vectors of the space it was filled in: the
    embedded encoder's and the embedded target's vectors are both 896 wide, so the store's dim
    check alone would not tell them apart. The Qwen key keeps the store's default collection."""
    from retrieval_service.store import StoreConfig

    def collection(**kw):
        return StoreConfig(**ServeAppConfig(**kw).store_config(896)).collection

    qwen = collection(retrieval={"key": "qwen"})
    hidden = collection(retrieval={"key": "hidden"})
    other = collection(retrieval={"key": "hidden"}, model="/models/Qwen2.5-72B-Instruct")
    assert qwen == StoreConfig().collection
    assert len({qwen, hidden, other, collection(retrieval={"key": "lexical"})}) == 4
    assert collection() == hidden  # auto on this CPU
    named = {"key": "hidden", "store": {"collection": "mine"}}
    assert collection(retrieval=named) == "mine"  # a collection the config names is kept
