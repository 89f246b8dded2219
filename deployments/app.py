"""Ray Serve application: ``Ingress`` (OpenAI HTTP API) -> ``Replica`` (engine) -> ``Retrieval``.

``build_app(args)`` is the application builder (``serve run deployments.app:build_app`` and the
RayService ``import_path``): it validates :class:`~deployments.config.ServeAppConfig` once and
composes the deployments with handles.
"""

from __future__ import annotations

import asyncio
import importlib
import logging

from ray import serve

from .config import ServeAppConfig
from .http import LocalBackend
from .plan import check_plan
from .retrieval import RetrievalServer

log = logging.getLogger("toolspec.serve")


@serve.deployment(name="Retrieval", max_ongoing_requests=256, health_check_period_s=5)
class Retrieval(RetrievalServer):
    """One owner of the call library; every engine replica asks it (time-bounded)."""

    def __init__(self, cfg: ServeAppConfig, dim: int):
        super().__init__(cfg.store_config(dim), cfg.retrieval)


@serve.deployment(name="Replica")
class Replica(LocalBackend):
    """Hosts the engine and answers the ingress's backend calls on it (``generate``, ``info`` and
    ``library`` as :class:`~deployments.http.LocalBackend` does). Heavy start-up runs off the event
    loop; requests stream events."""

    async def __init__(self, cfg: ServeAppConfig, retrieval=None):
        from .engine_host import EngineHost
        from .retrieval import RetrievalClient

        client = RetrievalClient(retrieval, cfg.retrieval) if retrieval is not None else None
        super().__init__(await asyncio.to_thread(EngineHost.build, cfg, client))

    async def stream(self, req: dict):
        """A generator method of its own: Serve streams only what a generator method yields."""
        async for ev in self.host.stream(req):
            yield ev

    def __del__(self):
        host = getattr(self, "host", None)
        if host is not None:
            host.close()


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """The OpenAI-compatible HTTP front; routes requests to engine replicas."""

    def __init__(self, replica, cfg: ServeAppConfig):
        from .http import HandleBackend

        self.backend, self.cfg = HandleBackend(replica), cfg

    def __serve_build_asgi_app__(self):
        from .http import make_api

        return make_api(self.backend, self.cfg)


def retrieval_dim(cfg: ServeAppConfig) -> int:
    """Size of the library's vectors (``retrieval.key_dim``): the deployment's encoder, the
    lexical hash, or the target's hidden size."""
    from .retrieval import hidden_size, key_dim

    return key_dim(cfg.retrieval, hidden_size(cfg.model) if cfg.retrieval.key == "hidden" else 0)


def check_method(name: str) -> None:
    """Fail at build time, with a clear message, when the method cannot be imported."""
    from toolspec_core.drafters.methods import REGISTRY

    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(REGISTRY)}")
    module, attr = REGISTRY[name].split(":")
    try:
        getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"method {name!r} is not available in this install ({exc}); pass method=pld or ar") from exc


def build_app(args: dict | ServeAppConfig | None = None):
    """The Serve application for ``args`` (validated once, here)."""
    cfg = args if isinstance(args, ServeAppConfig) else ServeAppConfig.model_validate(dict(args or {}))
    check_plan(cfg)  # with gpu_memory set: the weights and one full context must fit (deployments/plan.py)
    check_method(cfg.method)
    retrieval = None
    if cfg.retrieval.enabled:
        r = cfg.retrieval
        gpus = r.encoder.num_gpus if r.key in ("qwen", "hybrid") else 0
        retrieval = Retrieval.options(
            num_replicas=r.num_replicas,
            ray_actor_options={"num_cpus": r.num_cpus, "num_gpus": gpus, "resources": dict(r.resources)},
        ).bind(cfg, retrieval_dim(cfg))
    replica = Replica.options(**cfg.deployment_options()).bind(cfg, retrieval)
    return Ingress.options(
        max_ongoing_requests=max(64, 4 * cfg.max_ongoing_requests), ray_actor_options={"num_cpus": cfg.ingress_num_cpus}
    ).bind(replica, cfg)
