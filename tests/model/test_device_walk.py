"""The device walk of all greedy trees at once equals ``greedy_walk`` per tree (random tries of every shape)."""

from __future__ import annotations

import random

import pytest
import torch

from toolspec_core.engine.verify import greedy_walk
from toolspec_core.model.device_walk import accept_greedy, device_walk, read_walks, walk_inputs
from toolspec_core.spec.tree import ROOT, DraftTree

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VOCAB = 3  # few tokens: many matches, deep accepted paths, siblings that differ by one token


def _tree(rng: random.Random, size: int, shape: str) -> DraftTree:
    tree = DraftTree()
    while len(tree) < size:
        before = len(tree)
        if shape == "chain":
            parent = len(tree) - 1
        elif shape == "wide":
            parent = ROOT
        else:
            parent = rng.randrange(-1, len(tree))
        tree.add(parent, rng.randrange(VOCAB), 0.5, "t")
        if len(tree) == before and shape != "random":  # a chain / star with every token taken: stop
            break
        if len(tree) == before and rng.random() < 0.2:
            break
    return tree


@st.composite
def batches(draw):
    """(trees, root_rows, logit rows before the trees, argmax of every row)."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    b = draw(st.integers(1, 9))
    shapes = [draw(st.sampled_from(["empty", "chain", "wide", "random"])) for _ in range(b)]
    trees = [_tree(rng, 0 if s == "empty" else draw(st.integers(1, 24)), s) for s in shapes]
    root_rows = [draw(st.integers(0, 3)) for _ in range(b)]  # forced tokens before the root
    lead = draw(st.integers(0, 4))  # e.g. prefill chunks' last rows first
    m = lead + sum(r + 1 + len(t) for r, t in zip(root_rows, trees))
    choice = [rng.randrange(VOCAB) for _ in range(m)]
    return trees, root_rows, lead, choice


def _bases(trees, root_rows, lead):
    bases, starts, o = [], [], lead
    for tree, r in zip(trees, root_rows):
        starts.append(o)
        bases.append(o + r)
        o += r + 1 + len(tree)
    return bases, starts


@settings(max_examples=300, deadline=None)
@given(batches())
def test_device_walk_equals_greedy_walk(case):
    trees, root_rows, lead, choice = case
    bases, starts = _bases(trees, root_rows, lead)
    out = device_walk(torch.tensor(choice), walk_inputs(trees, bases))
    assert out.shape == (len(trees), 2 + max(len(t) for t in trees))
    for got, tree, r, s in zip(read_walks(out.tolist()), trees, root_rows, starts):
        want = greedy_walk(tree, choice[s : s + r + 1 + len(tree)], r)
        assert (got.path, got.token) == (want.path, want.token)


@settings(max_examples=100, deadline=None)
@given(batches(), st.data())
def test_accept_greedy_returns_the_walks_and_the_asked_rows(case, data):
    trees, root_rows, lead, choice = case
    bases, starts = _bases(trees, root_rows, lead)
    need = data.draw(st.lists(st.integers(0, len(choice) - 1), max_size=6))
    keep = data.draw(st.lists(st.booleans(), min_size=len(trees), max_size=len(trees)))  # some walk on the host
    walked = [i for i, k in enumerate(keep) if k]
    walks, picked = accept_greedy(torch.tensor(choice), [trees[i] for i in walked], [bases[i] for i in walked], need)
    assert picked == [choice[j] for j in need]
    for got, i in zip(walks, walked):
        want = greedy_walk(trees[i], choice[starts[i] : starts[i] + root_rows[i] + 1 + len(trees[i])], root_rows[i])
        assert (got.path, got.token) == (want.path, want.token)
    assert len(walks) == len(walked)


def test_deep_chain_accepted_to_the_end_and_cut_in_the_middle():
    tree = DraftTree()
    tree.add_path([1] * 40, 0.5, "t")  # 40 deep: six pointer-jumping rounds
    full = [1] * 41
    cut = [1] * 20 + [2] + [1] * 20  # node 19's row wants 2: the path stops after node 19
    for choice, n in ((full, 40), (cut, 20)):
        (got,) = read_walks(device_walk(torch.tensor(choice), walk_inputs([tree], [0])).tolist())
        assert got.path == list(range(n)) and got.token == choice[n]


def test_is_trie():
    tree = DraftTree()
    tree.add_path([1, 2], 0.5, "t")
    tree.add_path([1, 3], 0.5, "t")
    assert tree.is_trie()
    assert not DraftTree(tokens=[5, 5], parents=[ROOT, ROOT], conf=[1, 1], labels=["a", "a"]).is_trie()
    assert DraftTree(tokens=[5, 6], parents=[ROOT, ROOT], conf=[1, 1], labels=["a", "a"]).is_trie()
