"""The compiled tree merge (``drafters/tree_kernel``) builds the Python loop's tree bit for bit:
randomized candidates (shared prefixes, chain labels, the node cap's stop, long candidates cut at
``max_tokens``, probabilities with ties) and learned rates. On recorded traffic the drafter's
trees, compiled against the Python reference, are compared in ``test_batch_drafting.py``."""

from __future__ import annotations

import random

import pytest

from toolspec_core.drafters import tree_kernel
from toolspec_core.drafters.base import LabelRates
from toolspec_core.drafters.toolcall.candidates import Cand
from toolspec_core.drafters.toolcall.drafter import DEFAULT_RATES, candidates_to_tree
from toolspec_core.spec import labels as lbl

kernel = tree_kernel.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler / Python headers here")

LABELS = [lbl.CALL_KEY, lbl.TOOL_NAME, lbl.ARG_NAME, lbl.VALUE, lbl.END, lbl.SPAN, lbl.RETRIEVAL, lbl.OWN_CALL]


class TableTokenizer:
    """``candidate(tail, segs)`` as the boundary tokenizer's: ids and a label per token, by segments."""

    def __init__(self, table: dict):
        self.table, self.calls = table, 0

    def candidate(self, tail, segs):
        self.calls += 1
        return self.table[segs]


def _case(rng: random.Random, n: int):
    table, cands, prefixes = {}, [], [[]]
    for k in range(n):
        base = list(rng.choice(prefixes))[: rng.randrange(0, 12)]
        ids = base + [rng.randrange(0, 40) for _ in range(rng.randrange(0, 14))]
        labels = []
        for _ in ids:
            labels.append(labels[-1] if labels and rng.random() < 0.6 else rng.choice(LABELS))
        prefixes.append(ids)
        segs = ((f"c{k}", lbl.VALUE),)
        table[segs] = (tuple(ids), tuple(labels))
        cands.append(Cand(list(segs), rng.choice([0.5, 0.25, 0.1, rng.random(), rng.random() * 1e-3])))
    cands.sort(key=lambda c: -c.prob)
    rates = LabelRates(DEFAULT_RATES)
    for lab in LABELS:
        for _ in range(rng.randrange(0, 6)):
            rates.count(lab + ("+" if rng.random() < 0.3 else ""), rng.random() < 0.7)
    return TableTokenizer(table), cands, rates


def _fields(tree):
    return tree.tokens, tree.parents, tree.conf, tree.labels


def test_compiled_merge_builds_the_python_trees_bit_for_bit():
    rng = random.Random(53)
    stopped = 0
    for trial in range(300):
        bt, cands, rates = _case(rng, rng.randrange(0, 90))
        max_nodes = rng.choice([None, None, 1, 8, 24, 64])
        max_tokens = rng.choice([96, 96, 5])
        committed = [rng.randrange(0, 40) for _ in range(rng.randrange(0, 6))]
        bt.calls = 0
        want = candidates_to_tree(bt, committed, cands, rates, max_tokens, max_nodes, compiled=False)
        py_calls = bt.calls
        bt.calls = 0
        got = candidates_to_tree(bt, committed, cands, rates, max_tokens, max_nodes, compiled=True)
        assert _fields(got) == _fields(want), trial
        assert bt.calls == py_calls  # the same candidates tokenized: the stop test agrees
        stopped += py_calls < len(cands)
        # the child index comes built: later merges (retrieval, values, suffix) find the same nodes
        assert got._kids == {(p, t): i for i, (p, t) in enumerate(zip(want.parents, want.tokens))}
        assert got.is_trie()
    assert stopped > 20  # the node cap's stop was exercised


def test_compiled_merge_passes_a_tokenizer_error_through():
    class Bad:
        def candidate(self, tail, segs):
            raise KeyError("boom")

    with pytest.raises(KeyError):
        candidates_to_tree(Bad(), [1], [Cand([("x", lbl.VALUE)], 1.0)], LabelRates(DEFAULT_RATES), compiled=True)
