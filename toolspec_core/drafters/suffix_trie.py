"""Suffix tries with occurrence counts (SuffixDecoding's structure): a growing one over documents
(the history of earlier outputs) and one built on demand over a single request's context."""

from __future__ import annotations


def grow(kids: list[dict[int, int]], count: list[int], node: int, tok: int) -> int:
    """The child of ``node`` with ``tok`` (created if new), its count incremented: the one way a
    trie node is made. The node exists before it is published in ``kids[node]``, so readers in
    other threads never see a dangling index."""
    edges = kids[node]
    c = edges.get(tok)
    if c is None:
        c = len(kids)
        kids.append({})
        count.append(0)
        edges[tok] = c
    count[c] += 1
    return c


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

    def start_document(self) -> None:
        """Suffixes never span two documents."""
        self.active = []

    def append(self, tok: int) -> None:
        kids, count = self.kids, self.count
        active = [0]
        active += self.active[: self.depth - 1]
        for i, node in enumerate(active):
            active[i] = grow(kids, count, node, tok)
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
    (``tests/drafters/test_suffix_trie.py`` checks this against it). ``kids`` / ``count`` are that subtrie;
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

    lazy = True  # False: the eager build (the reference the lazy one is tested against)

    def _build(self, ends: list[int], m: int) -> None:
        """The subtrie below the matched suffix: each occurrence's continuation, up to depth - m
        tokens. Built lazily, a node's children when a reader first asks for them
        (:class:`LazySubtrie`): drafting expands a few dozen nodes of a subtrie that can hold
        thousands."""
        if self.lazy:
            sub = LazySubtrie(self.tokens, ends, self.depth - m)
            self.kids, self.count = sub, sub.count
            return
        toks, n = self.tokens, len(self.tokens)
        kids, count = [{}], [0]
        for e in ends:  # ascending: children appear in the order the full trie creates them
            node = 0
            for t in toks[e + 1 : min(e + 1 + self.depth - m, n)]:
                node = grow(kids, count, node, t)
        self.kids, self.count = kids, count

    def longest_match(self, tokens: list[int], max_match: int) -> tuple[int, int]:
        """As ``SuffixTrie.longest_match`` (node 0 of the rebuilt ``kids``)."""
        return self._match(tokens, min(max_match, len(tokens), self.depth - 1))

    def active_match(self, max_match: int) -> tuple[int, int]:
        """As ``SuffixTrie.active_match``: the document's own current suffix."""
        return self._match(self.tokens, min(max_match, len(self.tokens), self.depth - 1))


class LazySubtrie:
    """``kids`` of a :class:`ContextIndex` match: node ``i``'s children (token -> node) made from
    the occurrences through it on first access, in the order an eager build creates them (by
    ascending occurrence), with their counts in ``count``. Node 0 is the matched suffix."""

    def __init__(self, tokens: list[int], ends: list[int], depth: int):
        self.tokens, self.depth, self.n = tokens, depth, len(tokens)  # the document as matched
        self.occ: list[list[int]] = [list(ends)]  # node -> end positions of the occurrences through it
        self.at: list[int] = [0]  # node -> tokens below the matched suffix
        self.made: list[dict[int, int] | None] = [None]
        self.count: list[int] = [0]

    def __len__(self) -> int:
        return len(self.made)

    def __getitem__(self, node: int) -> dict[int, int]:
        kids = self.made[node]
        if kids is None:
            kids = self.made[node] = {}
            d = self.at[node]
            if d < self.depth:
                toks, n = self.tokens, self.n
                occ, at, made, count = self.occ, self.at, self.made, self.count
                for e in occ[node]:
                    p = e + 1 + d
                    if p >= n:
                        continue
                    c = kids.get(toks[p])
                    if c is None:
                        c = len(made)
                        occ.append([])
                        at.append(d + 1)
                        made.append(None)
                        count.append(0)
                        kids[toks[p]] = c
                    occ[c].append(e)
                    count[c] += 1
        return kids
