"""Training-free baseline drafters: suffix matching (SuffixDecoding / SAM-Decoding style) and
Token Recycling.

Both return draft trees whose node ``conf`` comes from online acceptance rates (LabelRates), so
the engine's hardware-aware budget treats them exactly like every other tree method. The rate
of a node is keyed finer than its label (frequency bucket, top-k rank) because those predict
acceptance much better than the label alone; the tree label stays ``"suffix"`` /
``"token_recycling"`` for per-state statistics.

Rates are keyed by each node's token path, not its index, because the engine prunes and
re-indexes the tree before ``feedback`` sees it.
"""

from __future__ import annotations

import heapq
from itertools import count

import torch

from .drafting import DraftContext, LabelRates
from .tree import ROOT, DraftTree, tried
from .verify import VerifyResult

# --------------------------------------------------------------------------- shared helpers


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token path (root's child first) of every node; parents precede children."""
    out: list[tuple[int, ...]] = []
    for tok, p in zip(tree.tokens, tree.parents):
        out.append((tok,) if p == ROOT else out[p] + (tok,))
    return out


def update_keyed_rates(rates: LabelRates, tree: DraftTree, result: VerifyResult, keys: dict, label: str | None = None) -> None:
    """Like ``LabelRates.update`` but counts node i under ``keys[path of i]`` (its rate key).

    Only nodes whose parent was accepted count as tries (they had their chance); with ``label``,
    only the nodes this source owns in the merged tree.
    """
    accepted = set(result.path)
    paths = node_paths(tree)
    for i in tried(tree.parents, result.path):
        key = keys.get(paths[i])
        if key is None or (label is not None and tree.labels[i] != label):
            continue
        rates.tries[key] = rates.tries.get(key, 0.0) + 1.0
        if i in accepted:
            rates.hits[key] = rates.hits.get(key, 0.0) + 1.0


# --------------------------------------------------------------------------- suffix trie


class SuffixTrie:
    """Depth-limited suffix trie with occurrence counts (SuffixDecoding's structure).

    Every substring of length <= ``depth`` of the appended documents is a path from node 0;
    ``count[n]`` is how often that substring occurred. Appending one token costs O(depth):
    ``active[L-1]`` is the node of the length-L suffix of the current document, and each grows
    by one child. No rebuild ever happens, so per-step drafting stays cheap.
    """

    def __init__(self, depth: int = 32):
        self.depth = depth
        self.kids: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self.active: list[int] = []
        self.length = 0  # tokens appended (all documents)

    def __len__(self) -> int:
        return len(self.kids)

    def _child(self, node: int, tok: int) -> int:
        kids = self.kids[node]
        c = kids.get(tok)
        if c is None:  # the node exists before it is published, for readers in other threads
            c = len(self.kids)
            self.kids.append({})
            self.count.append(0)
            kids[tok] = c
        self.count[c] += 1
        return c

    def start_document(self) -> None:
        """Suffixes never span two documents."""
        self.active = []

    def append(self, tok: int) -> None:
        # _child inlined: this loop runs depth times per token of every prompt (the per-request
        # context trie is built on the first step), the largest share of drafting time.
        kids, count = self.kids, self.count
        active = [0]
        active += self.active[: self.depth - 1]
        for i, node in enumerate(active):
            edges = kids[node]
            c = edges.get(tok)
            if c is None:  # as in _child: the node exists before it is published
                c = len(kids)
                kids.append({})
                count.append(0)
                edges[tok] = c
            count[c] += 1
            active[i] = c
        self.active = active
        self.length += 1

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(int(t))

    def add_document(self, tokens) -> None:
        self.start_document()
        self.extend(tokens)
        self.start_document()

    def walk(self, pattern) -> int:
        node = 0
        for t in pattern:
            node = self.kids[node].get(t, -1)
            if node < 0:
                return -1
        return node

    def longest_match(self, tokens: list[int], max_match: int) -> tuple[int, int]:
        """(node, m) for the longest suffix of ``tokens`` (m <= max_match) seen *with* a continuation.

        "Has a continuation" is closed under taking suffixes, so a binary search over m is exact.
        Returns (-1, 0) when not even the last token was seen followed by something.
        """
        lo, hi, best = 1, min(max_match, len(tokens), self.depth - 1), (-1, 0)
        while lo <= hi:
            m = (lo + hi) // 2
            node = self.walk(tokens[len(tokens) - m :])
            if node >= 0 and self.kids[node]:
                best, lo = (node, m), m + 1
            else:
                hi = m - 1
        return best

    def active_match(self, max_match: int) -> tuple[int, int]:
        """Same as ``longest_match`` for the trie's own current document, in O(max_match)."""
        for m in range(min(max_match, len(self.active), self.depth - 1), 0, -1):
            node = self.active[m - 1]
            if self.kids[node]:
                return node, m
        return -1, 0


class ContextIndex:
    """One growing document (a request's prompt + output) seen as a ``SuffixTrie``, built on demand.

    A SuffixTrie costs O(depth) per appended token, and a request's context is rebuilt for every
    request (hundreds of prompt tokens: the largest share of drafting time). Here appending is
    O(1) (positions per token), and a match builds only the small subtrie below the matched
    suffix from that suffix's occurrences: the same nodes, counts and child order as the full trie
    (``tests/test_baselines.py`` checks this against it). ``kids`` / ``count`` are that subtrie;
    node 0 is the matched suffix.
    """

    def __init__(self, depth: int = 32):
        self.depth = depth
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}  # token -> positions, ascending
        self.kids: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]

    @property
    def length(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        where, toks = self.where, self.tokens
        for t in tokens:
            t = int(t)
            where.setdefault(t, []).append(len(toks))
            toks.append(t)

    def _match(self, pattern, cap: int) -> tuple[int, int]:
        """Longest suffix (<= cap tokens) of ``pattern`` that occurs followed by a token; builds its subtrie."""
        toks, n = self.tokens, len(self.tokens)
        if cap < 1 or not pattern:
            return -1, 0
        ends = []  # (end position, common suffix length with pattern)
        best = 0
        last = len(pattern) - 1
        for e in self.where.get(pattern[-1], ()):
            if e >= n - 1:  # the occurrence must be followed by something
                break
            m = 1
            while m < cap and m <= e and toks[e - m] == pattern[last - m]:
                m += 1
            ends.append((e, m))
            best = max(best, m)
        if not best:
            return -1, 0
        self._build([e for e, m in ends if m >= best], best)
        return 0, best

    def _build(self, ends: list[int], m: int) -> None:
        """The subtrie below the matched suffix: each occurrence's continuation, up to depth - m tokens."""
        toks, n = self.tokens, len(self.tokens)
        kids, count = [{}], [0]
        for e in ends:  # ascending: children appear in the order the full trie creates them
            node = 0
            for t in toks[e + 1 : min(e + 1 + self.depth - m, n)]:
                c = kids[node].get(t)
                if c is None:
                    c = len(kids)
                    kids.append({})
                    count.append(0)
                    kids[node][t] = c
                count[c] += 1
                node = c
        self.kids, self.count = kids, count

    def longest_match(self, tokens: list[int], max_match: int) -> tuple[int, int]:
        """As ``SuffixTrie.longest_match`` (node 0 of the rebuilt ``kids``)."""
        return self._match(tokens, min(max_match, len(tokens), self.depth - 1))

    def active_match(self, max_match: int) -> tuple[int, int]:
        """As ``SuffixTrie.active_match``: the document's own current suffix."""
        return self._match(self.tokens, min(max_match, len(self.tokens), self.depth - 1))


# --------------------------------------------------------------------------- suffix drafter

SUFFIX_PRIOR = {
    "suffix:hi:L": 0.85, "suffix:mid:L": 0.5, "suffix:lo:L": 0.2,
    "suffix:hi:l": 0.8, "suffix:mid:l": 0.5, "suffix:lo:l": 0.2,
    "suffix:hi:s": 0.5, "suffix:mid:s": 0.3, "suffix:lo:s": 0.1,
    "suffix:hi:L:1": 0.7, "suffix:hi:l:1": 0.6, "suffix:hi:s:1": 0.3,
}


def suffix_key(freq: float, match_len: int, seen: int = 2) -> str:
    """Rate key: empirical continuation frequency x match length (short matches are noise) x
    whether the context was seen only once (a frequency of 1/1 is weak evidence).

    Buckets chosen by offline replay of recorded outputs (``benchmarks.offline_sim``): the
    once-seen and long (>= 6) buckets each learn a clearly different rate.
    """
    fb = "hi" if freq >= 0.8 else "mid" if freq >= 0.4 else "lo"
    ml = "L" if match_len >= 6 else "l" if match_len >= 3 else "s"
    return f"suffix:{fb}:{ml}" + (":1" if seen == 1 else "")


def grow_from_trie(
    tree: DraftTree, keys: dict, trie: SuffixTrie, node: int, match_len: int, rates: LabelRates,
    max_nodes: int, max_depth: int, min_prob: float = 0.01, label: str = "suffix",
    parent: int = ROOT, prefix: tuple[int, ...] = (), prob: float = 1.0,
) -> None:
    """Best-first expansion of ``trie`` below ``node`` into ``tree`` by path probability.

    A child's conf is the calibrated rate of its (frequency, match length) bucket, so the
    common budget can cut what does not pay. Nodes merge with what is already in ``tree``.
    """
    tie = count()
    heap = [(-prob, next(tie), node, parent, tuple(prefix), 0)]
    added = 0
    while heap and added < max_nodes:
        neg, _, tnode, parent, path, depth = heapq.heappop(heap)
        if depth >= max_depth:
            continue
        kids = list(trie.kids[tnode].items())  # a snapshot: a server thread may be adding to the trie
        total = sum(trie.count[c] for _, c in kids)
        for tok, c in kids:
            freq = trie.count[c] / total
            key = suffix_key(freq, match_len + depth, total)
            conf = rates.rate(key, SUFFIX_PRIOR.get(key, 0.3))
            score = -neg * conf
            if score < min_prob or added >= max_nodes:
                continue
            idx = tree.add(parent, tok, conf, label)
            added += 1
            sub = path + (tok,)
            if sub not in keys or conf >= tree.conf[idx]:
                keys[sub] = key  # the source with the higher conf owns the node's rate
            heapq.heappush(heap, (-score, next(tie), c, idx, sub, depth + 1))


class SuffixDrafter:
    """Drafts continuations of the longest matching suffix, from the request's own context
    (prompt + generated so far) and from the method's global history of earlier outputs."""

    label = "suffix"

    def __init__(self, history: SuffixTrie, rates: LabelRates, depth: int = 32, max_match: int = 8, max_nodes: int = 64):
        self.history, self.rates = history, rates
        self.context = ContextIndex(depth)
        self.max_match, self.max_nodes = max_match, max_nodes
        self.keys: dict[tuple[int, ...], str] = {}

    def _sync(self, tokens: list[int]) -> None:
        """Append the tokens committed since the last step (the prompt on the first step).

        Lazy, so indexing the prompt is timed as drafting, not hidden in setup.
        """
        self.context.extend(tokens[self.context.length :])

    def propose(self, ctx: DraftContext) -> DraftTree:
        tree = DraftTree()
        self.extend(ctx, tree, ROOT, 1.0)
        return tree

    def extend(self, ctx: DraftContext, tree: DraftTree, parent: int, prob: float) -> None:
        """Grow continuations of (context + the draft path to ``parent``) below ``parent`` (at the
        root: plain suffix drafting; below a drafted chain, e.g. a value after the schema's key
        text). Starts a step: the rate keys are this step's."""
        self._sync(ctx.tokens)
        self.keys = {}
        chain = [tree.tokens[i] for i in tree.path_to(parent)]
        depth = min(ctx.max_depth, self.context.depth) - len(chain)
        if depth <= 0:
            return
        tail = ctx.tokens[-self.max_match :] + chain  # all a match of <= max_match tokens can see
        here = self.context.longest_match(tail, self.max_match) if chain else self.context.active_match(self.max_match)
        found = [(self.context, here)]
        if len(self.history) > 1:
            found.append((self.history, self.history.longest_match(tail, self.max_match)))
        for trie, (node, m) in found:
            if node >= 0:
                grow_from_trie(tree, self.keys, trie, node, m, self.rates, self.max_nodes, depth,
                               parent=parent, prefix=tuple(chain), prob=prob)

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

    def __init__(self, tokenizer=None, depth: int = 32, max_match: int = 8, max_nodes: int = 64, prompt_tail: int = 8,
                 history_tokens: int = 32768):
        from .history import TenantHistories

        self.depth, self.max_match, self.max_nodes, self.prompt_tail = depth, max_match, max_nodes, prompt_tail
        self.history = TenantHistories(depth, history_tokens)  # bounded, per tenant, thread-safe
        self.rates = LabelRates(SUFFIX_PRIOR)

    def drafter(self, req) -> SuffixDrafter:
        return SuffixDrafter(self.history.trie(getattr(req, "tenant", "default")), self.rates, self.depth, self.max_match, self.max_nodes)

    def observe(self, req, output_ids: list[int], text: str) -> None:
        if getattr(req, "remember", True):
            # every output counts, repeats included: SuffixDecoding's frequencies
            self.history.add(getattr(req, "tenant", "default"), output_ids, req.prompt_ids[-self.prompt_tail :], dedupe=False)


# --------------------------------------------------------------------------- token recycling

TR_TOPK = 8
TR_RANK_PRIOR = (0.55, 0.15, 0.07, 0.05, 0.035, 0.03, 0.025, 0.02)  # shapes the static tree
# Initial acceptance rates per rank, deliberately optimistic: rates only learn from drafted
# nodes, so a pessimistic start on a steep cost curve would never draft and never learn.
TR_CONF_PRIOR = (0.8, 0.35, 0.2, 0.12, 0.08, 0.06, 0.05, 0.04)


def bfs_template(size: int = 80, prior=TR_RANK_PRIOR, max_depth: int = 10) -> list[tuple[int, int]]:
    """Static tree (parent index, top-k rank) of the ``size`` most likely nodes under a
    per-rank acceptance prior, in BFS order (parents first). Token Recycling's tree is static
    like this; the engine's budget then cuts it per step."""
    tie = count()
    heap = [(-prior[r], next(tie), ROOT, r, 1) for r in range(len(prior))]
    chosen: list[tuple[float, int, int, int, int]] = []  # (prob, id, parent id, rank, depth)
    while heap and len(chosen) < size:
        neg, nid, parent, rank, depth = heapq.heappop(heap)
        chosen.append((-neg, nid, parent, rank, depth))
        if depth < max_depth:
            for r in range(len(prior)):
                heapq.heappush(heap, (neg * prior[r], next(tie), nid, r, depth + 1))
    chosen.sort(key=lambda x: (x[4], -x[0]))  # BFS: by depth, likely first
    index = {nid: i for i, (_, nid, _, _, _) in enumerate(chosen)}
    return [(index.get(parent, ROOT), rank) for _, _, parent, rank, _ in chosen]


class TokenRecyclingDrafter:
    """Expands the static template from the root token through the adjacency matrix and
    recycles every verified row's top-k back into the matrix."""

    label = "token_recycling"

    def __init__(self, method: "TokenRecyclingMethod"):
        self.m = method
        self.root = -1
        self.context: list[int] = []  # the step's committed tokens (root chain at the end)
        self.keys: dict[tuple[int, ...], str] = {}

    def propose(self, ctx: DraftContext) -> DraftTree:
        self.root, self.context = ctx.tokens[-1], ctx.tokens[-64:]
        tree, self.keys = DraftTree(), {}
        rows: dict[int, list[int]] = {}
        placed: list[int] = []  # template index -> tree index (-2: not placed)
        paths: list[tuple[int, ...]] = []
        for parent, rank in self.m.template:
            tparent = ROOT if parent == ROOT else placed[parent]
            if tparent == -2 or (tparent != ROOT and len(paths[parent]) >= ctx.max_depth):
                placed.append(-2)
                paths.append(())
                continue
            ptok = self.root if tparent == ROOT else tree.tokens[tparent]
            row = rows.get(ptok)
            if row is None:
                row = rows[ptok] = self.m.row(ptok)
            tok = row[rank]
            if tok < 0:
                placed.append(-2)
                paths.append(())
                continue
            key = f"token_recycling:r{rank}"
            tree.tokens.append(tok)  # siblings are distinct top-k ids: no trie merge needed
            tree.parents.append(tparent)
            tree.conf.append(self.m.rates.rate(key, TR_CONF_PRIOR[rank]))
            tree.labels.append(self.label)
            path = (tok,) if tparent == ROOT else paths[parent] + (tok,)
            placed.append(len(tree.tokens) - 1)
            paths.append(path)
            self.keys[path] = key
        return tree

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None:
        update_keyed_rates(self.m.rates, tree, result, self.keys)
        if result.logits is not None:
            # logits rows: the root chain (the last R committed tokens; R > 1 when a grammar
            # forced tokens) then the tree nodes
            n_roots = min(result.logits.shape[0] - len(tree), len(self.context))
            rows = self.context[len(self.context) - n_roots :] + tree.tokens
            self.m.recycle(rows, result.logits[result.logits.shape[0] - len(rows) :])


class TokenRecyclingMethod:
    """Token Recycling: adjacency matrix [V, 8] of the last seen top-8 next tokens of each token.

    Updated from every verified row (draft tokens included, accepted or not -- that is the
    recycling); persists across requests like the paper's matrix.
    """

    name = "token_recycling"

    def __init__(self, tokenizer=None, vocab_size: int | None = None, tree_size: int = 80, topk: int = TR_TOPK):
        self.vocab_size = vocab_size or (len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else 0)
        self.topk = topk
        self.template = bfs_template(tree_size, TR_RANK_PRIOR[:topk])
        self.matrix = torch.full((max(self.vocab_size, 1), topk), -1, dtype=torch.int32)  # [V, k]; -1 = unseen
        self.rates = LabelRates({f"token_recycling:r{r}": p for r, p in enumerate(TR_CONF_PRIOR[:topk])})

    def _grow(self, vocab: int) -> None:
        """Tokenizer length can undercount the model's padded vocab; grow on demand."""
        extra = torch.full((vocab - self.matrix.shape[0], self.topk), -1, dtype=torch.int32)
        self.matrix = torch.cat([self.matrix, extra])

    def row(self, tok: int) -> list[int]:
        return self.matrix[tok].tolist() if 0 <= tok < self.matrix.shape[0] else [-1] * self.topk

    def recycle(self, row_tokens: list[int], logits: torch.Tensor) -> None:
        """logits: [R+T, V] for input rows ``row_tokens`` (root chain first)."""
        if logits.shape[-1] > self.matrix.shape[0]:
            self._grow(logits.shape[-1])
        top = torch.topk(logits, self.topk, dim=-1).indices.to("cpu", torch.int32)  # [T+1, k]
        self.matrix[torch.tensor(row_tokens, dtype=torch.long)] = top

    def drafter(self, req) -> TokenRecyclingDrafter:
        return TokenRecyclingDrafter(self)

    def observe(self, req, output_ids: list[int], text: str) -> None:
        return None  # the matrix learns from verification logits, not from text
