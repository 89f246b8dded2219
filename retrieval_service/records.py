"""One record per completed tool call: what the history library stores and returns."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

# Namespace for content-derived record ids (uuid5): stable across processes and backends.
_ID_NAMESPACE = uuid.UUID("5b0c1f0e-7a53-4c4e-9a7e-2f1f6d3b9c41")

# Payload keys the backends index and filter on.
TENANT, TOOL, CREATED = "tenant", "tool_name", "created_at"


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def schema_hash(tool: dict) -> str:
    """Stable 16-hex hash of a tool's name + parameter schema.

    Accepts an OpenAI tool (``{"type": "function", "function": {...}}``) or the bare function dict.
    The description is left out on purpose: rewording it does not invalidate past calls, while a
    changed name or parameter schema does (old calls may then be illegal drafts).
    """
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("schema_hash needs a tool dict with a string 'name' (or 'function.name')")
    key = {"name": fn["name"], "parameters": fn.get("parameters") or {}}
    return hashlib.sha256(_canonical(key).encode()).hexdigest()[:16]


def content_id(tenant: str, tool_name: str, schema_hash_: str, text: str) -> str:
    """Deterministic id: the same call by the same tenant upserts one record instead of piling up
    copies that would crowd the top-k (API-Bank repeats e.g. the same GetUserToken call)."""
    return str(uuid.uuid5(_ID_NAMESPACE, "\x1f".join((tenant, tool_name, schema_hash_, text))))


class CallRecord(BaseModel):
    """A completed tool call. ``embedding`` is the request key (empty in search results, where
    backends skip returning vectors to save bandwidth)."""

    model_config = ConfigDict(extra="forbid")

    id: str = ""
    tenant: str = Field(min_length=1)
    tool_name: str = Field(min_length=1)
    schema_hash: str = ""
    text: str
    token_ids: list[int] = Field(default_factory=list)
    arguments: dict[str, Any] = Field(default_factory=dict)
    embedding: list[float] = Field(default_factory=list)
    created_at: float = Field(default_factory=time.time)

    @field_validator("embedding", mode="before")
    @classmethod
    def _vector(cls, v):
        if isinstance(v, np.ndarray) or hasattr(v, "detach"):  # numpy array or torch tensor
            v = np.asarray(v.detach().cpu() if hasattr(v, "detach") else v, dtype=np.float32).reshape(-1).tolist()
        return v

    @field_validator("id")
    @classmethod
    def _uuid(cls, v: str) -> str:
        if v:
            uuid.UUID(v)  # Qdrant point ids must be UUIDs (or unsigned ints)
        return v

    def model_post_init(self, __context) -> None:
        if not self.id:
            self.id = content_id(self.tenant, self.tool_name, self.schema_hash, self.text)

    def payload(self) -> dict:
        """Everything but the id and the vector (those travel separately in Qdrant)."""
        return self.model_dump(exclude={"id", "embedding"})

    @classmethod
    def from_payload(cls, id_: Any, payload: dict, embedding: Any = None) -> "CallRecord":
        return cls(id=str(id_), embedding=embedding if embedding is not None else [], **payload)

    def to_result(self, score: float) -> dict:
        """The JSON-serialisable dict the retrieval service returns."""
        return {
            "id": self.id,
            "tool_name": self.tool_name,
            "schema_hash": self.schema_hash,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "arguments": self.arguments,
            "created_at": self.created_at,
            "score": float(score),
        }
