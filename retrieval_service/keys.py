"""The library's request keys as the Retrieval deployment computes them from request text.

Engine replicas send the request's text (:func:`~retrieval_service.embedding.query_text`); the
deployment keys it here, so every replica -- whatever its target model -- searches and fills one
vector space. ``qwen``: the deployment's own encoder (:class:`~retrieval_service.embedding.HFEmbedder`,
the embedded Qwen by default); ``hybrid``: that dense vector beside the hashed lexical one, each
unit length, so a cosine is the mean of the two cosines (score fusion in one dense vector, which
every store kind holds); ``lexical``: the hashed n-grams alone. The benchmarks key their online
library through the same class, so published retrieval figures are of the shipped path.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .embedding import HFEmbedder, LexicalEmbedder, concat_keys

TEXT_KEYS = ("qwen", "hybrid", "lexical")


class TextKeyer:
    """Request texts -> unit keys [B, dim] of one kind (see the module docstring)."""

    def __init__(self, kind: str, encoder: HFEmbedder | None = None, lexical_dim: int = 1024):
        if kind not in TEXT_KEYS:
            raise ValueError(f"unknown text key {kind!r}; known: {', '.join(TEXT_KEYS)}")
        if kind != "lexical" and encoder is None:
            raise ValueError(f"the {kind!r} key needs an encoder")
        self.kind, self.encoder = kind, encoder
        self.lexical = LexicalEmbedder(lexical_dim) if kind != "qwen" else None
        self.dim = (encoder.dim if encoder is not None and kind != "lexical" else 0) + (
            self.lexical.dim if self.lexical is not None else 0
        )
        self.name = kind if encoder is None else f"{kind}:{encoder.name}"

    def keys(self, texts: Sequence[str]) -> np.ndarray:
        if self.kind == "lexical":
            return np.stack([self.lexical.embed(t) for t in texts])
        dense = self.encoder.encode(list(texts))  # [B, H], one forward for the batch
        if self.kind == "qwen":
            return dense
        return np.stack([concat_keys(d, self.lexical.embed(t)) for d, t in zip(dense, texts)])

    def key(self, text: str) -> np.ndarray:
        return self.keys([text])[0]
