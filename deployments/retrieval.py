"""The shared call library as a deployment, and the replica-side client that never waits long.

``RetrievalServer`` wraps ``retrieval_service.RetrievalService`` (one store owner for every
replica). ``RetrievalClient`` lives in each engine replica: one time-bounded search per request,
a small local cache of results, fire-and-forget adds; when the deployment is slow or down the
request is served with schema-only drafting and a fallback is counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict

from .config import RetrievalConfig

log = logging.getLogger("toolspec.serve")


class RetrievalServer:
    """Body of the ``Retrieval`` deployment. Store calls run in a thread (they may do I/O)."""

    def __init__(self, store_config: dict):
        from retrieval_service.service import RetrievalService

        self.svc = RetrievalService(store_config)

    async def search(
        self, tenant: str, embedding: list[float], tool_names: list[str] | None = None, k: int = 10
    ) -> list[dict]:
        return await asyncio.to_thread(self.svc.search, tenant, embedding, tool_names, k)

    async def add(
        self,
        tenant: str,
        tool_name: str,
        schema_hash: str,
        text: str,
        token_ids: list[int],
        arguments: dict,
        embedding: list[float],
        remember: bool = True,
    ):
        return await asyncio.to_thread(
            self.svc.add, tenant, tool_name, schema_hash, text, token_ids, arguments, embedding, remember
        )

    async def stats(self) -> dict:
        return await asyncio.to_thread(self.svc.stats)

    async def forget_tenant(self, tenant: str) -> int:
        return await asyncio.to_thread(self.svc.forget_tenant, tenant)

    async def tenant_stats(self, tenant: str) -> dict:
        return await asyncio.to_thread(self.svc.tenant_stats, tenant)


def _digest(embedding) -> str:
    import numpy as np

    return hashlib.blake2b(np.asarray(embedding, dtype=np.float32).tobytes(), digest_size=12).hexdigest()


class RetrievalClient:
    """Replica-side access to the ``Retrieval`` deployment (a Serve handle or any object with
    async-callable ``search``/``add`` returning awaitables via ``.remote``)."""

    def __init__(self, handle, cfg: RetrievalConfig, ttl_s: float = 10.0):
        self.handle, self.cfg, self.ttl_s = handle, cfg, ttl_s
        self._exact: OrderedDict[tuple, tuple[float, list]] = OrderedDict()
        self._last: OrderedDict[tuple, list] = OrderedDict()
        self._tasks: set = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._counts = {
            "searches": 0,
            "ok": 0,
            "cache": 0,
            "fallback": 0,
            "timeouts": 0,
            "errors": 0,
            "adds": 0,
            "add_errors": 0,
        }

    def counters(self) -> dict:
        return dict(self._counts)

    def _remember(self, d: OrderedDict, key, value) -> None:
        if self.cfg.cache_entries <= 0:
            return
        d[key] = value
        d.move_to_end(key)
        while len(d) > self.cfg.cache_entries:
            d.popitem(last=False)

    async def search(self, tenant: str, embedding, tool_names: list[str]) -> tuple[list | None, dict]:
        """(results, info). Never raises: timeouts and errors fall back to cached results or none."""
        self.loop = asyncio.get_running_loop()
        self._counts["searches"] += 1
        names = tuple(sorted(tool_names))
        key = (tenant, names, _digest(embedding))
        hit = self._exact.get(key)
        if hit is not None and time.monotonic() - hit[0] < self.ttl_s:
            self._counts["cache"] += 1
            return hit[1], {"status": "cache", "hits": len(hit[1])}
        t0 = time.perf_counter()
        try:
            resp = self.handle.search.remote(
                tenant, [float(x) for x in embedding], list(tool_names) or None, self.cfg.top_k
            )
            results = await asyncio.wait_for(_awaitable(resp), self.cfg.timeout_s)
        except Exception as exc:  # timeout, dead replica, store error: serve without history
            timeout = isinstance(exc, (asyncio.TimeoutError, TimeoutError))
            self._counts["timeouts" if timeout else "errors"] += 1
            self._counts["fallback"] += 1
            cached = self._last.get((tenant, names))
            reason = "timeout" if timeout else type(exc).__name__
            log.info("retrieval fallback (%s)", reason)
            return (list(cached) if cached else []), {"status": "fallback", "reason": reason, "hits": len(cached or [])}
        self._counts["ok"] += 1
        self._remember(self._exact, key, (time.monotonic(), results))
        self._remember(self._last, (tenant, names), results)
        return results, {"status": "ok", "hits": len(results), "ms": 1e3 * (time.perf_counter() - t0)}

    async def forget_tenant(self, tenant: str) -> int:
        """Delete the tenant's (and its users') calls in the shared library; the search caches
        drop them too, so no later request of this replica drafts from them."""
        n = await _awaitable(self.handle.forget_tenant.remote(tenant))
        for cache in (self._exact, self._last):
            for key in [k for k in cache if k[0] == tenant or k[0].startswith(tenant + "/")]:
                del cache[key]
        return n

    async def tenant_stats(self, tenant: str) -> dict:
        return await _awaitable(self.handle.tenant_stats.remote(tenant))

    def add_nowait(self, **kwargs) -> None:
        """Send a completed call to the library without waiting (call on the event loop)."""
        task = asyncio.ensure_future(self._add(kwargs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, kwargs: dict) -> None:
        try:
            await asyncio.wait_for(_awaitable(self.handle.add.remote(**kwargs)), max(5.0, self.cfg.timeout_s))
            self._counts["adds"] += 1
        except Exception as exc:
            self._counts["add_errors"] += 1
            log.info("retrieval add dropped (%s)", type(exc).__name__)


async def _awaitable(resp):
    return await resp


class ServeLibrary:
    """The write side of ``toolspec_core.drafters.toolcall.library.CallLibrary`` over the client,
    callable from decode threads. Searches never go through it: the host runs one per request on
    the event loop (``EngineHost._retrieve``) and hands the drafter its results
    (``RequestInfo.retrieved``, never None when retrieval is on)."""

    def __init__(self, client: RetrievalClient, max_hashes: int = 4096):
        self.client = client
        self._hashes: OrderedDict[tuple, str] = OrderedDict()
        self.max_hashes = max_hashes

    def note_tools(self, tenant: str, tools: list[dict]) -> None:
        """Schema hashes of the request's tools, so stored calls can be checked against schemas."""
        from retrieval_service.records import schema_hash

        for t in tools:
            try:
                self._hashes[(tenant, t["function"]["name"])] = schema_hash(t)
            except (KeyError, ValueError, TypeError):
                continue
        while len(self._hashes) > self.max_hashes:
            self._hashes.popitem(last=False)

    def add(self, tenant: str, call, embedding, remember: bool = True) -> None:
        if not remember or embedding is None or self.client.loop is None:
            return
        kwargs = dict(
            tenant=tenant,
            tool_name=call.tool_name,
            schema_hash=self._hashes.get((tenant, call.tool_name), ""),
            text=call.text,
            token_ids=[int(t) for t in call.token_ids],
            arguments=dict(call.arguments or {}),
            embedding=[float(x) for x in embedding],
            remember=True,
        )
        self.client.loop.call_soon_threadsafe(lambda: self.client.add_nowait(**kwargs))
