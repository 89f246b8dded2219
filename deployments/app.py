"""Ray Serve application: ``Replica`` (OpenAI HTTP API + engine) -> ``Retrieval``, beside one ``Gate``.

Serve's HTTP proxy routes each request straight to an engine replica, which serves the OpenAI
routes itself (:func:`deployments.http.make_api` over its own engine): one Ray hop per request,
and Serve carries every SSE chunk the replica has ready in one message. What must be counted
across replicas -- per-key rate limits and the request metrics -- lives in the ``Gate``
deployment (one replica; :mod:`deployments.gate`).

``build_app(args)`` is the application builder (``serve run deployments.app:build_app`` and the
RayService ``import_path``): it validates :class:`~deployments.config.ServeAppConfig` once and
composes the deployments with handles. The ``Retrieval`` deployment is started only for a
method that drafts from the call library. With ``ingress: failover`` an ``Ingress`` deployment on
the head node is the HTTP entry instead, relaying each request to a replica so that a replica
lost mid-request costs a retry or a retryable error, not a 500 (:mod:`deployments.failover`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging

from ray import serve

from .config import ServeAppConfig
from .gate import GateServer
from .plan import check_plan
from .retrieval import RetrievalServer

log = logging.getLogger("toolspec.serve")

# how long a replica leaving gracefully waits for its library writes (Serve's default
# graceful_shutdown_timeout_s, 20 s, bounds the whole shutdown)
SHUTDOWN_ADDS_S = 10.0


@serve.deployment(name="Retrieval", max_ongoing_requests=256, health_check_period_s=5)
class Retrieval(RetrievalServer):
    """One owner of the call library; every engine replica asks it (time-bounded)."""

    def __init__(self, cfg: ServeAppConfig, dim: int):
        super().__init__(cfg.store_config(dim), cfg.retrieval)


@serve.deployment(name="Gate", num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class Gate(GateServer):
    """The app's per-key limits and request metrics, one count for every replica."""


class ReplicaServer:
    """Hosts the engine and serves the OpenAI routes on it (:func:`deployments.http.make_api`).
    Heavy start-up runs off the event loop; the app is built once the engine is up."""

    async def __init__(self, cfg: ServeAppConfig, retrieval=None, gate=None):
        from .engine_host import EngineHost
        from .retrieval import RetrievalClient

        client = RetrievalClient(retrieval, cfg.retrieval) if retrieval is not None else None
        self.cfg, self.gate, self._api = cfg, gate, None
        self.host = await asyncio.to_thread(EngineHost.build, cfg, client)

    def api(self):
        """The replica's one API app (built on first use)."""
        if self._api is None:
            from .gate import RemoteGate
            from .http import LocalBackend, make_api

            gate = RemoteGate(self.gate, self.host.replica_id) if self.gate is not None else None
            self._api = make_api(LocalBackend(self.host), self.cfg, gate=gate)
        return self._api

    def __del__(self):
        """Serve's graceful shutdown calls this on the replica's event loop once its requests have
        ended; the library writes of their calls may still be under way on that loop, so then it
        returns a coroutine (Serve awaits it) that gives them up to ``SHUTDOWN_ADDS_S`` before the
        engine closes. Called by the garbage collector, or with nothing left to write, it closes."""
        host = getattr(self, "host", None)
        if host is None or getattr(self, "_closed", False):
            return None
        self._closed = True
        retrieval = getattr(host, "retrieval", None)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            retrieval = None
        if retrieval is None or not retrieval.pending():
            host.close()
            return None
        return self._close_after_writes(host, retrieval)

    @staticmethod
    async def _close_after_writes(host, retrieval) -> None:
        await retrieval.drain(SHUTDOWN_ADDS_S)
        host.close()


@serve.deployment(name="Replica")
@serve.ingress()
class Replica(ReplicaServer):
    """``ingress: replica``: Serve's proxy calls the replica's API app directly."""

    def __serve_build_asgi_app__(self):
        return self.api()


@serve.deployment(name="Replica")
class RelayedReplica(ReplicaServer):
    """``ingress: failover``: the replica's API app, called by the ``Ingress`` deployment (one
    ASGI ingress per Serve app) through :meth:`asgi`."""

    async def asgi(self, scope: dict, body: bytes):
        """One HTTP request relayed by the ``Ingress``: the same app Serve's proxy would call,
        its ASGI messages streamed back in batches."""
        from .failover import run_asgi

        async for batch in run_asgi(self.api(), scope, body):
            yield batch


@serve.deployment(name="Ingress", max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    """``ingress: failover``: the app's HTTP entry on the head node, relaying each request to an
    engine replica and answering for a replica lost under it (:mod:`deployments.failover`)."""

    def __init__(self, cfg: ServeAppConfig, replica):
        self.cfg, self.replica = cfg, replica

    def __serve_build_asgi_app__(self):
        from .failover import FailoverApp

        cfg = self.cfg
        return FailoverApp(
            self.replica.options(stream=True), cfg.ingress_retries, cfg.ingress_retry_after_s, cfg.limits.body_bytes
        )


def retrieval_dim(cfg: ServeAppConfig) -> int:
    """Size of the library's vectors (``retrieval.key_dim``): the deployment's encoder, the
    lexical hash, or the target's hidden size."""
    from .retrieval import hidden_size, key_dim

    return key_dim(cfg.retrieval, hidden_size(cfg.model) if cfg.retrieval.concrete_key() == "hidden" else 0)


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


def uses_retrieval(cfg: ServeAppConfig) -> bool:
    """Whether the app runs the ``Retrieval`` deployment: retrieval is on and the method drafts
    from the call library (plain greedy, prompt lookup, ... never search it)."""
    from toolspec_core.drafters.methods import method_class

    return cfg.retrieval.enabled and method_class(cfg.method).uses_library


def build_app(args: dict | ServeAppConfig | None = None):
    """The Serve application for ``args`` (validated once, here)."""
    cfg = args if isinstance(args, ServeAppConfig) else ServeAppConfig.model_validate(dict(args or {}))
    check_plan(cfg)  # with gpu_memory set: the weights and one full context must fit (deployments/plan.py)
    check_method(cfg.method)
    retrieval = None
    if uses_retrieval(cfg):
        retrieval = Retrieval.options(
            num_replicas=cfg.retrieval.num_replicas, ray_actor_options=cfg.retrieval_actor_options()
        ).bind(cfg, retrieval_dim(cfg))
    gate = Gate.options(ray_actor_options=cfg.gate_actor_options()).bind(cfg)
    if cfg.ingress == "failover":
        replica = RelayedReplica.options(**cfg.deployment_options()).bind(cfg, retrieval, gate)
        return Ingress.options(ray_actor_options=cfg.ingress_actor_options()).bind(cfg, replica)
    return Replica.options(**cfg.deployment_options()).bind(cfg, retrieval, gate)
