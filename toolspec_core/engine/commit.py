"""Commit a verify step into the KV cache: keep the root chain and the accepted path, by index.

Rows of the last forward are gathered into place and the rest cropped; nothing copies a whole cache
except ``clone_cache``, which a cached prompt prefix needs once per request."""

from __future__ import annotations

import copy

import torch


def kv_rows(path: list[int], n_roots: int = 1) -> list[int]:
    """Input rows whose KV must be kept: the root chain and each accepted node."""
    return list(range(n_roots)) + [n_roots + i for i in path]


def commit_kv(cache, prefix_len: int, rows: list[int]) -> None:
    """Keep exactly ``rows`` (input rows of the last forward) after ``prefix_len``, in order.

    Gather + crop by index; when the rows are already a contiguous prefix only a crop happens.
    """
    total = cache.get_seq_length()
    keep = len(rows)
    if rows != list(range(keep)) and hasattr(cache, "move_rows"):  # a pooled cache moves its own slots
        cache.move_rows(prefix_len, rows)
    elif rows != list(range(keep)):
        src = torch.tensor([prefix_len + r for r in rows], dtype=torch.long, device=cache.layers[0].keys.device)
        with torch.inference_mode():  # cache tensors are inference tensors
            _gather_rows(cache, prefix_len, keep, src)
    drop = total - (prefix_len + keep)
    if drop > 0:
        cache.crop(-drop)


def _gather_rows(cache, prefix_len: int, keep: int, src: torch.Tensor) -> None:
    for layer in cache.layers:
        # keys/values: [B, H_kv, S, D]
        layer.keys[:, :, prefix_len : prefix_len + keep] = layer.keys.index_select(2, src)
        layer.values[:, :, prefix_len : prefix_len + keep] = layer.values.index_select(2, src)


def clone_cache(cache):
    """Independent copy of a (small, per-request) KV cache: a prefix cache shared by methods/requests."""
    return copy.deepcopy(cache)
