"""The call-library protocol the core drafts from, and an in-memory implementation.

The core never imports a vector store: the server passes a ``CallLibrary`` backed by the
retrieval service (Qdrant), the benchmark uses :class:`MemoryLibrary`. A past call is drafted
from its token ids, so records carry the tokens as the target wrote them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Union

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class PastCall:
    tool_name: str
    token_ids: list[int]  # the whole call as the target wrote it (opener .. closer)
    text: str = ""
    arguments: dict = field(default_factory=dict)
    score: float = 0.0


# A request's retrieval key: its text (the Retrieval deployment encodes it) or a vector (a list, an
# array, or the target's last-layer hidden state of the final prompt token [H]).
RequestKey = Union[str, Sequence[float], np.ndarray, "torch.Tensor"]


def as_past_call(c: PastCall | dict) -> PastCall:
    """A retrieved call as the drafter takes it: a ``PastCall`` as is, or the retrieval service's
    result dict (``tool_name``, ``token_ids``, ``text``, ``arguments``, ``score``), which is what
    crosses from the Retrieval deployment (that package never imports the core)."""
    if isinstance(c, PastCall):
        return c
    return PastCall(
        c.get("tool_name", ""),
        list(c.get("token_ids") or []),
        c.get("text", ""),
        c.get("arguments") or {},
        float(c.get("score", 0.0)),
    )


class CallLibrary(Protocol):
    def search(
        self, tenant: str, embedding: RequestKey | None, tool_names: list[str] | None = None, k: int = 10
    ) -> list[PastCall]: ...

    def add(self, tenant: str, call: PastCall, embedding: RequestKey | None, remember: bool = True) -> None: ...


def _unit(v) -> np.ndarray | None:
    if v is None:
        return None
    a = np.asarray(v, dtype=np.float32).reshape(-1)
    n = float(np.linalg.norm(a))
    return a / n if n > 0 else a


class MemoryLibrary:
    """Per-tenant list of past calls; cosine similarity on the request embedding."""

    def __init__(self, max_per_tenant: int = 10000):
        self.max_per_tenant = max_per_tenant
        self.records: dict[str, list[tuple[PastCall, np.ndarray | None, float]]] = {}

    def add(self, tenant: str, call: PastCall, embedding, remember: bool = True) -> None:
        if not remember:
            return
        rows = self.records.setdefault(tenant, [])
        rows.append((call, _unit(embedding), time.time()))
        if len(rows) > self.max_per_tenant:
            del rows[: len(rows) - self.max_per_tenant]

    def search(self, tenant: str, embedding, tool_names: list[str] | None = None, k: int = 10) -> list[PastCall]:
        q = _unit(embedding)
        rows = [r for r in self.records.get(tenant, []) if tool_names is None or r[0].tool_name in tool_names]
        scored = []
        for i, (call, emb, _) in enumerate(rows):
            s = float(q @ emb) if q is not None and emb is not None and emb.shape == q.shape else 0.0
            scored.append((s, i, call))
        scored.sort(key=lambda x: (-x[0], -x[1]))  # most similar, then most recent
        return [PastCall(c.tool_name, c.token_ids, c.text, c.arguments, s) for s, _, c in scored[:k]]

    def __len__(self) -> int:
        return sum(len(v) for v in self.records.values())

    def tenants_of(self, tenant: str) -> list[str]:
        """``tenant`` and its users (``tenant/...``) that hold calls."""
        return [t for t in self.records if t == tenant or t.startswith(tenant + "/")]

    def forget(self, tenant: str) -> int:
        """Drop the calls of ``tenant`` and its users; how many there were."""
        return sum(len(self.records.pop(t)) for t in self.tenants_of(tenant))
