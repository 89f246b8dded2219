"""The drafter protocol and the two basic drafters (none, prompt lookup).

A drafter returns a draft tree, never a decision: the engine prunes it to the budget, the
target verifies it, and the outcome comes back through ``feedback``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from .tree import DraftTree, tried
from .verify import VerifyResult


@dataclass
class DraftContext:
    """What a drafter sees at a step. ``tokens[-1]`` is the root (committed, KV not cached yet)."""

    tokens: list[int]
    prompt_len: int
    max_depth: int  # never draft deeper than this (remaining max_new_tokens - 1)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Drafter(Protocol):
    def propose(self, ctx: DraftContext) -> DraftTree: ...

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None: ...


DrafterFactory = Callable[..., Drafter]


# Copy-draft labels (one place, so the chain rule below knows them all): once a copy starts
# matching it tends to go on, so its first token and its continuation learn separate rates.
PLD = "pld"  # prompt lookup (n-gram over the context)
RETRIEVAL = "retrieval"  # drafts taken from retrieved past calls (values in schema, whole calls in schema_drafter)
SPAN = "span"  # argument value copied from the context (values.value_spans)
DERIVED = "derived"  # values rendered from the context in the call's form (dates: values.date_values)
PATTERN = "pattern"  # a counting run a value has begun, continued (values.digit_run)
OWN_CALL = "own_call"  # a value a call earlier in this output passed (a repeated or parallel call)
CHAIN_LABELS = (PLD, RETRIEVAL, SPAN, DERIVED, PATTERN, OWN_CALL)


def base_label(key: str) -> str:
    """"pld:long+" -> "pld": the draft source a rate key belongs to."""
    return key.split(":")[0].rstrip("+")


def is_chain(key: str) -> bool:
    return base_label(key) in CHAIN_LABELS


def match_label(label: str, n: int, long_at: int) -> str:
    """Copy drafts found by a longer context match are right more often: learn them apart."""
    return label + ":long" if n >= long_at else label


def add_copies(tree: DraftTree, conts: list[list[int]], label: str, rates: "LabelRates", shares: list[float] | None = None) -> DraftTree:
    """Copy drafts as chains: first token at the label's rate (× share, default 1/rank), the rest at
    the continuation rate -- the one conf rule of prompt lookup, value spans and retrieval."""
    first, more = rates.rate(label), rates.rate(label + "+")
    for rank, cont in enumerate(conts):
        share = shares[rank] if shares is not None else 1.0 / (rank + 1)
        tree.add_path(cont, [first * share] + [more] * (len(cont) - 1), label)
    return tree


def rate_key(tree: DraftTree, i: int) -> str:
    """The acceptance-rate key of node ``i``: copy drafts learn their first token and their
    continuation separately ("pld" vs "pld+"), so long copies can earn a long draft."""
    lab, p = tree.labels[i], tree.parents[i]
    if is_chain(lab) and p >= 0 and tree.labels[p] == lab:
        return lab + "+"
    return lab


class LabelRates:
    """Online acceptance rate per draft label: P(node accepted | parent accepted).

    A Beta prior keeps early estimates sane; rates are shared across the requests of a drafter
    factory so a server learns its own hardware/model behaviour.
    """

    def __init__(self, prior: dict[str, float] | None = None, strength: float = 4.0):
        self.prior = dict(prior or {})
        self.strength = strength
        self.hits: dict[str, float] = {}
        self.tries: dict[str, float] = {}

    def rate(self, label: str, default: float = 0.5) -> float:
        generic = base_label(label) + ("+" if label.endswith("+") else "")
        p = self.prior.get(label, self.prior.get(generic, default))
        return (self.hits.get(label, 0.0) + p * self.strength) / (self.tries.get(label, 0.0) + self.strength)

    def count(self, label: str, hit: bool) -> None:
        """One chance of ``label``, taken or not."""
        self.tries[label] = self.tries.get(label, 0.0) + 1.0
        if hit:
            self.hits[label] = self.hits.get(label, 0.0) + 1.0

    def update(self, tree: DraftTree, result: VerifyResult, skip=None) -> None:
        """Count every node whose parent was accepted (it had its chance), unless ``skip(i, key)``."""
        accepted = set(result.path)
        for i in tried(tree.parents, result.path):
            lab = rate_key(tree, i)
            if skip is None or not skip(i, lab):
                self.count(lab, i in accepted)


class NoDrafter:
    """Plain autoregressive decoding through the same loop and cache (the baseline)."""

    def propose(self, ctx: DraftContext) -> DraftTree:
        return DraftTree()

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None:
        return None


def ngram_continuations(
    tokens: list[int], max_ngram: int, min_ngram: int, length: int, max_matches: int, search_from: int = 0
) -> list[list[int]]:
    """Continuations that followed earlier occurrences of the longest matching suffix n-gram.

    Like HF's prompt lookup: try n = max_ngram .. min_ngram; for the first n with matches, return
    up to ``max_matches`` distinct continuations (most recent first) of up to ``length`` tokens.
    """
    return ngram_match(tokens, max_ngram, min_ngram, length, max_matches, search_from)[1]


def ngram_match(
    tokens: list[int], max_ngram: int, min_ngram: int, length: int, max_matches: int, search_from: int = 0
) -> tuple[int, list[list[int]]]:
    """(n, continuations) of :func:`ngram_continuations`: n is the matched n-gram's length."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n :]
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        first = suffix[0]
        for start in range(n_tok - n - 1, search_from - 1, -1):
            if tokens[start] != first or tokens[start : start + n] != suffix:
                continue
            cont = tokens[start + n : start + n + length]
            key = tuple(cont[:4])
            if cont and key not in seen:
                seen.add(key)
                out.append(cont)
                if len(out) >= max_matches:
                    break
        if out:
            return n, out
    return 0, []


class PromptLookupDrafter:
    """N-gram match over the context (prompt + generated), like HF ``prompt_lookup_num_tokens``.

    Proposes up to ``branches`` continuations as a tree; node confidence comes from the online
    acceptance rate of label ``"pld"`` so the engine's budget can drop drafts that do not pay.
    """

    label = PLD

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, length: int = 10, branches: int = 1, rates: LabelRates | None = None,
                 long_at: int = 3):
        self.max_ngram, self.min_ngram, self.length, self.branches = max_ngram, min_ngram, length, branches
        self.long_at = long_at  # matches of at least this many tokens learn their own rate
        self.rates = rates or LabelRates({self.label: 0.5, self.label + "+": 0.8})

    def propose(self, ctx: DraftContext) -> DraftTree:
        n, conts = ngram_match(ctx.tokens, self.max_ngram, self.min_ngram, min(self.length, ctx.max_depth), self.branches)
        return add_copies(DraftTree(), conts, match_label(self.label, n, self.long_at), self.rates)

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None:
        self.rates.update(tree, result)
