"""Draft the tokens the target would actually produce for a text continuation.

BPE merges across the boundary between committed text and a candidate (``":`` + `` "`` vs
``": "``), so a candidate is tokenized together with a short tail of committed tokens and the
draft is whatever follows that tail. If the tail itself would be re-tokenized differently (the
committed tokens do not end on a clean boundary), a shorter tail is tried, down to none.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache

from toolspec_core.drafters import tree_kernel

log = logging.getLogger(__name__)

TAIL_TOKENS = 3

# the pre-tokenizer of the Qwen2 family's fast tokenizers: the one the compiled encoder emulates
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level pre-tokenizer's printable character of each byte (GPT-2's table)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def native_encoder(tokenizer):
    """``encode(text) -> ids | None``: the compiled byte-level BPE (``kernels/bpe.c``) built from
    ``tokenizer``'s vocabulary and merges, where its pipeline is one the kernel reproduces (NFC or
    no normalizer, the Qwen2 pre-tokenizer, plain byte-level BPE); it answers ASCII text without
    added tokens' texts and None for the rest. None where the kernel is not built or the
    tokenizer is another kind. Built once per tokenizer object."""
    cached = getattr(tokenizer, "_toolspec_bpe", False)
    if cached is not False:
        return cached
    encoder = None
    try:
        encoder = _native_encoder(tokenizer)
    except Exception as exc:  # noqa: BLE001 -- the tokenizer itself answers: slower, the same ids
        log.warning("no compiled encoder for this tokenizer (%s: %s)", type(exc).__name__, exc)
    try:
        tokenizer._toolspec_bpe = encoder
    except AttributeError:
        pass
    return encoder


def _native_encoder(tokenizer):
    kernel = tree_kernel.load_bpe()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if kernel is None or backend is None:
        return None
    spec = json.loads(backend.to_str())
    model, pre, norm = spec.get("model") or {}, spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    plain_bpe = (
        model.get("type") == "BPE"
        and model.get("dropout") is None
        and not model.get("byte_fallback")
        and not model.get("ignore_merges")
        and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")
    )
    steps = pre.get("pretokenizers") or []
    qwen2_pre = (
        pre.get("type") == "Sequence"
        and len(steps) == 2
        and steps[0].get("type") == "Split"
        and (steps[0].get("pattern") or {}).get("Regex") == QWEN2_SPLIT
        and steps[0].get("behavior") == "Isolated"
        and not steps[0].get("invert")
        and steps[1].get("type") == "ByteLevel"
        and not steps[1].get("add_prefix_space")
        and not steps[1].get("use_regex")
    )
    if not (plain_bpe and qwen2_pre and (norm is None or norm.get("type") == "NFC")):
        return None
    vocab = model["vocab"]
    char = _bytes_to_unicode()
    byte_ids = [vocab[char[b]] for b in range(256)]
    merges = []
    for m in model["merges"]:
        left, right = m.split(" ") if isinstance(m, str) else m
        merges.append((vocab[left], vocab[right], vocab[left + right]))
    added = tuple(a["content"].encode() for a in spec.get("added_tokens") or [])
    table = kernel.make(byte_ids, merges, added)
    encode = kernel.encode

    def native(text: str):
        return encode(table, text)

    native.table = table  # the compiled tables, for the kernel's whole-candidate ``tokenize``
    return native


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
        # ASCII text through the compiled encoder (the same ids, a microsecond instead of tens);
        # the reference path (``cache_candidates=False``) always asks the tokenizer
        self._native = native_encoder(tokenizer) if cache_candidates else None
        kernel = tree_kernel.load_bpe() if cache_candidates else None
        self._label_kernel = kernel.label_tokens if kernel is not None else None
        # a whole candidate in one compiled call (its runs' boundaries, encodes and labels), the
        # tokenizer's decode and encode called back only for tails and text the encoder does not cover
        table = getattr(self._native, "table", None)
        self._kernel_tokenize = kernel.tokenize if kernel is not None and table is not None else None
        self._table = table
        self._encode = lru_cache(maxsize=cache_size)(self._encode_uncached)
        self._decode = lru_cache(maxsize=4096)(self._decode_uncached)
        self._chars: dict[int, int] = {}

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        if self._native is not None:
            ids = self._native(text)
            if ids is not None:
                return ids
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
        """``candidate`` without its cache (for callers that keep their own: a tool set's token
        table); in one compiled call where the encoder is built (``kernels/bpe.c``: the same ids
        and labels as :meth:`tokenize_reference`, tests/drafters/test_bpe.py)."""
        if self._kernel_tokenize is not None:
            return self._kernel_tokenize(
                self._table, tail, segs, TAIL_TOKENS, self._decode, self._encode, self._chars, self.chars
            )
        return self.tokenize_reference(tail, segs)

    def tokenize_reference(self, tail: tuple[int, ...], segs: tuple) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """:meth:`tokenize` in Python, segment by segment (the compiled one's reference)."""
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
        (the last segment's past the end); segment ends only grow, so one pass (compiled where
        built: ``kernels/bpe.c``, this loop is its reference)."""
        if self._label_kernel is not None:
            return self._label_kernel(toks, text_labels, self._chars, self.chars)
        out, pos, j, last = [], 0, 0, len(text_labels) - 1
        for t in toks:
            while j < last and pos >= text_labels[j][0]:
                j += 1
            out.append(text_labels[j][1])
            pos += self.chars(t)
        return out
