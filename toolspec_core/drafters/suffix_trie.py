"""A depth-limited suffix trie with occurrence counts (SuffixDecoding's structure)."""

from __future__ import annotations



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
