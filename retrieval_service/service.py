"""The retrieval service: one owner of the store, asked by every serving replica.

Plain Python (no Ray import): the serving layer wraps it in a Ray Serve deployment / actor.
Methods take and return JSON-serialisable values only, so they cross process boundaries as is.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

from .records import CallRecord
from .store import CallStore, StoreConfig, make_store


class RetrievalService:
    """``search`` / ``add`` over one ``CallStore``; ``remember=False`` calls are never stored
    (their arguments may be private); every query is scoped to one tenant."""

    def __init__(self, config: StoreConfig | dict | None = None, store: CallStore | None = None):
        self.config = config if isinstance(config, StoreConfig) else StoreConfig(**(config or {}))
        self.store = store if store is not None else make_store(self.config)
        self._lock = threading.Lock()
        self._stats = {
            "searches": 0,
            "hits": 0,
            "adds": 0,  # writes that stored a new record
            "rewrites": 0,  # first writes of a call the library held (the same call again, or a request run twice)
            "resends": 0,  # writes a client sent again after a failed try
            "resends_held": 0,  # ... that found their call held: the failed try had landed
            "not_remembered": 0,
            "errors": 0,
            "search_s": 0.0,
            "add_s": 0.0,
        }

    def search(
        self, tenant: str, embedding: Sequence[float], tool_names: list[str] | None = None, k: int = 10
    ) -> list[dict]:
        """Top-``k`` past calls of ``tenant`` by cosine to ``embedding``, restricted to
        ``tool_names`` when given (the request's offered tools, or the tool the FSM settled on).
        Identical call texts are returned once (best score)."""
        t0 = time.perf_counter()
        try:
            hits = self.store.search(tenant, embedding, tool_name=list(tool_names) if tool_names else None, k=k)
        except Exception:
            self._bump("errors")
            raise
        out, seen = [], set()
        for rec, score in hits:
            if rec.text not in seen:
                seen.add(rec.text)
                out.append(rec.to_result(score))
        self._bump("searches", search_s=time.perf_counter() - t0, hits=len(out))
        return out

    def add(
        self,
        tenant: str,
        tool_name: str,
        schema_hash: str,
        text: str,
        token_ids: Sequence[int],
        arguments: dict[str, Any],
        embedding: Sequence[float],
        remember: bool = True,
        attempt: int = 0,
    ) -> str | None:
        """Store a completed call; returns its record id, or None when ``remember`` is false
        (then nothing is written, not even to a log). ``attempt``: how many times the client sent
        this write before (a try that failed on the way may still have landed), so a call the
        library already holds is counted as a resend that had landed, not as a second write of it."""
        if not remember:
            self._bump("not_remembered")
            return None
        t0 = time.perf_counter()
        try:
            rec = CallRecord(
                tenant=tenant,
                tool_name=tool_name,
                schema_hash=schema_hash,
                text=text,
                token_ids=list(token_ids),
                arguments=dict(arguments or {}),
                embedding=embedding,
            )
            new = self.store.add(rec)
        except Exception:
            self._bump("errors")
            raise
        self._bump("adds" if new else "resends_held" if attempt else "rewrites", add_s=time.perf_counter() - t0)
        if attempt:
            self._bump("resends")
        return rec.id

    def add_many(self, tenant: str, calls: Sequence[dict]) -> int:
        """Warm a library in one write: ``calls`` are dicts with ``add``'s keyword arguments
        (tool_name, schema_hash, text, token_ids, arguments, embedding[, remember, created_at])."""
        t0 = time.perf_counter()
        recs = []
        for c in calls:
            c = dict(c)
            if not c.pop("remember", True):
                self._bump("not_remembered")
                continue
            recs.append(CallRecord(tenant=tenant, **c))
        new = self.store.add_many(recs)
        with self._lock:
            self._stats["adds"] += new
            self._stats["rewrites"] += len(recs) - new
            self._stats["add_s"] += time.perf_counter() - t0
        return len(recs)

    def evict(self) -> int:
        return self.store.evict()

    def tenants_of(self, tenant: str) -> dict[str, int]:
        """Records of ``tenant`` and of its sub-tenants (``tenant/user``), by stored tenant."""
        return {t: n for t, n in self.store.tenant_counts().items() if t == tenant or t.startswith(tenant + "/")}

    def forget_tenant(self, tenant: str) -> int:
        """Delete every call of ``tenant`` and of its sub-tenants; how many were deleted."""
        return sum(self.store.delete_tenant(t) for t in self.tenants_of(tenant))

    def tenant_stats(self, tenant: str) -> dict:
        subs = self.tenants_of(tenant)
        return {"tenant": tenant, "records": sum(subs.values()), "sub_tenants": len(subs)}

    def stats(self) -> dict:
        with self._lock:
            s = dict(self._stats)
        s["records"] = self.store.count()
        s["backend"] = self.config.backend
        s["dim"] = self.config.dim
        s["mean_search_ms"] = 1e3 * s["search_s"] / s["searches"] if s["searches"] else 0.0
        writes = s["adds"] + s["rewrites"] + s["resends_held"]
        s["mean_add_ms"] = 1e3 * s["add_s"] / writes if writes else 0.0
        return s

    def close(self) -> None:
        self.store.close()

    def _bump(self, key: str, search_s: float = 0.0, add_s: float = 0.0, hits: int = 0) -> None:
        with self._lock:
            self._stats[key] += 1
            self._stats["search_s"] += search_s
            self._stats["add_s"] += add_s
            self._stats["hits"] += hits
