"""Commit a verify step into the KV cache: keep the root chain and the accepted path, by index.

Rows of the last forward are gathered into place and the rest cropped; nothing copies a cache."""

from __future__ import annotations

from toolspec_core.model.kv import KVCache


def kv_rows(path: list[int], n_roots: int = 1) -> list[int]:
    """Input rows whose KV must be kept: the root chain and each accepted node."""
    return list(range(n_roots)) + [n_roots + i for i in path]


def commit_kv(cache: KVCache, prefix_len: int, rows: list[int]) -> None:
    """Keep exactly ``rows`` (input rows of the last forward) after ``prefix_len``, in order.

    The cache moves the rows (a gather in its storage, or a pool's slot move) and is cropped by
    index; when the rows are already a contiguous prefix only a crop happens.
    """
    total = cache.get_seq_length()
    keep = len(rows)
    if rows != list(range(keep)):
        cache.move_rows(prefix_len, rows)
    drop = total - (prefix_len + keep)
    if drop > 0:
        cache.crop(-drop)
