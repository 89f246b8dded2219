"""Draft trees: the parent-index encoding, sub-tree selection and the budget's pruning rule."""

from __future__ import annotations

import random

import pytest
import torch

from toolspec_core.engine.budget import interpolate
from toolspec_core.engine.verify import tree_inputs
from toolspec_core.model.batch_forward import tree_masks, widen
from toolspec_core.spec.tree import (
    DraftTree,
    allocate_batch,
    cut_kernel,
    depths,
    path_probs,
    prune_to_budget,
    select,
)


def test_tree_encoding_and_mask():
    tree = DraftTree()
    a = tree.add_path([10, 11, 12], 0.9, "x")
    b = tree.add_path([10, 13], 0.5, "y")  # shares the first node
    assert tree.tokens == [10, 11, 12, 13] and tree.parents == [-1, 0, 1, 0]
    assert (a, b) == (2, 3)
    assert depths(tree.parents) == [1, 2, 3, 2]
    ids, pos, parents = tree_inputs(7, tree, prefix_len=5)
    assert ids.tolist() == [[7, 10, 11, 12, 13]]
    assert pos.tolist() == [[5, 6, 7, 8, 7]]
    assert parents == [-1, 0, 1, 2, 1]  # the root off the cache, each node off its parent's row
    mask = tree_masks(parents, [5], torch.float32)[0]
    assert mask.shape == (1, 1, 5, 5)  # the new rows only: every row sees the whole prefix
    visible = (widen(mask, 5)[0, 0] == 0).int()
    assert visible[:, :5].all()  # everyone sees the prefix
    assert visible[:, 5:].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]


def test_prune_to_budget_keeps_what_pays():
    curve = interpolate({1: 1.0, 2: 2.2, 4: 2.4, 8: 2.7, 16: 3.5, 32: 4.6, 64: 6.6}, 64)
    sure = DraftTree()
    sure.add_path(list(range(10, 20)), 0.99, "schema")
    assert len(prune_to_budget(sure, curve)) == 10
    unsure = DraftTree()
    unsure.add_path([5, 6], 0.3, "guess")
    assert len(prune_to_budget(unsure, curve)) == 0  # a 1-2 token guess never pays on this curve
    flat = interpolate({1: 1.0, 64: 1.0}, 64)
    assert len(prune_to_budget(unsure, flat)) == 2
    # the kept set is closed under parents and ordered by path probability
    wide = DraftTree()
    for t in range(20):
        wide.add_path([100 + t, 200 + t, 300 + t], [0.05, 0.99, 0.99], "name")
    kept = prune_to_budget(wide, curve)
    assert all(p == -1 or p < i for i, p in enumerate(kept.parents))
    assert max(path_probs(kept), default=0) <= 0.05


def test_select_reindexes():
    tree = DraftTree()
    tree.add_path([1, 2, 3], 0.9, "a")
    tree.add_path([4, 5], 0.9, "b")
    sub = select(tree, [0, 1, 3])
    assert sub.tokens == [1, 2, 4] and sub.parents == [-1, 0, -1]


def test_allocate_across_a_batch_on_a_hand_computed_curve():
    """Two sequences: A drafts a sure chain (path probs 0.9, 0.81), B one guess (0.5); both roots run.

    rows 2 (roots only): 2 / 1.2 = 1.67 tokens per cost; + a1: 2.9 / 1.3 = 2.23; + a2: 3.71 / 1.4
    = 2.65; + b1: 4.21 / 2.8 = 1.50 -> keep A's chain, draft nothing for B. With a 5-row forward
    at 1.5, + b1 gives 4.21 / 1.5 = 2.81 > 2.65 -> keep everything.
    """
    from toolspec_core.spec.tree import allocate

    a, b = DraftTree(), DraftTree()
    a.add_path([10, 11], 0.9, "x")
    b.add(-1, 20, 0.5, "x")
    dear = [0.0, 1.0, 1.2, 1.3, 1.4, 2.8, 3.0]
    kept = allocate([a, b], dear, base_rows=2)
    assert kept[0].tokens == [10, 11] and kept[1].tokens == []
    cheap = dear[:5] + [1.5, 3.0]
    kept = allocate([a, b], cheap, base_rows=2)
    assert kept[0].tokens == [10, 11] and kept[1].tokens == [20]
    # compute-bound (cost proportional to rows, a big batch): no guess below certainty pays
    bound = [float(k) for k in range(12)]
    assert [len(t) for t in allocate([a, b], bound, base_rows=2)] == [0, 0]
    # a batch of one is prune_to_budget
    assert allocate([a], dear, base_rows=1)[0].tokens == prune_to_budget(a, dear).tokens


def test_an_allocation_says_the_best_node_it_left_out():
    """``allocate_batch``'s ``left_out``: the path probability of the most probable node not kept
    (the drafters' floor for the next step comes from it); 0.0 when every node is kept."""
    from toolspec_core.spec.tree import allocate_batch

    a, b = DraftTree(), DraftTree()
    a.add_path([10, 11], 0.9, "x")
    b.add(-1, 20, 0.5, "x")
    dear = [0.0, 1.0, 1.2, 1.3, 1.4, 2.8, 3.0]
    cut = allocate_batch([a, b], dear, base_rows=2)
    assert [t.tokens for t in cut.trees] == [[10, 11], []] and cut.left_out == pytest.approx(0.5)
    assert allocate_batch([a, b], dear[:5] + [1.5, 3.0], base_rows=2).left_out == 0.0
    bound = [float(k) for k in range(12)]
    assert allocate_batch([a, b], bound, base_rows=2).left_out == pytest.approx(0.9)  # nothing kept
    assert allocate_batch([DraftTree()], dear, base_rows=1).left_out == 0.0


def _random_tree(rng, n: int, vocab: int = 6) -> DraftTree:
    tree = DraftTree()
    for _ in range(n):
        tree.add(rng.randrange(-1, len(tree)), rng.randrange(vocab), rng.random(), rng.choice("abc"))
    return tree


def test_merge_is_adding_each_node_in_order():
    """``merge`` (one loop) against ``add`` node by node: shared prefixes found, new nodes appended
    in order, a node already there keeping the higher conf and its label; under the root or a node."""
    rng = random.Random(8)
    for _ in range(500):
        a, b = _random_tree(rng, rng.randrange(0, 12)), _random_tree(rng, rng.randrange(0, 12))
        parent = rng.randrange(-1, len(a)) if len(a) else -1
        ref = DraftTree(list(a.tokens), list(a.parents), list(a.conf), list(a.labels))
        remap = {-1: parent}
        for i, tok in enumerate(b.tokens):
            remap[i] = ref.add(remap[b.parents[i]], tok, b.conf[i], b.labels[i])
        a.merge(b, parent)
        assert (a.tokens, a.parents, a.conf, a.labels) == (ref.tokens, ref.parents, ref.conf, ref.labels)
        assert a.is_trie()


@pytest.mark.skipif(cut_kernel() is None, reason="no C compiler / Python headers here")
def test_the_compiled_cut_is_the_python_one():
    """``allocate_batch`` in one C call against its Python loop: random batches of trees (ties of
    path probability among and across trees, zero confidences, empty trees), capped or not, on
    random increasing curves and a flat one, with few or many root rows -- the same trees kept node
    for node and the same left-out probability, bit for bit."""
    rng = random.Random(21)
    for _ in range(400):
        trees = []
        for _ in range(rng.randint(1, 12)):
            tree = DraftTree()
            for _ in range(rng.randint(0, 30)):
                conf = rng.choice([0.5, 0.25, 1.0, 0.0, rng.random(), rng.random()])
                tree.add(rng.randrange(-1, len(tree)), rng.randrange(50), conf, "x")
            trees.append(tree)
        rows = sum(len(t) for t in trees) + 40
        steps = [rng.random() * rng.choice([0.0, 0.05, 0.3]) for _ in range(rows)]
        curve = [1.0]
        for d in steps:
            curve.append(curve[-1] + d)
        if rng.random() < 0.2:
            curve = curve[: rng.randint(1, len(curve))]  # a curve shorter than the rows
        base = rng.randint(len(trees), len(trees) + 3)
        cap = rng.choice([None, None, 1, 3, 8])
        if rng.random() < 0.1:  # a tree built from tuples (fields a caller made)
            t = trees[0]
            trees[0] = DraftTree(tuple(t.tokens), tuple(t.parents), tuple(t.conf), tuple(t.labels))
        fast = allocate_batch(trees, curve, base, cap)
        ref = allocate_batch(trees, curve, base, cap, compiled=False)
        assert fast.left_out == ref.left_out
        for a, b in zip(fast.trees, ref.trees):
            assert (a.tokens, a.parents, a.conf, a.labels) == (b.tokens, b.parents, b.conf, b.labels)
