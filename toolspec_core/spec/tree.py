"""Draft trees: the one encoding used everywhere (parent indices).

A draft tree hangs off the *root*, the last committed token whose KV is not yet in
the cache. Node ``i`` carries ``tokens[i]``, its parent ``parents[i]`` (``-1`` = the
root, otherwise an index ``< i``), ``conf[i]`` -- the drafter's estimate of
P(node accepted | parent accepted) -- and ``labels[i]``, the drafting source/state
(for per-state statistics). Parents precede children, so any root-to-node path has
increasing indices, which lets the KV commit be a gather + crop by index.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

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

    def is_trie(self) -> bool:
        """No two children of one node carry the same token (what ``add`` keeps): then at most one
        chain of nodes can match the target, which the device walk relies on."""
        self.child(ROOT, -1)  # index a tree built field by field
        return len(self._kids) == len(self.tokens)

    def _append(self, parent: int, token: int, conf: float, label: str) -> int:
        """A new node; callers have indexed the tree already (``child``), so ``_kids`` is in step."""
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

    def add_chain(self, tokens, labels, parent: int = ROOT) -> list[int]:
        """Insert a chain under ``parent`` (trie merge, conf 1.0 for new nodes, an existing node keeps
        its label); the node index of every token, in order -- what a caller accumulates per node."""
        self.child(parent, ROOT)  # index a tree built field by field (no token is -1)
        kids = self._kids
        out, node = [], parent
        for tok, lab in zip(tokens, labels):
            nxt = kids.get((node, tok), -1)
            if nxt < 0:
                nxt = self._append(node, tok, 1.0, lab)
            out.append(nxt)
            node = nxt
        return out

    def merge(self, other: "DraftTree", parent: int = ROOT) -> None:
        """Trie-merge every node of ``other`` under ``parent`` of this tree: :meth:`add` of each
        node in order (a node already here keeps the higher conf and its label), in one loop --
        drafting merges the suffix, value and retrieval trees into the schema tree every step."""
        if not other.tokens:
            return
        self.child(ROOT, ROOT)  # index a tree built field by field
        kids, tokens, parents, conf, labels = self._kids, self.tokens, self.parents, self.conf, self.labels
        remap: list[int] = []
        for tok, p, c, lab in zip(other.tokens, other.parents, other.conf, other.labels):
            at = parent if p == ROOT else remap[p]
            tok, c = int(tok), float(c)
            j = kids.get((at, tok), -1)
            if j < 0:
                j = len(tokens)
                tokens.append(tok)
                parents.append(at)
                conf.append(c)
                labels.append(lab)
                kids[(at, tok)] = j
            elif c > conf[j]:
                conf[j] = c
                labels[j] = lab
            remap.append(j)

    def children(self, node: int) -> list[int]:
        return [i for i in range(max(node + 1, 0), len(self.tokens)) if self.parents[i] == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (increasing)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


@dataclass
class VerifyResult:
    """What verifying a tree decided: the accepted node path and the one token the target chose
    after it. It lives beside the tree (not with the forward that produces it) so drafters, which
    learn from it, never import the model layer."""

    path: list[int]  # accepted node indices, root's child first
    token: int  # the one token chosen by the target after the path
    logits: torch.Tensor | None = field(default=None, repr=False)  # [T+1, V] target logits per row


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
    """Keep the node set of one sequence's tree that maximises expected tokens per unit of verify
    cost: :func:`allocate` for a batch of one (one root row, one token it always yields)."""
    return allocate([tree], cost, base_rows=1, max_nodes=max_nodes)[0]


class Allocation(NamedTuple):
    """A batch's trees cut by :func:`allocate_batch`, and the path probability of the best node
    it left out (0.0: none was): no node less probable was worth its row in this step, which is
    what a drafter may skip building in the next (``DraftContext.min_prob``)."""

    trees: "list[DraftTree]"
    left_out: float


def allocate(
    trees: "list[DraftTree]",
    cost: "list[float]",
    base_rows: int,
    max_nodes: int | None = None,
) -> "list[DraftTree]":
    """The trees :func:`allocate_batch` keeps."""
    return allocate_batch(trees, cost, base_rows, max_nodes).trees


CUT_SOURCE = Path(__file__).parent / "kernels" / "tree_cut.c"


@functools.lru_cache(maxsize=1)
def cut_kernel():
    """The compiled cut (``kernels/tree_cut.c``), or None where it cannot be built or
    ``TOOLSPEC_CUT_KERNEL=0``: :func:`allocate_batch` then runs its Python loop, the reference."""
    from toolspec_core.native import load_module

    return load_module(CUT_SOURCE, "toolspec_tree_cut", "TOOLSPEC_CUT_KERNEL", "the budget cuts in Python")


def allocate_batch(
    trees: "list[DraftTree]",
    cost: "list[float]",
    base_rows: int,
    max_nodes: int | None = None,
    compiled: bool = True,
) -> Allocation:
    """One budget across a batch: the node sets that maximise expected tokens per unit of cost.

    ``cost[k]`` is the relative cost of a forward of ``k`` rows in all. ``base_rows`` rows run
    whatever is chosen (every sequence's root chain); each of the ``len(trees)`` sequences yields
    one token from its root. A node adds its path probability (the product of ``conf`` down to
    it) to the expected tokens and one row to the forward. Nodes of all trees are ranked together
    by path probability -- a node never ranks above its parent since ``conf <= 1`` -- and the best
    prefix of the ranking is kept: argmax over n of ``(len(trees) + sum of the top-n
    probabilities) / cost[base_rows + n]``. n = 0 (draft nothing) is always a candidate, so a
    step is never expected to be slower than plain decoding of the same sequences; as the batch
    grows each extra row costs more and trees shrink. ``max_nodes`` caps each tree.

    A prefill chunk sharing the forward takes no part: the decoding sequences' trees are what a
    decode-only step of theirs would keep (running sequences first, as vLLM v1 schedules their
    speculative tokens), and the chunk's rows come on top (the scheduler's own budget), so a
    decoding sequence keeps its draft while prompts wait.

    ``compiled``: the ranking, the best prefix and the closure under parents in one C call where it
    is built (:func:`cut_kernel`, the same cut exactly); this Python loop is the reference.
    """
    if not any(t.tokens for t in trees):
        return Allocation(list(trees), 0.0)
    kernel = cut_kernel() if compiled else None
    if kernel is not None:
        kept, left_out = kernel.cut(
            [(_as_list(t.parents), _as_list(t.conf)) for t in trees],
            cost if isinstance(cost, list) else [float(c) for c in cost],
            base_rows,
            -1 if max_nodes is None else max_nodes,
        )
        return Allocation([t if k is None else select(t, k) for t, k in zip(trees, kept)], left_out)
    ranked = []  # (-prob, tree index, node): stable, parents before children on ties
    for ti, tree in enumerate(trees):
        probs = path_probs(tree)
        if max_nodes is None or len(probs) <= max_nodes:  # every node ranks: the sort below orders them
            ranked += [(-p, ti, i) for i, p in enumerate(probs)]
        else:  # the tree's own best ``max_nodes`` first
            best = heapq.nsmallest(max_nodes, [(-p, i) for i, p in enumerate(probs)])
            ranked += [(neg, ti, i) for neg, i in best]
    ranked.sort()
    tokens = [float(len(trees))]  # expected tokens of the step with the top-n nodes: one per root, then theirs
    for neg, _, _ in ranked:
        tokens.append(tokens[-1] - neg)
    best_n = best_prefix(tokens, cost, base_rows)
    keep: list[set[int]] = [set() for _ in trees]
    for _, ti, i in ranked[:best_n]:
        keep[ti].add(i)
    out = []
    for tree, nodes in zip(trees, keep):
        for i in list(nodes):  # ties can leave a child without its parent; close the set under parents
            p = tree.parents[i]
            while p != ROOT and p not in nodes:
                nodes.add(p)
                p = tree.parents[p]
        out.append(select(tree, list(nodes)) if len(nodes) < len(tree) else tree)
    return Allocation(out, -ranked[best_n][0] if best_n < len(ranked) else 0.0)


def _as_list(xs) -> list:
    """``xs`` itself where it is a list (a tree's fields are), else a list of it (the C cut reads lists)."""
    return xs if type(xs) is list else list(xs)


def best_prefix(tokens: list[float], cost: list[float], base_rows: int) -> int:
    """The n maximising ``tokens[n] / cost[base_rows + n]`` (n = 0 included, the
    smallest n on ties) -- the decode-only step's best tokens per unit of cost."""
    limit = max(0, min(len(tokens) - 1, len(cost) - 1 - base_rows))
    best_n, best_rate = 0, tokens[0] / cost[min(base_rows, len(cost) - 1)]
    for n in range(1, limit + 1):
        rate = tokens[n] / cost[base_rows + n]
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n
