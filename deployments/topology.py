"""Where each deployment may run: a RayService's node groups, the resources each deployment asks
for, and a local multi-node Ray cluster built from the same node groups.

One table of node groups (:class:`NodeGroup`: how many nodes, their Ray CPUs, GPUs and custom
resources) is read from a rendered RayService (:func:`node_groups`: the head group and every worker
group's ``rayStartParams``, as KubeRay passes them to ``ray start``), and the app's demands are read
from the options ``build_app`` gives each deployment (:func:`demands`). :func:`placement` says which
groups can host which deployment; the manifests' validator (k8s/k8s_validate.py) checks it, and
:func:`start_local_cluster` starts the same groups as raylets on this machine
(``ray.cluster_utils.Cluster``), so the tests and the cluster study place replicas exactly as the
overlay would. Custom resources, not Kubernetes node selectors, are what Ray places actors by: a
group that offers ``replica: 1`` takes one engine replica per node, a group that offers
``retrieval: 1`` takes the Retrieval deployment.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from .config import HEAD_RESOURCE, ServeAppConfig

# Ray's own resource names; everything else a node offers is a custom resource
CPU, GPU = "CPU", "GPU"


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    """Nodes of one shape: a KubeRay head or worker group, or the same group started locally."""

    name: str
    count: int  # nodes started (a worker group's ``replicas``)
    num_cpus: float
    num_gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()  # custom resources, sorted (hashable)
    head: bool = False
    max_count: int | None = None  # the most nodes KubeRay's autoscaler may start (``maxReplicas``)

    def offers(self) -> dict[str, float]:
        """What one node of the group offers Ray's scheduler (the head also Ray's own head resource)."""
        head = {HEAD_RESOURCE: 1.0} if self.head else {}
        return {CPU: self.num_cpus, GPU: self.num_gpus, **head, **dict(self.resources)}


def start_params(params: dict[str, Any] | None) -> tuple[float | None, float | None, dict[str, float]]:
    """(num-cpus, num-gpus, custom resources) of ``rayStartParams``. KubeRay passes ``resources``
    to ``ray start --resources`` as is, so the manifests quote its JSON once more."""
    params = params or {}
    cpus = float(params["num-cpus"]) if "num-cpus" in params else None
    gpus = float(params["num-gpus"]) if "num-gpus" in params else None
    raw = params.get("resources")
    resources: dict[str, float] = {}
    if raw:
        value = json.loads(raw)
        if isinstance(value, str):  # '"{\"retrieval\": 1}"': the quoted form
            value = json.loads(value)
        resources = {str(k): float(v) for k, v in value.items()}
    return cpus, gpus, resources


def _container_quantity(group: dict, key: str) -> float:
    res = group["template"]["spec"]["containers"][0].get("resources") or {}
    value = str((res.get("limits") or {}).get(key) or (res.get("requests") or {}).get(key) or 0)
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def _group(name: str, count: int, spec: dict, head: bool, max_count: int | None = None) -> NodeGroup:
    cpus, gpus, resources = start_params(spec.get("rayStartParams"))
    if cpus is None:  # what KubeRay passes to ray start: the container's CPU limit or request
        cpus = _container_quantity(spec, "cpu")
    if gpus is None:
        gpus = _container_quantity(spec, "nvidia.com/gpu")
    return NodeGroup(name, count, cpus, gpus, tuple(sorted(resources.items())), head, max_count or count)


def node_groups(rayservice: dict) -> list[NodeGroup]:
    """The head group and every worker group of a rendered RayService, at ``replicas`` nodes each."""
    rc = rayservice["spec"]["rayClusterConfig"]
    groups = [_group("head", 1, rc["headGroupSpec"], head=True)]
    for g in rc.get("workerGroupSpecs") or []:
        count = int(g.get("replicas", g.get("minReplicas", 1)))
        groups.append(_group(g["groupName"], count, g, False, int(g.get("maxReplicas", count))))
    return groups


def _demand(actor_options: dict) -> dict[str, float]:
    out = {CPU: float(actor_options.get("num_cpus", 1)), GPU: float(actor_options.get("num_gpus", 0) or 0)}
    out.update({k: float(v) for k, v in (actor_options.get("resources") or {}).items()})
    return out


def demands(cfg: ServeAppConfig) -> dict[str, dict[str, float]]:
    """What one actor of each deployment asks Ray for, read from the options ``build_app`` gives
    it. A tensor-parallel replica's placement group is packed on one node (STRICT_PACK): its
    bundles' sum."""
    from .app import uses_retrieval

    opts = cfg.deployment_options()
    if "placement_group_bundles" in opts:
        replica: dict[str, float] = {}
        for bundle in opts["placement_group_bundles"]:
            for k, v in bundle.items():
                replica[k] = replica.get(k, 0.0) + float(v)
        replica.setdefault(GPU, 0.0)
    else:
        replica = _demand(opts["ray_actor_options"])
    out = {"Replica": replica, "Gate": _demand(cfg.gate_actor_options())}
    if uses_retrieval(cfg):
        out["Retrieval"] = _demand(cfg.retrieval_actor_options())
    if cfg.ingress == "failover":
        out["Ingress"] = _demand(cfg.ingress_actor_options())
    return out


def fits(demand: dict[str, float], offer: dict[str, float]) -> int:
    """How many actors of ``demand`` one node offering ``offer`` holds (a large number when the
    demand is empty, as a 0-CPU actor's is)."""
    room = 1 << 30
    for key, need in demand.items():
        if need > 0:
            room = min(room, int(offer.get(key, 0.0) / need + 1e-9))
    return room


def placement(cfg: ServeAppConfig, groups: list[NodeGroup]) -> dict[str, list[str]]:
    """The groups whose nodes can hold each deployment's actor."""
    return {name: [g.name for g in groups if fits(d, g.offers())] for name, d in demands(cfg).items()}


def replica_room(cfg: ServeAppConfig, groups: list[NodeGroup], grown: bool = False) -> int:
    """Engine replicas the groups' nodes hold together (Serve's max_replicas must fit); ``grown``:
    with every group at its ``max_count`` nodes (what KubeRay's autoscaler may add)."""
    need = demands(cfg)["Replica"]
    return sum((g.max_count or g.count if grown else g.count) * fits(need, g.offers()) for g in groups)


def rayservice_args(rayservice: dict, overrides: dict | None = None) -> dict:
    """The ``build_app`` args of a rendered RayService's first application, ``overrides`` merged
    in (a dict value key by key, so ``{"retrieval": {"key": "lexical"}}`` keeps its resources; a
    None value removes the key)."""
    import yaml

    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    args = dict(serve["applications"][0].get("args") or {})
    for key, value in (overrides or {}).items():
        if value is None:
            args.pop(key, None)
        elif isinstance(value, dict) and isinstance(args.get(key), dict):
            args[key] = {**args[key], **value}
        else:
            args[key] = value
    return args


def rayservice_app_config(rayservice: dict, overrides: dict | None = None) -> ServeAppConfig:
    """The ``ServeAppConfig`` of :func:`rayservice_args`."""
    return ServeAppConfig.model_validate(rayservice_args(rayservice, overrides))


class LocalCluster:
    """A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), one raylet per
    node of each :class:`NodeGroup`. It knows which group each node belongs to, so a test can ask
    where Serve put a deployment's actors and remove (kill) a group's node."""

    def __init__(self, groups: list[NodeGroup], object_store_mb: int = 80, env: dict[str, str] | None = None):
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self._saved_env = {key: os.environ.get(key) for key in env or {}}
        os.environ.update(env or {})  # the raylets and their workers inherit them (restored at shutdown)
        from ray.cluster_utils import Cluster

        head = next(g for g in groups if g.head)
        self.groups = {g.name: g for g in groups}
        self.cluster = Cluster(
            initialize_head=True, head_node_args={**self._node_args(head, object_store_mb), "include_dashboard": False}
        )
        self.members: dict[str, list] = {head.name: [self.cluster.head_node]}
        for g in groups:
            if not g.head:
                for _ in range(g.count):
                    self.add_node(g.name, object_store_mb)

    @staticmethod
    def _node_args(g: NodeGroup, object_store_mb: int) -> dict:
        return {
            "num_cpus": g.num_cpus,
            "num_gpus": g.num_gpus,
            "resources": dict(g.resources),
            "object_store_memory": object_store_mb * 2**20,
        }

    @property
    def address(self) -> str:
        """The GCS address a driver connects to (``ray.init(address=...)``, ``toolspec serve --address``)."""
        return self.cluster.address

    def connect(self) -> None:
        self.cluster.connect()

    def add_node(self, group: str, object_store_mb: int = 80):
        node = self.cluster.add_node(**self._node_args(self.groups[group], object_store_mb))
        self.members.setdefault(group, []).append(node)
        return node

    def remove_node(self, node) -> None:
        """Kill a worker node's raylet and every process on it, as a lost machine would."""
        self.cluster.remove_node(node, allow_graceful=False)
        for nodes in self.members.values():
            if node in nodes:
                nodes.remove(node)

    def group_of(self, node_id: str) -> str | None:
        for name, nodes in self.members.items():
            if any(n.node_id == node_id for n in nodes):
                return name
        return None

    def node(self, node_id: str):
        return next((n for nodes in self.members.values() for n in nodes if n.node_id == node_id), None)

    def actors(self, prefix: str = "") -> list[dict]:
        """Live named actors whose name starts with ``prefix``: [{"name", "node_id", "group",
        "pid"}], read from the GCS's actor table (no dashboard needed)."""
        out = []
        for a in self.cluster.global_state.actor_table(None).values():
            name = a.get("Name") or ""
            if a.get("State") == "ALIVE" and name and name.startswith(prefix):
                node_id = a["Address"]["NodeID"]
                out.append({"name": name, "node_id": node_id, "group": self.group_of(node_id), "pid": a.get("Pid")})
        return out

    def serve_actors(self, app: str) -> dict[str, list[dict]]:
        """The live replica actors of each deployment of Serve app ``app`` (see :meth:`actors`)."""
        out: dict[str, list[dict]] = {}
        for a in self.actors(f"SERVE_REPLICA::{app}#"):
            out.setdefault(a["name"].split("#")[1], []).append(a)
        return out

    def shutdown(self) -> None:
        """End Serve, the driver's connection and every node."""
        import ray

        try:
            if ray.is_initialized():
                from ray import serve

                serve.shutdown()
        finally:
            ray.shutdown()
            self.cluster.shutdown()
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
