"""The compiled suffix walk (``kernels/suffix_walk.c``, ``suffix.walk_batch``) grows the Python
walk's trees bit for bit: random documents with many repeats, history tries, learned rates, walks
below a drafted chain into a tree that already holds nodes (merges), several sequences in one
call. On recorded traffic the schema drafter's batched trees are compared with the reference
drafter's in ``test_batch_drafting.py``."""

from __future__ import annotations

import random

import pytest

from toolspec_core.drafters import tree_kernel
from toolspec_core.drafters.base import LabelRates
from toolspec_core.drafters.suffix import KEYS, SUFFIX_PRIOR, SuffixDrafter, suffix_key, walk_batch
from toolspec_core.drafters.suffix_trie import SuffixTrie
from toolspec_core.spec.proposer import DraftContext
from toolspec_core.spec.tree import ROOT, DraftTree

pytestmark = pytest.mark.skipif(tree_kernel.load_suffix() is None, reason="no C compiler / Python headers here")


def test_keys_are_every_suffix_key_in_the_kernels_order():
    for fb, freq in enumerate((0.9, 0.5, 0.1)):
        for ml, match in enumerate((7, 4, 1)):
            for once in (0, 1):
                assert KEYS[(fb * 3 + ml) * 2 + once] == suffix_key(freq, match, 1 if once else 2)


def _rates(rng: random.Random) -> LabelRates:
    rates = LabelRates(SUFFIX_PRIOR)
    for key in KEYS:
        for _ in range(rng.randrange(0, 5)):
            rates.count(key, rng.random() < 0.6)
    return rates


def _history(rng: random.Random, vocab: int, depth: int) -> SuffixTrie:
    trie = SuffixTrie(depth)
    for _ in range(rng.randrange(0, 4)):
        trie.add_document([rng.randrange(vocab) for _ in range(rng.randint(1, 80))])
    return trie


def _start(rng: random.Random, vocab: int) -> tuple[DraftTree, int, float]:
    """A tree the walk grows into: empty (plain suffix drafting), or a drafted chain with side
    branches, the walk below one of its nodes (a schema draft's chain end)."""
    tree = DraftTree()
    if rng.random() < 0.4:
        return tree, ROOT, 1.0
    node = ROOT
    for _ in range(rng.randint(1, 5)):
        node = tree.add(node, rng.randrange(vocab), rng.random(), "value")
        if rng.random() < 0.5:
            tree.add(node, rng.randrange(vocab), rng.random(), "arg_name")
    return tree, node, rng.choice([1.0, 0.5, rng.random()])


def _fields(tree: DraftTree):
    return tree.tokens, tree.parents, tree.conf, tree.labels


@pytest.mark.parametrize("seed", range(8))
def test_compiled_walk_grows_the_python_trees_bit_for_bit(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 20])  # small vocabularies: many repeats, deep shared suffixes
    depth = rng.choice([4, 8, 32])
    n_seq = rng.randint(1, 5)
    docs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in range(n_seq)]
    history, rates = _history(rng, vocab, depth), _rates(rng)
    max_nodes = rng.choice([8, 64])
    fast = [SuffixDrafter(history, rates, depth, rng.choice([1, 3, 8]), max_nodes) for _ in docs]
    ref = [SuffixDrafter(history, rates, d.context.depth, d.max_match, max_nodes, compiled=False) for d in fast]
    assert all(d.compiled for d in fast) and not any(d.compiled for d in ref)
    pos = [0] * n_seq
    steps = 0
    while any(p < len(doc) for p, doc in zip(pos, docs)):
        jobs, pairs = [], []
        for k, doc in enumerate(docs):
            if pos[k] >= len(doc):
                continue
            pos[k] = min(len(doc), pos[k] + rng.randint(1, 30))
            prompt = rng.randint(0, pos[k])
            ctx = DraftContext(doc[: pos[k]], prompt, rng.choice([2, 16, 64]))
            seed_tree = rng.random()
            t_fast, parent, prob = _start(random.Random(seed_tree), vocab)
            t_ref, _, _ = _start(random.Random(seed_tree), vocab)
            job = fast[k].walk_job(ctx, t_fast, parent, prob)
            if job is not None:
                jobs.append(job)
            ref[k].extend(ctx, t_ref, parent, prob)
            pairs.append((k, t_fast, t_ref))
        walk_batch(jobs)  # the step's sequences in one call
        for k, a, b in pairs:
            assert _fields(a) == _fields(b)
            assert fast[k].keys == ref[k].keys
            assert a.is_trie() and len(a._kids) == len(a)  # the child index kept in step
            steps += 1
    assert steps > n_seq


def test_suffix_drafter_batch_equals_one_by_one():
    rng = random.Random(7)
    history, rates = _history(rng, 5, 16), _rates(rng)
    docs = [[rng.randrange(5) for _ in range(120)] for _ in range(4)]
    batched = [SuffixDrafter(history, rates, 16) for _ in docs]
    alone = [SuffixDrafter(history, rates, 16, compiled=False) for _ in docs]
    for n in (10, 40, 120):
        ctxs = [DraftContext(doc[:n], 5, 32) for doc in docs]
        trees = SuffixDrafter.propose_batch(batched, ctxs)
        assert trees is not None
        for d, c, t in zip(alone, ctxs, trees):
            assert _fields(t) == _fields(d.propose(c))
    assert SuffixDrafter.propose_batch(alone, ctxs) is None  # the Python walk drafts one by one
