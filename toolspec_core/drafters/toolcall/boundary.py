"""Draft the tokens the target would actually produce for a text continuation.

BPE merges across the boundary between committed text and a candidate (``":`` + `` "`` vs
``": "``), so a candidate is tokenized together with a short tail of committed tokens and the
draft is whatever follows that tail. If the tail itself would be re-tokenized differently (the
committed tokens do not end on a clean boundary), a shorter tail is tried, down to none.
"""

from __future__ import annotations

from functools import lru_cache

TAIL_TOKENS = 3


class BoundaryTokenizer:
    """Caches ``continuation_tokens`` per (tail, candidate): tool/argument names repeat a lot."""

    def __init__(self, tokenizer, cache_size: int = 65536):
        self.tok = tokenizer
        # a fast tokenizer's Rust backend directly: the same ids without the Python wrapper's
        # per-call overhead (about half of an uncached encode; drafting tokenizes every step)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._encode = lru_cache(maxsize=cache_size)(self._encode_uncached)
        self._decode = lru_cache(maxsize=4096)(self._decode_uncached)
        self._chars: dict[int, int] = {}

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        if self._backend is not None:
            return tuple(self._backend.encode(text, add_special_tokens=False).ids)
        return tuple(self.tok.encode(text, add_special_tokens=False))

    def _decode_uncached(self, ids: tuple[int, ...]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def chars(self, token: int) -> int:
        """Characters of one token's text, decoded alone (kept per token: a vocabulary is finite)."""
        n = self._chars.get(token)
        if n is None:
            n = self._chars[token] = len(self._decode((token,)))
        return n

    def continuation(self, committed: list[int] | tuple[int, ...], text: str) -> list[int]:
        """Tokens that follow ``committed`` when ``text`` is written next (canonical merges)."""
        if not text:
            return []
        for k in range(min(TAIL_TOKENS, len(committed)), 0, -1):
            tail = tuple(committed[-k:])
            tail_text = self._decode(tail)
            if "\ufffd" in tail_text:  # a split multi-byte character: not a clean boundary
                continue
            ids = self._encode(tail_text + text)
            if ids[:k] == tail:
                return list(ids[k:])
        return list(self._encode(text))
