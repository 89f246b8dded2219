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
    """Caches ``continuation_tokens`` per (tail, candidate): tool/argument names repeat a lot.

    ``candidate`` tokenizes a whole schema candidate after a context tail; its result depends on
    nothing else (the tail's tokens and the candidate's segments), so it is kept per (tail,
    candidate) for every sequence the tokenizer drafts for: sequences with one tool set at one
    position of a call (the same boundary) tokenize each candidate once. ``cache_candidates=False``
    is the reference path the tests compare against.
    """

    def __init__(self, tokenizer, cache_size: int = 65536, cache_candidates: bool = True, candidates: int = 16384):
        self.tok = tokenizer
        self.cache_candidates = cache_candidates
        self._candidate = lru_cache(maxsize=candidates)(self.tokenize)  # a few kB each
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

    def candidate(self, tail: tuple[int, ...], segs: tuple) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Token ids of a candidate's segments written after ``tail`` (text segments tokenized
        together, raw token ids as they are) with a label per token. ``tail``: the context's last
        tokens (``TAIL_TOKENS`` are all ``continuation`` reads); ``segs``: (text or token ids, label)."""
        if self.cache_candidates:
            return self._candidate(tail, segs)
        return self.tokenize(tail, segs)

    def tokenize(self, tail: tuple[int, ...], segs: tuple) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``candidate`` without its cache (for callers that keep their own: a tool set's token table)."""
        ids: list[int] = []
        labels: list[str] = []
        text, text_labels = "", []  # pending text and (end offset, label) per segment
        for seg, lab in tuple(segs) + ((None, None),):
            if isinstance(seg, str):
                text += seg
                text_labels.append((len(text), lab))
                continue
            if text:
                toks = self.continuation(tail + tuple(ids), text)
                ids += toks
                labels += self._label_tokens(toks, text_labels)
                text, text_labels = "", []
            if seg:  # raw token ids (end of turn)
                ids += list(seg)
                labels += [lab] * len(seg)
        return tuple(ids), tuple(labels)

    def _label_tokens(self, toks: list[int], text_labels: list[tuple[int, str]]) -> list[str]:
        """Each token's label: that of the first segment ending after the token's first character
        (the last segment's past the end); segment ends only grow, so one pass."""
        out, pos, j, last = [], 0, 0, len(text_labels) - 1
        for t in toks:
            while j < last and pos >= text_labels[j][0]:
                j += 1
            out.append(text_labels[j][1])
            pos += self.chars(t)
        return out
