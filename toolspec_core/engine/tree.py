"""Draft trees: the one encoding used everywhere (parent indices).

A draft tree hangs off the *root*, the last committed token whose KV is not yet in
the cache. Node ``i`` carries ``tokens[i]``, its parent ``parents[i]`` (``-1`` = the
root, otherwise an index ``< i``), ``conf[i]`` -- the drafter's estimate of
P(node accepted | parent accepted) -- and ``labels[i]``, the drafting source/state
(for per-state statistics). Parents precede children, so any root-to-node path has
increasing indices, which lets the KV commit be a gather + crop by index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROOT = -1


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    # (parent, token) -> node: child lookup in O(1) while candidates are merged into the tree
    _kids: dict = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, parent: int, token: int) -> int:
        """Index of ``parent``'s child with ``token``, or -1."""
        if len(self._kids) != len(self.tokens):  # built field by field (tests): index it once
            self._kids = {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens))}
        return self._kids.get((parent, token), -1)

    def _append(self, parent: int, token: int, conf: float, label: str) -> int:
        self.child(parent, token)  # keep the index in step
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.conf.append(float(conf))
        self.labels.append(label)
        self._kids[(int(parent), int(token))] = len(self.tokens) - 1
        return len(self.tokens) - 1

    def add(self, parent: int, token: int, conf: float, label: str) -> int:
        """Insert (or merge into an existing identical child) and return the node index."""
        existing = self.child(parent, token)
        if existing >= 0:
            if conf > self.conf[existing]:
                self.conf[existing] = conf
                self.labels[existing] = label
            return existing
        return self._append(parent, token, conf, label)

    def add_path(self, tokens, conf, label: str, parent: int = ROOT) -> int:
        """Insert a chain under ``parent`` (trie merge); ``conf`` is a float or one per token.

        Returns the index of the last node (or ``parent`` if ``tokens`` is empty).
        """
        node = parent
        for j, tok in enumerate(tokens):
            c = conf[j] if isinstance(conf, (list, tuple)) else conf
            node = self.add(node, tok, c, label)
        return node

    def merge(self, other: "DraftTree", parent: int = ROOT) -> None:
        """Trie-merge every node of ``other`` under ``parent`` of this tree."""
        remap: dict[int, int] = {ROOT: parent}
        for i, tok in enumerate(other.tokens):
            remap[i] = self.add(remap[other.parents[i]], tok, other.conf[i], other.labels[i])

    def children(self, node: int) -> list[int]:
        return [i for i in range(max(node + 1, 0), len(self.tokens)) if self.parents[i] == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (increasing)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def depths(parents: list[int]) -> list[int]:
    """Depth of each node; the root's children have depth 1."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p == ROOT else out[p] + 1)
    return out


def tried(parents: list[int], path: list[int]) -> list[int]:
    """Nodes that had their chance in a verify step: the root's children and the children of the
    accepted ``path``. Acceptance rates count exactly these as tries (a child of a rejected node
    was never compared with the target)."""
    reached = {ROOT, *path}
    return [i for i, p in enumerate(parents) if p in reached]


def path_probs(tree: DraftTree) -> list[float]:
    """P(node is accepted) = product of ``conf`` along its path (parents precede children)."""
    out: list[float] = []
    for i, p in enumerate(tree.parents):
        out.append(tree.conf[i] * (1.0 if p == ROOT else out[p]))
    return out


def select(tree: DraftTree, keep: list[int]) -> DraftTree:
    """Sub-tree made of the nodes ``keep`` (must be closed under parents), re-indexed in order."""
    keep = sorted(keep)
    remap = {ROOT: ROOT}
    out = DraftTree()
    for i in keep:
        remap[i] = out._append(remap[tree.parents[i]], tree.tokens[i], tree.conf[i], tree.labels[i])
    return out


def prune_to_budget(tree: DraftTree, cost: "list[float]", max_nodes: int | None = None) -> DraftTree:
    """Keep the node set that maximises expected tokens per unit of verify cost.

    ``cost[k]`` is the relative cost of a forward of ``k`` new tokens (root included, so
    ``cost[1] == 1`` is plain decoding). Nodes are ranked by path probability -- a node never
    ranks above its parent since ``conf <= 1`` -- and the best prefix of that ranking is kept:
    argmax over n of ``(1 + sum of top-n path probs) / cost[n + 1]``. n = 0 (draft nothing)
    is always a candidate, so a step never costs more than it is expected to gain.
    """
    if not tree.tokens:
        return tree
    probs = path_probs(tree)
    limit = len(cost) - 2 if max_nodes is None else min(max_nodes, len(cost) - 2)
    # Stable order: by probability, parents before children on ties.
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))[: max(limit, 0)]
    best_n, best_rate, gain = 0, 1.0 / cost[1], 1.0
    for n, i in enumerate(order, start=1):
        gain += probs[i]
        rate = gain / cost[n + 1]
        if rate > best_rate:
            best_n, best_rate = n, rate
    keep = set(order[:best_n])
    # Ties can leave a child without its parent; close the set under parents.
    for i in list(keep):
        p = tree.parents[i]
        while p != ROOT and p not in keep:
            keep.add(p)
            p = tree.parents[p]
    return select(tree, list(keep))
