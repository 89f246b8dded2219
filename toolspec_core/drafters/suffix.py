"""Suffix drafting (SuffixDecoding / SAM-Decoding style): matches of the context's and the
tenant's history's suffix tries, drafted as a frequency-scored tree.

Node ``conf`` comes from online acceptance rates (LabelRates), so the engine's hardware-aware
budget treats the tree like every other tree method. The rate of a node is keyed finer than its
label (frequency bucket, match length) because those predict acceptance much better than the
label alone; the tree label stays ``SUFFIX`` for per-state statistics. ToolSpec's own drafter
uses this for the text the schema cannot know; on its own it is the ``suffix`` baseline.

Rates are keyed by each node's token path, not its index, because the engine prunes and
re-indexes the tree before ``feedback`` sees it.
"""

from __future__ import annotations

import heapq
from itertools import count

from toolspec_core.drafters import tree_kernel
from toolspec_core.drafters.base import LabelRates, update_keyed_rates
from toolspec_core.drafters.history import TenantHistories
from toolspec_core.drafters.suffix_trie import ContextIndex, SuffixTrie
from toolspec_core.spec.labels import SUFFIX
from toolspec_core.spec.proposer import DraftContext, DrafterBase
from toolspec_core.spec.tree import ROOT, DraftTree, VerifyResult

SUFFIX_PRIOR = {
    "suffix:hi:L": 0.85,
    "suffix:mid:L": 0.5,
    "suffix:lo:L": 0.2,
    "suffix:hi:l": 0.8,
    "suffix:mid:l": 0.5,
    "suffix:lo:l": 0.2,
    "suffix:hi:s": 0.5,
    "suffix:mid:s": 0.3,
    "suffix:lo:s": 0.1,
    "suffix:hi:L:1": 0.7,
    "suffix:hi:l:1": 0.6,
    "suffix:hi:s:1": 0.3,
}


def suffix_key(freq: float, match_len: int, seen: int = 2) -> str:
    """Rate key: empirical continuation frequency x match length (short matches are noise) x
    whether the context was seen only once (a frequency of 1/1 is weak evidence).

    Buckets chosen by offline replay of recorded outputs (``benchmarks/studies/offline_sim.py``, in git at ``5afc378``): the
    once-seen and long (>= 6) buckets each learn a clearly different rate.
    """
    fb = "hi" if freq >= 0.8 else "mid" if freq >= 0.4 else "lo"
    ml = "L" if match_len >= 6 else "l" if match_len >= 3 else "s"
    return f"suffix:{fb}:{ml}" + (":1" if seen == 1 else "")


# every value of ``suffix_key``, in the order the compiled walk indexes them (frequency bucket,
# match-length bucket, seen once)
KEYS = tuple(
    f"suffix:{fb}:{ml}" + (":1" if once else "")
    for fb in ("hi", "mid", "lo")
    for ml in ("L", "l", "s")
    for once in (0, 1)
)
MIN_PROB = 0.01  # a node whose path probability falls below this is not drafted (``grow_from_trie``)


def grow_from_trie(
    tree: DraftTree,
    keys: dict,
    trie: SuffixTrie,
    node: int,
    match_len: int,
    rates: LabelRates,
    max_nodes: int,
    max_depth: int,
    min_prob: float = MIN_PROB,
    label: str = SUFFIX,
    parent: int = ROOT,
    prefix: tuple[int, ...] = (),
    prob: float = 1.0,
) -> None:
    """Best-first expansion of ``trie`` below ``node`` into ``tree`` by path probability.

    A child's conf is the calibrated rate of its (frequency, match length) bucket, so the
    common budget can cut what does not pay. Nodes merge with what is already in ``tree``.
    """
    tie = count()
    heap = [(-prob, next(tie), node, parent, tuple(prefix), 0)]
    added = 0
    rated: dict[str, float] = {}  # key -> conf: the rates do not change while one tree grows
    while heap and added < max_nodes:
        neg, _, tnode, parent, path, depth = heapq.heappop(heap)
        if depth >= max_depth:
            continue
        kids = list(trie.kids[tnode].items())  # a snapshot: a server thread may be adding to the trie
        total = sum(trie.count[c] for _, c in kids)
        for tok, c in kids:
            freq = trie.count[c] / total
            key = suffix_key(freq, match_len + depth, total)
            conf = rated.get(key)
            if conf is None:
                conf = rated[key] = rates.rate(key, SUFFIX_PRIOR.get(key, 0.3))
            score = -neg * conf
            if score < min_prob or added >= max_nodes:
                continue
            idx = tree.add(parent, tok, conf, label)
            added += 1
            sub = path + (tok,)
            if sub not in keys or conf >= tree.conf[idx]:
                keys[sub] = key  # the source with the higher conf owns the node's rate
            heapq.heappush(heap, (-score, next(tie), c, idx, sub, depth + 1))


def walk_batch(jobs: list[tuple]) -> None:
    """The compiled walks of a step's sequences (``SuffixDrafter.walk_job``), in one call: for
    each, the context's longest match, its lazily built subtrie and the best-first expansion
    into the sequence's tree, then the expansion from its history trie's match -- the Python
    path's nodes, confidences and rate keys bit for bit (``kernels/suffix_walk.c``)."""
    if jobs:
        tree_kernel.load_suffix().walk(jobs, KEYS, SUFFIX, MIN_PROB)


class SuffixDrafter(DrafterBase):
    """Drafts continuations of the longest matching suffix, from the request's own context
    (prompt + generated so far) and from the method's global history of earlier outputs."""

    label = SUFFIX

    def __init__(
        self,
        history: SuffixTrie,
        rates: LabelRates,
        depth: int = 32,
        max_match: int = 8,
        max_nodes: int = 64,
        compiled: bool = True,
    ):
        """``compiled``: the per-step walk in C where it is built (``walk_batch``); False: the
        Python walk, the reference the tests hold the compiled one to."""
        self.history, self.rates = history, rates
        self.context = ContextIndex(depth)
        self.max_match, self.max_nodes = max_match, max_nodes
        self.keys: dict[tuple[int, ...], str] = {}
        self.compiled = compiled and tree_kernel.load_suffix() is not None
        self._rate = lambda key: rates.rate(key, SUFFIX_PRIOR.get(key, 0.3))

    def _sync(self, tokens: list[int]) -> None:
        """Append the tokens committed since the last step (the prompt on the first step).

        Lazy, so indexing the prompt is timed as drafting, not hidden in setup.
        """
        self.context.extend(tokens[self.context.length :])

    def propose(self, ctx: DraftContext) -> DraftTree:
        tree = DraftTree()
        self.extend(ctx, tree, ROOT, 1.0)
        return tree

    @classmethod
    def propose_batch(cls, drafters: list, ctxs: list[DraftContext]) -> list[DraftTree] | None:
        """Every sequence's tree with one compiled walk for the batch (None: no compiled walk)."""
        if not all(d.compiled for d in drafters):
            return None
        trees = [DraftTree() for _ in drafters]
        walk_batch([j for d, c, t in zip(drafters, ctxs, trees) if (j := d.walk_job(c, t, ROOT, 1.0)) is not None])
        return trees

    def extend(self, ctx: DraftContext, tree: DraftTree, parent: int, prob: float) -> None:
        """Grow continuations of (context + the draft path to ``parent``) below ``parent`` (at the
        root: plain suffix drafting; below a drafted chain, e.g. a value after the schema's key
        text). Starts a step: the rate keys are this step's."""
        job = self.walk_job(ctx, tree, parent, prob)
        if job is not None:
            walk_batch([job])

    def walk_job(self, ctx: DraftContext, tree: DraftTree, parent: int, prob: float) -> tuple | None:
        """``extend`` up to the walk: the compiled walk's job for ``walk_batch`` (a step's jobs
        walk together), or None where nothing is left to walk (no depth left, or the Python
        walk, ``compiled=False``, which is done here)."""
        self._sync(ctx.tokens)
        self.keys = {}
        chain = [tree.tokens[i] for i in tree.path_to(parent)]
        depth = min(ctx.max_depth, self.context.depth) - len(chain)
        if depth <= 0:
            return None
        tail = ctx.tokens[-self.max_match :] + chain  # all a match of <= max_match tokens can see
        if self.compiled:
            context = self.context
            pattern = tail if chain else context.tokens  # longest_match / active_match
            cap = min(self.max_match, len(pattern), context.depth - 1)
            hist, hm = self.history.longest_match(tail, self.max_match) if len(self.history) > 1 else (-1, 0)
            tree.child(ROOT, ROOT)  # the child index in step: the walk adds to it
            return (
                tree,
                self.keys,
                self._rate,
                parent,
                tuple(chain),
                prob,
                self.max_nodes,
                depth,
                context.tokens,
                context.where,
                pattern,
                cap,
                context.depth,
                self.history.kids,
                self.history.count,
                hist,
                hm,
            )
        here = self.context.longest_match(tail, self.max_match) if chain else self.context.active_match(self.max_match)
        found = [(self.context, here)]
        if len(self.history) > 1:
            found.append((self.history, self.history.longest_match(tail, self.max_match)))
        for trie, (node, m) in found:
            if node >= 0:
                grow_from_trie(
                    tree,
                    self.keys,
                    trie,
                    node,
                    m,
                    self.rates,
                    self.max_nodes,
                    depth,
                    parent=parent,
                    prefix=tuple(chain),
                    prob=prob,
                )
        return None

    def feedback(self, tree: DraftTree, result: VerifyResult, owned: bool = False) -> None:
        """``owned``: the tree merged other sources' drafts; learn only from the nodes whose conf is
        this drafter's (a node another source also drafted is accepted more often -- counting it
        would make the rate of suffix-only nodes too high)."""
        update_keyed_rates(self.rates, tree, result, self.keys, self.label if owned else None)


class SuffixMethod:
    """SuffixDecoding / SAM-Decoding style baseline: per-request + global suffix structures.

    ``observe`` appends a finished output (with the tail of its prompt, so a match can start at
    the assistant header) to the global history; the request being decoded is never in it.
    """

    name = "suffix"
    uses_history, uses_library = True, False

    def __init__(
        self,
        tokenizer=None,
        depth: int = 32,
        max_match: int = 8,
        max_nodes: int = 64,
        prompt_tail: int = 8,
        history_tokens: int = 32768,
    ):

        self.depth, self.max_match, self.max_nodes, self.prompt_tail = depth, max_match, max_nodes, prompt_tail
        self.history = TenantHistories(depth, history_tokens)  # bounded, per tenant, thread-safe
        self.rates = LabelRates(SUFFIX_PRIOR)

    def drafter(self, req) -> SuffixDrafter:
        return SuffixDrafter(
            self.history.trie(getattr(req, "tenant", "default")), self.rates, self.depth, self.max_match, self.max_nodes
        )

    def observe(self, req, output_ids: list[int], text: str) -> None:
        if getattr(req, "remember", True):
            # every output counts, repeats included: SuffixDecoding's frequencies
            self.history.add(
                getattr(req, "tenant", "default"), output_ids, req.prompt_ids[-self.prompt_tail :], dedupe=False
            )
