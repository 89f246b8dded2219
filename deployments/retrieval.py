"""The shared call library as a deployment, and the replica-side client that never waits long.

``RetrievalServer`` wraps ``retrieval_service.RetrievalService`` (one store owner for every
replica). ``RetrievalClient`` lives in each engine replica: one time-bounded search per request,
a small local cache of results, adds nobody waits for; when the deployment is slow or down the
request is served with schema-only drafting and a fallback is counted, and a completed call's add
waits or goes again until the deployment takes it (``RetrievalConfig.add_deadline_s``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict

from ray import serve

from .config import EncoderConfig, RetrievalConfig

log = logging.getLogger("toolspec.serve")


class RetrievalServer:
    """Body of the ``Retrieval`` deployment: the store's one owner, and with a text key its
    encoder. A key arrives as a vector (``hidden``: the replica's own) or as the request's text,
    which is keyed here (:class:`retrieval_service.keys.TextKeyer`): the texts of concurrent
    queries from every replica are embedded together, up to ``max_batch_size`` per forward
    (``@serve.batch``). Store calls and the encoder run in threads (I/O, a model forward)."""

    def __init__(self, store_config: dict, cfg: RetrievalConfig | None = None):
        from retrieval_service.service import RetrievalService

        self.svc = RetrievalService(store_config)
        self.keyer = None
        if cfg is not None and cfg.text_key():
            self.keyer = make_keyer(cfg)
            self._key_batch.set_max_batch_size(cfg.max_batch_size)
            self._key_batch.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)
        self.batches: list[int] = []  # sizes of the last encoder batches (what /stats reports)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _key_batch(self, texts: list[str]) -> list[list[float]]:
        self.batches = (self.batches + [len(texts)])[-256:]
        keys = await asyncio.to_thread(self.keyer.keys, texts)
        return [k.tolist() for k in keys]

    async def key_of(self, key) -> list[float]:
        """The store vector of a key: a vector as sent, or a text keyed by this deployment."""
        if not isinstance(key, str):
            return key
        if self.keyer is None:
            raise ValueError("this library is keyed by vectors (retrieval.key hidden); a text key was sent")
        if self.keyer.encoder is None:  # lexical: hashing, nothing to batch
            return self.keyer.key(key).tolist()
        return await self._key_batch(key)

    async def search(self, tenant: str, key, tool_names: list[str] | None = None, k: int = 10) -> list[dict]:
        vec = await self.key_of(key)
        return await asyncio.to_thread(self.svc.search, tenant, vec, tool_names, k)

    async def add(
        self,
        tenant: str,
        tool_name: str,
        schema_hash: str,
        text: str,
        token_ids: list[int],
        arguments: dict,
        embedding,
        remember: bool = True,
        attempt: int = 0,
    ):
        vec = await self.key_of(embedding)
        return await asyncio.to_thread(
            self.svc.add, tenant, tool_name, schema_hash, text, token_ids, arguments, vec, remember, attempt
        )

    async def stats(self) -> dict:
        out = await asyncio.to_thread(self.svc.stats)
        if self.keyer is not None:
            out["key"] = self.keyer.name
            out["encoder_batches"] = {"count": len(self.batches), "max": max(self.batches, default=0)}
        return out

    async def forget_tenant(self, tenant: str) -> int:
        return await asyncio.to_thread(self.svc.forget_tenant, tenant)

    async def tenant_stats(self, tenant: str) -> dict:
        return await asyncio.to_thread(self.svc.tenant_stats, tenant)


def make_keyer(cfg: RetrievalConfig):
    """The text keyer of a retrieval config (loads the encoder unless the key is lexical)."""
    from retrieval_service.keys import TextKeyer

    key = cfg.concrete_key()
    return TextKeyer(key, None if key == "lexical" else build_encoder(cfg.encoder), cfg.lexical_dim)


def build_encoder(e: EncoderConfig):
    """The ``HFEmbedder`` an encoder config describes (loads the model)."""
    from retrieval_service.embedding import HFEmbedder

    return HFEmbedder(encoder_dir(e.model), e.pooling, e.max_length, e.prefix, e.threads, e.device, e.depth())


def encoder_dir(model: str) -> str:
    """The encoder's model directory: ``embedded`` is the embedded Qwen's (retrieval_service never
    imports the engine, so the name is resolved here)."""
    if model in ("", "embedded"):
        from toolspec_core.model.embedded import embedded_model_dir

        return str(embedded_model_dir())
    return model


def key_dim(cfg: RetrievalConfig, target_hidden: int) -> int:
    """Size of the store's vectors: the encoder's hidden size (plus the lexical size for hybrid),
    the lexical size, or the target's hidden size (``hidden``), read from configs, nothing loaded."""
    key = cfg.concrete_key()
    if key == "hidden":
        return target_hidden
    lexical = cfg.lexical_dim if key in ("hybrid", "lexical") else 0
    if key == "lexical":
        return lexical
    return hidden_size(cfg.encoder.model) + lexical


def hidden_size(model: str) -> int:
    import json
    from pathlib import Path

    if model in ("", "embedded"):
        from toolspec_core.model.embedded import cache_root

        path = cache_root() / "embedded" / "qwen2.5-coder-0.5b-instruct-f32" / "config.json"
        return json.loads(path.read_text())["hidden_size"] if path.is_file() else 896
    cfg_json = json.loads((Path(model) / "config.json").read_text())
    return int(cfg_json.get("hidden_size") or cfg_json["text_config"]["hidden_size"])


def _digest(key) -> str:
    import numpy as np

    data = key.encode() if isinstance(key, str) else np.asarray(key, dtype=np.float32).tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def wire_key(key):
    """A key as it travels to the deployment: the request text as is, a vector as floats."""
    return key if isinstance(key, str) else [float(x) for x in key]


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
            "add_retries": 0,
            "add_errors": 0,
        }

    def counters(self) -> dict:
        """What /health reports of the replica's searches, with the key they use (``auto`` resolved)."""
        return {"key": self.cfg.concrete_key(), **self._counts, "adds_pending": self.pending()}

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
            resp = self.handle.search.remote(tenant, wire_key(embedding), list(tool_names) or None, self.cfg.top_k)
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

    def pending(self) -> int:
        """Library writes under way."""
        return sum(not t.done() for t in self._tasks)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the library writes under way (call on their loop); how
        many are still under way after it."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        return self.pending()

    def add_nowait(self, **kwargs) -> None:
        """Send a completed call to the library without waiting (call on the event loop)."""
        task = asyncio.ensure_future(self._add(kwargs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, kwargs: dict) -> None:
        """One completed call into the library. Nobody waits for it, so it is never cut short the
        way a search is: a slow write is waited for and one that fails on the way (the deployment's
        replica lost or restarting, its router backed up) goes again after a backoff, both until
        ``add_deadline_s``. A write the store refused (bad input: ``ValueError`` / ``TypeError``,
        also as Ray's task error) is not sent again. The record's id is its content, so a write
        that reached the store twice is one record; each try names its ``attempt``, so the library
        counts a resent write whose first try had landed apart from a call written twice."""
        deadline = time.monotonic() + self.cfg.add_deadline_s
        delay, reason, attempt = 0.25, "deadline", 0
        while True:
            try:
                left = max(deadline - time.monotonic(), 1e-3)
                await asyncio.wait_for(_awaitable(self.handle.add.remote(**kwargs, attempt=attempt)), left)
                self._counts["adds"] += 1
                return
            except (asyncio.TimeoutError, TimeoutError):
                break
            except (ValueError, TypeError) as exc:
                reason = type(exc).__name__
                break
            except Exception as exc:
                reason = type(exc).__name__
                if time.monotonic() + delay >= deadline:
                    break
                self._counts["add_retries"] += 1
                attempt += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
        self._counts["add_errors"] += 1
        log.warning("retrieval add dropped (%s)", reason)


async def _awaitable(resp):
    return await resp


class ServeLibrary:
    """The write side of ``toolspec_core.drafters.toolcall.library.CallLibrary`` over the client,
    callable from the replica's worker and engine threads. Searches never go through it: the host runs one per request on
    the event loop (``prepare.Search``) and hands the drafter its results
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
            embedding=wire_key(embedding),
            remember=True,
        )
        self.client.loop.call_soon_threadsafe(lambda: self.client.add_nowait(**kwargs))
