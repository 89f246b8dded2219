"""One request's output text, decoded incrementally and shared by everything that reads it.

Stop strings, the streamed deltas and the schema drafter's FSM all need the text of the tokens
committed so far. Decoding the whole output at every step (or a tail window per emitted token)
costs O(n) per step; a ``Detokenizer`` decodes only a short window of the latest tokens, the way
vLLM's incremental detokenizer and HF's streamers do, and the readers share its ``text``.
"""

from __future__ import annotations

import weakref
from typing import Iterable


class Detokenizer:
    """Text of a growing list of output token ids, decoded a few tokens at a time.

    Two offsets into ``ids``: ``read`` (the tokens whose text is in ``text``) and the start of the
    decode window, one commit behind it. Each ``feed`` decodes ``ids[window:]`` and keeps what
    follows the text of ``ids[window:read]``: the window gives the tokenizer the preceding tokens
    it needs for its spacing rules (SentencePiece's leading space), so the pieces add up to the
    decode of the whole output. A piece that ends in "\\ufffd" (the token ends inside a multi-byte
    character) waits in ``pending`` until a later token completes it, so ``text`` only ever grows
    and holds complete characters.

    EOS ids end an output and are never text: they are not kept. Special tokens other than EOS
    are text (decoded with ``skip_special_tokens=False``), as in the engine's final text.
    ``final()`` equals ``tokenizer.decode(ids, skip_special_tokens=False)``.
    """

    def __init__(self, tokenizer, eos_ids: Iterable[int] = ()):
        self.tok = tokenizer
        self._decode = tokenizer_decode(tokenizer) or self._hf_decode
        self.eos = frozenset(eos_ids)
        self.ids: list[int] = []
        self.text = ""  # text of ids[: self.read], complete characters only
        self.read = 0
        self.pending = ""  # text of ids[self.read :] as decoded so far (may end inside a character)
        self._window = 0  # the decode window starts here (the read offset before the last commit)
        self._window_text = ""  # decode of ids[self._window : self.read]

    def feed(self, ids: Iterable[int]) -> str:
        """Add output tokens; returns the text they completed ("" while a character is unfinished)."""
        n = len(self.ids)
        self.ids.extend(i for i in ids if i not in self.eos)
        if len(self.ids) == n:
            return ""
        new = self._decode(self.ids[self._window :])
        if len(new) <= len(self._window_text) or new.endswith("\ufffd"):
            self.pending = new[len(self._window_text) :]
            return ""
        delta = new[len(self._window_text) :]
        self.text += delta
        self.pending = ""
        self._window, self.read = self.read, len(self.ids)
        self._window_text = self._decode(self.ids[self._window : self.read])
        return delta

    def tail(self, start: int) -> str:
        """``(text + pending)[start:]`` without copying the text before ``start``."""
        n = len(self.text)
        return self.text[start:] + self.pending if start <= n else self.pending[start - n :]

    def final(self) -> str:
        """The whole output's text: ``text`` plus whatever is still pending (an unfinished
        character at the end comes out as "\\ufffd", as a full decode writes it)."""
        return self.text + self.pending

    def _hf_decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


# text a decode's clean-up would rewrite (spaces before punctuation and contractions), JSON,
# multi-byte characters: decoded by the tokenizer and by its backend to see they agree
PROBE = (
    """Hello , world ! Is it ? yes . do n't , I 'm , they 're { "a" : [1, 2.5] } caf\u00e9 \u4e2d\u6587 \U0001f600"""
)


_DECODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its backend_decode


def tokenizer_decode(tokenizer):
    """:func:`backend_decode` of ``tokenizer``, probed once per tokenizer (every request's
    Detokenizer asks; the probe decodes a few dozen windows)."""
    try:
        if tokenizer in _DECODES:
            return _DECODES[tokenizer]
    except TypeError:  # neither weakly referable nor hashable: probed each time
        return backend_decode(tokenizer)
    out = _DECODES[tokenizer] = backend_decode(tokenizer)
    return out


def backend_decode(tokenizer):
    """``ids -> text`` equal to ``tokenizer.decode(ids, skip_special_tokens=False)`` by calling the
    fast tokenizer's Rust ``backend_tokenizer`` directly: the Python wrapper's own work (argument
    conversion, keyword handling) is two thirds of a short window's decode, run twice per
    committed token. Used only for a fast tokenizer that cleans no spaces up
    (``clean_up_tokenization_spaces`` false, the one thing a fast tokenizer's decode adds) and
    whose decode of :data:`PROBE` and the special tokens, whole and in short windows, is the
    backend's -- a probe on sample text, not a proof: a tokenizer class whose ``decode``
    post-processes text the probe does not hold would pass it. None for any other tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    decode = backend.decode
    try:
        ids = list(backend.encode(PROBE, add_special_tokens=False).ids)
        ids += [i for i in tokenizer.all_special_ids if isinstance(i, int)]
        windows = [ids] + [ids[k : k + 3] for k in range(len(ids))]
        if any(tokenizer.decode(w, skip_special_tokens=False) != decode(w, skip_special_tokens=False) for w in windows):
            return None
    except Exception:  # a tokenizer the probe cannot run on: its own decode
        return None
    return lambda ids: decode(ids, skip_special_tokens=False)
