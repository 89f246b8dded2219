"""The pieces of a cluster load test that need no cluster: where the client actors go, the
per-node rows, the level cut into time buckets, and the resources each deployment asks for."""

from __future__ import annotations

import pytest

from benchmarks.loadtest.cluster import over_time
from benchmarks.loadtest.metrics import per_node
from benchmarks.loadtest.ray_clients import client_nodes

NODES = [
    {"NodeID": "head", "Alive": True, "Resources": {"CPU": 0.0}},
    {"NodeID": "w1", "Alive": True, "Resources": {"CPU": 2.0}},
    {"NodeID": "w2", "Alive": True, "Resources": {"CPU": 2.0}},
    {"NodeID": "gone", "Alive": False, "Resources": {"CPU": 2.0}},
]


def test_clients_go_to_every_alive_node_with_cpus_for_them():
    assert client_nodes(NODES, 2, None, 1.0) == ["w1", "w1", "w2", "w2"]
    assert client_nodes(NODES, None, None, 0.0) == ["head", "w1", "w2"]  # 0-CPU clients: the head too
    assert client_nodes(NODES, 5, 3, 1.0) == ["w1", "w2", "w1"]  # --ray-actors: dealt round robin
    with pytest.raises(ValueError, match="no alive node has 4 CPUs"):
        client_nodes(NODES, 1, None, 4.0)


def test_per_node_rows_add_up_to_the_level():
    recs = [
        {"node": "a", "ok": True, "error": None, "completion_tokens": 10},
        {"node": "a", "ok": False, "error": "stream_cut", "completion_tokens": None},
        {"node": "b", "ok": True, "error": None, "completion_tokens": 7},
        {"node": "b", "ok": False, "error": "http_500", "completion_tokens": None},
        {"node": "b", "ok": False, "error": "http_500", "completion_tokens": None},
    ]
    rows = per_node(recs)
    assert rows["a"] == {"requests": 2, "ok": 1, "errors": 1, "error_kinds": {"stream_cut": 1}, "completion_tokens": 10}
    assert rows["b"]["error_kinds"] == {"http_500": 2} and rows["b"]["completion_tokens"] == 7
    assert sum(r["requests"] for r in rows.values()) == len(recs)


def test_over_time_buckets_requests_by_when_they_ended_beside_the_replica_count():
    t0 = 1000.0
    recs = [
        {"started": t0 + 0.2, "e2e_ms": 500.0, "ok": True, "completion_tokens": 4},  # ends 0.7
        {"started": t0 + 0.5, "e2e_ms": 1000.0, "ok": True, "completion_tokens": 6},  # ends 1.5
        {"started": t0 + 1.1, "e2e_ms": 200.0, "ok": False, "completion_tokens": None},  # ends 1.3
        {"started": t0 + 1.2, "e2e_ms": 1500.0, "ok": True, "completion_tokens": 2},  # ends 2.7
    ]
    samples = [(t0 + 0.1, 1), (t0 + 1.4, 2), (t0 + 2.9, 1)]
    rows = over_time(recs, samples, t0, bucket_s=1.0)
    assert [r["t"] for r in rows] == [0.0, 1.0, 2.0]
    assert [r["replicas"] for r in rows] == [1, 2, 1]
    assert [(r["completed"], r["failed"]) for r in rows] == [(1, 0), (1, 1), (1, 0)]
    assert [r["output_tokens_per_s"] for r in rows] == [4.0, 6.0, 2.0]
    assert rows[0]["e2e_p50_ms"] == 500.0 and rows[2]["e2e_p50_ms"] == 1500.0


def test_a_tensor_parallel_replica_asks_for_its_whole_placement_group_and_its_resources():
    """A tp replica's placement group is packed on one node: the groups must offer its bundles'
    sum, and ``replica_resources`` go into bundle 0, where the replica's actor runs."""
    from deployments.config import ServeAppConfig
    from deployments.topology import NodeGroup, demands, fits, placement

    cfg = ServeAppConfig(
        device="cuda", tensor_parallel_size=4, replica_num_cpus=1, replica_resources={"replica": 1}, cost_model="none"
    )
    bundles = cfg.deployment_options()["placement_group_bundles"]
    assert bundles[0]["replica"] == 1 and all("replica" not in b for b in bundles[1:])
    need = demands(cfg)["Replica"]
    assert need["GPU"] == 4 and need["replica"] == 1
    eight = NodeGroup("gpu", 1, 32, 8, (("replica", 2.0),))
    assert fits(need, eight.offers()) == 2
    assert fits(need, NodeGroup("small", 1, 32, 2, (("replica", 2.0),)).offers()) == 0
    assert placement(cfg, [NodeGroup("head", 1, 0, head=True), eight])["Replica"] == ["gpu"]
