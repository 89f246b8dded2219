"""History-library store tests, for every backend.

Backends: ``memory``, ``edge`` (qdrant-edge-py, path), ``qdrant_local`` (qdrant-client path=) and
``qdrant_memory`` — qdrant-client's ``":memory:"`` location, which runs the *same* QdrantStore
code as the ``url=`` server backend (collection + payload-index creation, filters, order_by
eviction); no Qdrant server binary is available here, so the url transport itself is untested.
No model weights are loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from retrieval_service import (
    CallRecord,
    EdgeStore,
    MemoryStore,
    QdrantStore,
    RetrievalService,
    StoreConfig,
    StoreError,
    make_store,
    schema_hash,
)

ROOT = Path(__file__).resolve().parents[2]
DIM = 16
BACKENDS = ["memory", "edge", "qdrant_local", "qdrant_memory"]
PATH_BACKENDS = ["edge", "qdrant_local"]


def open_store(backend: str, root: Path, **limits):
    if backend == "memory":
        return MemoryStore(dim=DIM, **limits)
    if backend == "edge":
        return EdgeStore(str(root / "edge"), dim=DIM, **limits)
    if backend == "qdrant_local":
        return QdrantStore(path=str(root / "qdrant"), dim=DIM, **limits)
    return QdrantStore(location=":memory:", dim=DIM, **limits)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def store(backend, tmp_path):
    s = open_store(backend, tmp_path)
    yield s
    s.close()


def vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=DIM).astype(np.float32)


def rec(tenant="t1", tool="GetWeather", text=None, args=None, emb=None, created_at=None, seed=0) -> CallRecord:
    args = {"city": f"c{seed}"} if args is None else args
    return CallRecord(
        tenant=tenant,
        tool_name=tool,
        schema_hash="abc",
        text=text or json.dumps({"name": tool, "arguments": args}),
        token_ids=[1, 2, seed],
        arguments=args,
        embedding=vec(seed) if emb is None else emb,
        created_at=time.time() if created_at is None else created_at,
    )


# ----------------------------------------------------------------------------- write + search


def test_write_and_filtered_search(store):
    q = vec(0)
    store.add(rec(tool="GetWeather", seed=0, emb=q))
    store.add(rec(tool="GetWeather", seed=1, emb=q + 0.3 * vec(1)))
    store.add(rec(tool="BookHotel", seed=2, emb=q + 0.01 * vec(2)))
    assert store.count() == 3 and store.count("t1") == 3

    hits = store.search("t1", q, k=10)
    assert len(hits) == 3
    assert [h[1] for h in hits] == sorted((h[1] for h in hits), reverse=True)
    assert hits[0][0].arguments == {"city": "c0"} and hits[0][1] == pytest.approx(1.0, abs=1e-4)
    top = hits[0][0]
    assert (
        top.tenant == "t1" and top.tool_name == "GetWeather" and top.token_ids == [1, 2, 0] and top.schema_hash == "abc"
    )

    only = store.search("t1", q, tool_name="GetWeather", k=10)
    assert {r.tool_name for r, _ in only} == {"GetWeather"} and len(only) == 2
    both = store.search("t1", q, tool_name=["GetWeather", "BookHotel"], k=10)
    assert len(both) == 3
    assert store.search("t1", q, tool_name="Nope", k=10) == []
    assert len(store.search("t1", q, k=1)) == 1
    assert store.search("t1", q, k=0) == []


def test_same_call_upserts_one_record(store):
    assert store.add(rec(seed=0, created_at=1e9)) is True
    assert store.add(rec(seed=0, emb=vec(5))) is False  # same tenant/tool/schema/text -> same id, newer key
    assert store.count() == 1
    ((r, score),) = store.search("t1", vec(5), k=5)
    assert score == pytest.approx(1.0, abs=1e-4) and r.created_at > 1e9
    # a batch says how many of its records were new: the held one and a repeat within it are not
    assert store.add_many([rec(seed=0, emb=vec(5)), rec(seed=1), rec(seed=1), rec(tenant="t2", seed=0)]) == 2
    assert store.count() == 3


def test_bad_inputs(store):
    with pytest.raises(ValueError):
        store.search("", vec(0))
    with pytest.raises(ValueError):
        store.search("t1", np.zeros(DIM))
    with pytest.raises(ValueError):
        store.search("t1", np.ones(DIM + 1))
    with pytest.raises(ValueError):
        store.add(rec(emb=np.ones(DIM + 1)))
    with pytest.raises(ValueError):
        store.search("t1", vec(0), tool_name=[])
    assert store.count() == 0


# ----------------------------------------------------------------------------- tenants


def test_tenant_isolation_identical_embeddings(store):
    e = vec(7)
    for tenant in ("alice", "bob"):
        for i in range(3):
            store.add(rec(tenant=tenant, seed=i, emb=e, args={"secret": f"{tenant}-{i}"}))
    for tenant, other in (("alice", "bob"), ("bob", "alice")):
        hits = store.search(tenant, e, k=50)
        assert len(hits) == 3
        assert all(r.tenant == tenant and other not in json.dumps(r.arguments) for r, _ in hits)
        assert store.search(tenant, e, tool_name="GetWeather", k=50) and all(
            r.tenant == tenant for r, _ in store.search(tenant, e, tool_name="GetWeather")
        )
    assert store.search("carol", e, k=50) == []
    assert store.count("alice") == 3 and store.count() == 6
    assert store.delete_tenant("alice") == 3
    assert store.count("alice") == 0 and store.count("bob") == 3 and store.search("alice", e) == []


# ----------------------------------------------------------------------------- limits


def test_evict_by_size_on_add(backend, tmp_path):
    s = open_store(backend, tmp_path, max_records_per_tenant=3)
    t0 = time.time()
    for i in range(5):
        s.add(rec(seed=i, created_at=t0 + i))
    s.add(rec(tenant="t2", seed=0, created_at=t0 - 100))  # another tenant: its own budget
    assert s.count("t1") == 3 and s.count("t2") == 1
    kept = {r.arguments["city"] for r, _ in s.search("t1", vec(0), k=10)}
    assert kept == {"c2", "c3", "c4"}  # the two oldest went
    s.close()


def test_explicit_evict_size_and_age(backend, tmp_path):
    s = open_store(backend, tmp_path)
    now = time.time()
    for i in range(4):
        s.add(rec(seed=i, created_at=now - 1000 + i))  # old
        s.add(rec(tenant="t2", seed=10 + i, created_at=now - i))  # fresh
    assert s.evict() == 0  # no limits configured
    s.max_records_per_tenant, s.max_age_s = 2, 500.0
    assert s.evict(now=now) == 4 + 2  # t1: all too old; t2: 2 over the size limit
    assert s.count("t1") == 0 and s.count("t2") == 2
    assert {r.arguments["city"] for r, _ in s.search("t2", vec(10), k=10)} == {"c10", "c11"}
    s.close()


def test_evict_by_age_on_add_and_search_hides_expired(backend, tmp_path):
    s = open_store(backend, tmp_path, max_age_s=100.0, evict_every_s=0.0)
    now = time.time()
    s.add(rec(seed=1, created_at=now - 1000))  # already expired: evicted by its own add
    s.add(rec(seed=2, created_at=now))
    assert s.count() == 1
    s.close()

    s = open_store(backend, tmp_path / "throttled", max_age_s=100.0, evict_every_s=1e9)
    s.add(rec(seed=2, created_at=now))  # first add evicts (nothing) and starts the throttle window
    s.add(rec(seed=1, created_at=now - 1000))  # not evicted yet (throttled) ...
    assert s.count() == 2
    assert [r.arguments["city"] for r, _ in s.search("t1", vec(1), k=10)] == ["c2"]  # ... but never returned
    assert s.evict() == 1 and s.count() == 1
    s.close()


# ----------------------------------------------------------------------------- persistence

_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    sys.path.insert(0, {root!r})
    from retrieval_service import CallRecord, EdgeStore, QdrantStore
    backend, path, mode = sys.argv[1:4]
    dim = {dim}
    s = EdgeStore(path + "/edge", dim=dim) if backend == "edge" else QdrantStore(path=path + "/qdrant", dim=dim)
    q = np.random.default_rng(0).normal(size=dim).astype(np.float32)
    if mode == "read":
        hits = s.search("t1", q, k=10)
        print(json.dumps({{"count": s.count(), "hits": [dict(r.to_result(sc), tenant=r.tenant) for r, sc in hits]}}))
        s.close()
    else:  # write, then die without close()
        s.add(CallRecord(tenant="t1", tool_name="Child", text="child call", token_ids=[9], arguments={{"x": 1}}, embedding=q))
        sys.stdout.flush()
        os._exit(0)
    """
)


def _child(backend: str, path: Path, mode: str) -> dict | None:
    code = _CHILD.format(root=str(ROOT), dim=DIM)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code, backend, str(path), mode], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]) if mode == "read" else None


@pytest.mark.parametrize("backend", PATH_BACKENDS)
def test_persistence_across_processes(backend, tmp_path):
    s = open_store(backend, tmp_path)
    s.add(rec(seed=0, args={"city": "Paris"}, emb=vec(0)))
    s.add(rec(tenant="other", seed=0, emb=vec(0)))
    s.close()

    seen = _child(backend, tmp_path, "read")  # a new process opens the same path
    assert seen["count"] == 2
    (hit,) = seen["hits"]
    assert hit["tenant"] == "t1" and hit["arguments"] == {"city": "Paris"} and hit["token_ids"] == [1, 2, 0]
    assert hit["score"] == pytest.approx(1.0, abs=1e-4)

    _child(backend, tmp_path, "write")  # another process writes and exits without close()
    s = open_store(backend, tmp_path)
    assert s.count() == 3
    assert {r.text for r, _ in s.search("t1", vec(0), k=10)} == {rec(seed=0, args={"city": "Paris"}).text, "child call"}
    s.close()


# ----------------------------------------------------------------------------- service


def _service(backend: str, tmp_path: Path, **limits) -> RetrievalService:
    if backend == "qdrant_memory":
        return RetrievalService(StoreConfig(backend="memory", dim=DIM), store=open_store(backend, tmp_path, **limits))
    path = {"edge": tmp_path / "svc-edge", "qdrant_local": tmp_path / "svc-qdrant"}.get(backend)
    return RetrievalService(StoreConfig(backend=backend, dim=DIM, path=str(path) if path else None, **limits))


def test_service_no_remember_flag(backend, tmp_path):
    svc = _service(backend, tmp_path)
    args = dict(
        tool_name="Pay",
        schema_hash="h",
        text='{"name": "Pay"}',
        token_ids=[1],
        arguments={"card": "4111"},
        embedding=vec(0).tolist(),
    )
    assert svc.add("t1", remember=False, **args) is None
    assert svc.stats()["records"] == 0 and svc.stats()["not_remembered"] == 1
    assert svc.search("t1", vec(0).tolist()) == []
    rid = svc.add("t1", **args)
    assert isinstance(rid, str) and svc.stats()["records"] == 1
    svc.close()


def test_service_search_results_are_json(backend, tmp_path):
    svc = _service(backend, tmp_path)
    e = vec(3).tolist()
    svc.add(
        "t1", "GetWeather", "h1", '{"name": "GetWeather", "arguments": {"city": "Oslo"}}', [5, 6], {"city": "Oslo"}, e
    )
    svc.add("t1", "BookHotel", "h2", '{"name": "BookHotel", "arguments": {}}', [7], {}, e)
    svc.add("t2", "GetWeather", "h1", '{"name": "GetWeather", "arguments": {"city": "Rome"}}', [8], {"city": "Rome"}, e)
    out = svc.search("t1", e, tool_names=["GetWeather"], k=10)
    assert json.loads(json.dumps(out)) == out
    (r,) = out
    assert r["tool_name"] == "GetWeather" and r["arguments"] == {"city": "Oslo"} and r["token_ids"] == [5, 6]
    assert set(r) >= {"tool_name", "text", "token_ids", "arguments", "score"}
    assert len(svc.search("t1", e, tool_names=None, k=10)) == 2
    st = svc.stats()
    assert st["adds"] == 3 and st["searches"] == 2 and st["records"] == 3
    assert json.loads(json.dumps(st)) == st
    svc.close()


# ----------------------------------------------------------------------------- config / qdrant server path


def test_store_config_validation(tmp_path, monkeypatch):
    with pytest.raises(ValueError):
        StoreConfig(backend="qdrant_url")
    with pytest.raises(ValueError):
        StoreConfig(backend="memory", path="/x")
    with pytest.raises(ValueError):
        StoreConfig(backend="edge", url="http://x")
    with pytest.raises(ValueError):
        StoreConfig(backend="memory", max_records_per_tenant=0)
    with pytest.raises(ValueError):
        StoreConfig(backend="memory", collection="bad name")
    with pytest.raises(ValueError):
        StoreConfig(backend="memory", bogus=1)
    monkeypatch.setenv("TOOLSPEC_LIBRARY", str(tmp_path / "lib"))
    cfg = StoreConfig()
    assert cfg.backend == "edge" and cfg.path == str(tmp_path / "lib" / "edge")
    assert "api_key" not in repr(StoreConfig(backend="qdrant_url", url="http://q:6333", api_key="secret"))
    assert isinstance(make_store({"backend": "memory", "dim": 4}), MemoryStore)
    s = make_store(StoreConfig(backend="edge", path=str(tmp_path / "e"), dim=4, max_records_per_tenant=5))
    assert isinstance(s, EdgeStore) and s.max_records_per_tenant == 5
    s.close()


def test_qdrant_server_collection_and_filters():
    """The url backend's collection/index/filter building, run through qdrant-client ':memory:'."""
    s = QdrantStore(location=":memory:", dim=DIM, collection="calls")
    m = s.m
    params = s.collection_params()
    assert params["vectors_config"].size == DIM and params["vectors_config"].distance == m.Distance.COSINE
    assert params["hnsw_config"].m == 0 and params["hnsw_config"].payload_m > 0
    idx = dict(s.payload_indexes())
    assert idx["tenant"].is_tenant is True and set(idx) == {"tenant", "tool_name", "created_at"}
    f = s.build_filter("t1", ["A", "B"], min_created=5.0)
    assert [c.key for c in f.must] == ["tenant", "tool_name", "created_at"]
    assert f.must[0].match.value == "t1" and f.must[1].match.any == ["A", "B"] and f.must[2].range.gte == 5.0
    assert s.client.collection_exists("calls")
    assert s.client.get_collection("calls").config.params.vectors.size == DIM
    assert not s.is_server
    s.close()


@pytest.mark.parametrize("backend", PATH_BACKENDS)
def test_reopen_with_other_dim_fails_clearly(backend, tmp_path):
    open_store(backend, tmp_path).close()
    with pytest.raises(StoreError):
        (
            EdgeStore(str(tmp_path / "edge"), dim=DIM * 2)
            if backend == "edge"
            else QdrantStore(path=str(tmp_path / "qdrant"), dim=DIM * 2)
        )


def test_qdrant_local_path_is_single_writer(tmp_path):
    s = open_store("qdrant_local", tmp_path)
    with pytest.raises(StoreError):
        open_store("qdrant_local", tmp_path)
    s.close()


# ----------------------------------------------------------------------------- records


def test_schema_hash_is_stable_and_ignores_descriptions():
    tool = {
        "type": "function",
        "function": {
            "name": "F",
            "description": "d",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
    }
    h = schema_hash(tool)
    assert h == schema_hash(tool["function"]) and len(h) == 16
    assert h == schema_hash({"type": "function", "function": dict(tool["function"], description="other")})
    changed = json.loads(json.dumps(tool))
    changed["function"]["parameters"]["properties"]["a"]["type"] = "integer"
    assert schema_hash(changed) != h
    with pytest.raises(ValueError):
        schema_hash({"nope": 1})


def test_record_validation():
    r = rec()
    assert r.id and r.id == rec().id  # content-derived
    assert rec(tenant="t2").id != r.id
    with pytest.raises(ValueError):
        CallRecord(tenant="", tool_name="x", text="y")
    with pytest.raises(ValueError):
        CallRecord(id="not-a-uuid", tenant="t", tool_name="x", text="y")
    assert "embedding" not in r.payload() and "id" not in r.payload()


def test_package_imports_without_qdrant_or_torch():
    code = "import sys, retrieval_service; print([m for m in sys.modules if m.startswith('qdrant') or m == 'torch'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_service_add_many_warms_and_respects_remember(tmp_path):
    svc = RetrievalService(StoreConfig(backend="edge", path=str(tmp_path / "warm"), dim=DIM, max_records_per_tenant=2))
    calls = [
        dict(
            tool_name="T",
            schema_hash="h",
            text=f"call {i}",
            token_ids=[i],
            arguments={"i": i},
            embedding=vec(i).tolist(),
            created_at=float(i),
        )
        for i in range(3)
    ]
    calls.append(dict(calls[0], text="private", remember=False))
    assert svc.add_many("t1", calls) == 3
    st = svc.stats()
    assert st["records"] == 2 and st["not_remembered"] == 1 and st["adds"] == 3 and st["rewrites"] == 0
    svc.add_many("t1", calls[1:3])  # held: written again, not added
    assert (svc.stats()["adds"], svc.stats()["rewrites"]) == (3, 2)
    assert {r["text"] for r in svc.search("t1", vec(0).tolist())} == {"call 1", "call 2"}  # oldest evicted
    svc.close()
