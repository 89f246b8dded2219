"""Clients on many nodes: Ray actors spread over the cluster, started together, records merged.

Each actor runs one client slice (schedule.run_slice) in its own process. For a level the driver
splits the sessions and the plan over the actors (schedule.split_plan), names a start time a
moment ahead, and every actor waits for it before its slice starts; clocks of different nodes
only shift that start a little, since every latency and every slice duration is measured on the
actor's own monotonic clock.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from .schedule import merge_slices, run_slice, split_plan

START_LEAD_S = 0.5


class LoadClient:
    """The body of one Ray actor: a client slice bound to the node it runs on. Its records name
    that node by its Ray node id, so a report can add the requests up per node."""

    def __init__(self) -> None:
        import ray

        self.node = ray.get_runtime_context().get_node_id()
        self.client = f"{ray.util.get_node_ip_address()}:{os.getpid()}"

    def where(self) -> dict:
        return {"node": self.node, "client": self.client}

    def run(self, url: str, sessions: list, plan: dict, opts: dict, start_at: float) -> dict:
        time.sleep(max(0.0, start_at - time.time()))
        return asyncio.run(run_slice(url, sessions, plan, dict(opts, node=self.node)))


def client_nodes(nodes: list[dict], clients_per_node: int | None, actors: int | None, actor_cpus: float) -> list[str]:
    """The node id of each client actor: ``clients_per_node`` (default 1) on every alive node with
    ``actor_cpus`` CPUs to give, or ``actors`` in all dealt round-robin over those nodes."""
    room = [n["NodeID"] for n in nodes if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= actor_cpus]
    if not room:
        raise ValueError(f"no alive node has {actor_cpus:g} CPUs for a load client (--ray-actor-cpus)")
    if actors:
        return [room[i % len(room)] for i in range(actors)]
    return [node for node in room for _ in range(clients_per_node or 1)]


class RayRunner:
    """Holds the client actors for the whole run (one Ray cluster connection, actors reused by
    levels), each pinned to its node (``client_nodes``)."""

    def __init__(
        self, address: str, clients_per_node: int | None, actors: int | None, actor_cpus: float, local_cpus: int | None
    ):
        import ray
        from ray import cloudpickle
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Ship this package's code by value: cluster nodes need httpx, not this exact checkout.
        cloudpickle.register_pickle_by_value(sys.modules[__package__])
        if not ray.is_initialized():
            if address == "local":
                ray.init(
                    address="local", num_cpus=local_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False
                )
            else:
                ray.init(address=address, log_to_driver=False)
        self.ray = ray
        remote_cls = ray.remote(LoadClient)
        self.actors = [
            remote_cls.options(
                num_cpus=actor_cpus,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote()
            for node in client_nodes(ray.nodes(), clients_per_node, actors, actor_cpus)
        ]
        self.clients = ray.get([a.where.remote() for a in self.actors])  # every actor is up before a level starts

    def run_level(self, url: str, sessions: list, plan: dict, opts: dict, on_done=None) -> dict:
        parts = split_plan(sessions, plan, len(self.actors))
        start_at = time.time() + START_LEAD_S
        refs = [a.run.remote(url, part, p, opts, start_at) for a, (part, p) in zip(self.actors, parts, strict=False)]
        merged = merge_slices(self.ray.get(refs))
        if on_done:
            for _ in merged["records"]:
                on_done()
        return merged

    def close(self) -> None:
        """End the client actors (the cluster and the connection stay)."""
        for a in self.actors:
            self.ray.kill(a)
