"""Prompt lookup: n-gram matches over the request's own tokens, drafted as a tree of continuations."""

from __future__ import annotations

from toolspec_core.drafters.base import LabelRates, add_copies
from toolspec_core.drafters.methods import RequestInfo
from toolspec_core.spec.labels import PLD, match_label
from toolspec_core.spec.proposer import DraftContext, Drafter, DrafterBase
from toolspec_core.spec.tree import DraftTree, VerifyResult


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


class PromptLookupDrafter(DrafterBase):
    """N-gram match over the context (prompt + generated), like HF ``prompt_lookup_num_tokens``.

    Proposes up to ``branches`` continuations as a tree; node confidence comes from the online
    acceptance rate of label ``"pld"`` so the engine's budget can drop drafts that do not pay.
    """

    label = PLD

    def __init__(
        self,
        max_ngram: int = 4,
        min_ngram: int = 2,
        length: int = 10,
        branches: int = 1,
        rates: LabelRates | None = None,
        long_at: int = 3,
    ):
        self.max_ngram, self.min_ngram, self.length, self.branches = max_ngram, min_ngram, length, branches
        self.long_at = long_at  # matches of at least this many tokens learn their own rate
        self.rates = rates or LabelRates({self.label: 0.5, self.label + "+": 0.8})

    def propose(self, ctx: DraftContext) -> DraftTree:
        n, conts = ngram_match(
            ctx.tokens, self.max_ngram, self.min_ngram, min(self.length, ctx.max_depth), self.branches
        )
        return add_copies(DraftTree(), conts, match_label(self.label, n, self.long_at), self.rates)

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None:
        self.rates.update(tree, result)


class PromptLookupMethod:
    name = "pld"
    uses_history = uses_library = False

    def __init__(self, tokenizer=None, **opts):
        self.opts = opts
        self.rates = LabelRates({PLD: 0.6})

    def drafter(self, req: RequestInfo) -> Drafter:
        return PromptLookupDrafter(rates=self.rates, **self.opts)

    def observe(self, req: RequestInfo, output_ids: list[int], text: str) -> None:
        return None
