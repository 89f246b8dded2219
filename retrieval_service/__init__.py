"""ToolSpec's history library of tool calls: records, stores (memory / Qdrant Edge / Qdrant),
request embedders and the retrieval service. Qdrant packages and torch load lazily."""

from .embedding import Embedder, HFEmbedder, LexicalEmbedder, from_hidden, request_text
from .records import CallRecord, content_id, schema_hash
from .service import RetrievalService
from .store import (
    EMBEDDED_BACKEND,
    CallStore,
    EdgeStore,
    MemoryStore,
    QdrantStore,
    StoreConfig,
    StoreError,
    make_store,
)

__all__ = [
    "CallRecord",
    "CallStore",
    "EMBEDDED_BACKEND",
    "EdgeStore",
    "Embedder",
    "HFEmbedder",
    "LexicalEmbedder",
    "MemoryStore",
    "QdrantStore",
    "RetrievalService",
    "StoreConfig",
    "StoreError",
    "content_id",
    "from_hidden",
    "make_store",
    "request_text",
    "schema_hash",
]
