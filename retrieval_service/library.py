"""The core's ``CallLibrary`` over the retrieval service, keyed by request text as the
Retrieval deployment keys it.

``toolspec bench --retrieval-key qwen|hybrid|lexical`` drafts from this library: the request's
key is its text (:func:`~retrieval_service.embedding.query_text`), turned into a vector by the
same :class:`~retrieval_service.keys.TextKeyer` the deployment builds
(``deployments.retrieval.make_keyer``) and searched in a :class:`RetrievalService` store, so the
benchmark's retrieval figures are those of the shipped path (store, encoder, query). A vector key
(``hidden``) passes through unchanged.

Like the rest of this package it imports nothing of the core: a search returns the service's
result dicts (``tool_name``, ``token_ids``, ``text``, ``arguments``, ``score``: what a serving
replica receives, and what the core's drafter takes as past calls), and ``add`` reads a past call's
attributes (``tool_name``, ``token_ids``, ``text``, ``arguments``: the core's ``PastCall``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import numpy as np

from .service import RetrievalService


class CachedKeyer:
    """A text keyer whose keys are kept per text (least recently used dropped): a request is
    keyed once for its search and again, for free, when its calls are stored. ``seconds`` adds
    up the encoder's time."""

    def __init__(self, keyer, max_entries: int = 4096):
        self.keyer, self.max_entries = keyer, max_entries
        self.dim, self.name = keyer.dim, getattr(keyer, "name", "text")
        self._keys: OrderedDict[str, np.ndarray] = OrderedDict()
        self.seconds, self.encoded = 0.0, 0

    def key(self, text: str) -> np.ndarray:
        v = self._keys.pop(text, None)
        if v is None:
            t0 = time.perf_counter()
            v = np.asarray(self.keyer.key(text), dtype=np.float32)
            self.seconds += time.perf_counter() - t0
            self.encoded += 1
        self._keys[text] = v
        while len(self._keys) > self.max_entries:
            self._keys.popitem(last=False)
        return v


class ServiceLibrary:
    """``CallLibrary`` (search / add) over a :class:`RetrievalService`; a key is the request's
    text (keyed by ``keyer``) or a vector of the store's size. A text that cannot be keyed (empty)
    finds nothing and stores nothing, as a request without a key would."""

    def __init__(self, keyer, service: RetrievalService | None = None, store: dict[str, Any] | None = None):
        self.keyer = keyer
        self.svc = service or RetrievalService({"backend": "memory", **(store or {}), "dim": keyer.dim})

    def vector(self, key) -> np.ndarray | None:
        if key is None:
            return None
        if isinstance(key, str):
            if not key.strip():
                return None
            return self.keyer.key(key)
        return np.asarray(key.detach().cpu().float() if hasattr(key, "detach") else key, dtype=np.float32).reshape(-1)

    def search(self, tenant: str, embedding, tool_names: list[str] | None = None, k: int = 10) -> list[dict]:
        vec = self.vector(embedding)
        if vec is None:
            return []
        return self.svc.search(tenant, vec.tolist(), list(tool_names) if tool_names else None, k)

    def add(self, tenant: str, call, embedding, remember: bool = True) -> None:
        if not remember:
            return
        vec = self.vector(embedding)
        if vec is None:
            return
        self.svc.add(
            tenant, call.tool_name, "", call.text, [int(t) for t in call.token_ids], dict(call.arguments or {}), vec
        )

    def __len__(self) -> int:
        return self.svc.store.count()
