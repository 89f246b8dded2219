"""Where tensor-parallel workers run: the replica's placement group, and starting them in it.

A replica that drives TP workers reserves their resources together with its own through Ray
Serve's ``placement_group_bundles``: bundle 0 holds the replica and rank 0, bundle ``r`` rank
``r``; ``STRICT_PACK`` (the default) puts every bundle on one node, so the ranks share NVLink and
rendezvous on that node. An autoscaled replica is then placed only where all its GPUs are free,
never half. Outside Serve (tests, benchmarks) :func:`start_workers` makes the same group itself.
Every wait is bounded: a worker that cannot be placed fails the start with the resources it asked
for and what the cluster has, never a hang.
"""

from __future__ import annotations

import time

# a bundle must reserve something; a replica or worker that asks for nothing reserves this much CPU
MIN_BUNDLE_CPU = 0.01


def target_placement(tp_size: int, device: str, replica_num_gpus: float) -> str:
    """ "replica": the model lives in the replica's own process (CPU, or the replica's own GPU:
    the engine moves its inputs there and reads back one row per step -- the path measured on an
    H200); "workers": Ray actors own the model and KV caches (tensor parallel, or an accelerator the
    replica itself was not given), the replica keeps the engine's tensors on its CPU side."""
    if tp_size > 1:
        return "workers"
    if device == "cpu" or replica_num_gpus > 0:
        return "replica"
    return "workers"


def worker_gpus(tp_worker_num_gpus: float | None, device: str) -> float:
    """GPUs each worker reserves: as configured, else one on CUDA and none on CPU."""
    if tp_worker_num_gpus is not None:
        return tp_worker_num_gpus
    return 1.0 if device == "cuda" else 0.0


def worker_resources(num_cpus: float, num_gpus: float) -> dict[str, float]:
    return {"CPU": num_cpus, "GPU": num_gpus}


def placement_bundles(
    tp_size: int, replica_cpus: float, replica_gpus: float, worker_cpus: float, worker_gpus_each: float
) -> list[dict[str, float]]:
    """Bundles of a replica with ``tp_size`` workers: the replica and rank 0 share bundle 0."""
    first = {"CPU": max(replica_cpus + worker_cpus, MIN_BUNDLE_CPU)}
    rest = {"CPU": max(worker_cpus, MIN_BUNDLE_CPU)}
    if replica_gpus + worker_gpus_each:
        first["GPU"] = replica_gpus + worker_gpus_each
    if worker_gpus_each:
        rest["GPU"] = worker_gpus_each
    return [first] + [dict(rest) for _ in range(tp_size - 1)]


class PlacementError(RuntimeError):
    """Workers could not be placed (or started) within the timeout."""


def _describe(bundles: list[dict], strategy: str) -> str:
    import ray

    try:
        free = {k: round(v, 2) for k, v in ray.available_resources().items() if k in ("CPU", "GPU", "memory")}
        total = {k: round(v, 2) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    except Exception:  # the GCS is not answering: say what was asked
        free = total = {}
    return f"bundles {bundles} ({strategy}); cluster has {total} in all, {free} free"


def group_for_workers(tp_size: int, resources: dict[str, float], strategy: str, timeout_s: float):
    """The replica's own placement group when it runs in one (Serve made it from
    :func:`placement_bundles`), else a new group of one bundle per rank; rank r goes in bundle r."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.placement_group import placement_group

    pg = get_current_placement_group()
    if pg is not None:
        if len(pg.bundle_specs) < tp_size:
            raise PlacementError(
                f"the replica's placement group has {len(pg.bundle_specs)} bundles; tensor_parallel_size "
                f"{tp_size} needs one per rank (set placement_group_bundles from the app's config)"
            )
        return pg
    bundles = [
        {k: max(v, MIN_BUNDLE_CPU) if k == "CPU" else v for k, v in resources.items() if v or k == "CPU"}
        for _ in range(tp_size)
    ]
    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        raise PlacementError(
            f"no room for {tp_size} tensor-parallel workers within {timeout_s:.0f} s: {_describe(bundles, strategy)}"
        ) from None
    return pg


def wait_placed(workers: list, resources: dict[str, float], pg, timeout_s: float) -> None:
    """Return once every worker answers; else raise naming the ranks that never started."""
    import ray

    refs = [w.ping.remote() for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) == len(refs):
        ray.get(ready)  # a worker whose constructor failed raises here
        return
    late = [r for r, ref in enumerate(refs) if ref not in ready]
    bundles = [dict(b) for b in pg.bundle_specs]
    raise PlacementError(
        f"tensor-parallel worker rank(s) {late} not placed within {timeout_s:.0f} s: each needs {resources} "
        f"in its bundle of the replica's placement group; {_describe(bundles, 'placement group')}"
    )


def start_workers(worker_cls, args_of, tp_size: int, resources: dict[str, float], strategy: str, timeout_s: float):
    """Create ``tp_size`` worker actors of ``worker_cls`` (``args_of(rank)`` its arguments) in the
    placement group, rank ``r`` in bundle ``r``; wait until all run. Returns (workers, group,
    whether the group is ours to remove)."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    t0 = time.monotonic()
    own = get_current_placement_group() is None
    pg = group_for_workers(tp_size, resources, strategy, timeout_s)
    actor = ray.remote(num_cpus=resources["CPU"], num_gpus=resources["GPU"])(worker_cls)
    try:
        workers = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
            ).remote(*args_of(r))
            for r in range(tp_size)
        ]
    except ValueError as exc:  # Ray refuses at once a request no bundle of the group could ever hold
        if own:
            stop_workers([], pg)
        raise PlacementError(f"tensor-parallel workers cannot run in this placement group: {exc}") from None
    try:
        wait_placed(workers, resources, pg, max(1.0, timeout_s - (time.monotonic() - t0)))
    except Exception:
        stop_workers(workers, pg if own else None)
        raise
    return workers, pg, own


def stop_workers(workers: list, pg=None) -> None:
    import ray

    for w in workers:
        try:
            ray.kill(w)
        except Exception:
            pass
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(pg)
        except Exception:
            pass
