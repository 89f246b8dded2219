"""Suffix drafting: greedy output unchanged, history drafts, rates keyed by path."""

from __future__ import annotations

import pytest
from baseline_cases import N, run
from baseline_cases import tiny as tiny
from tiny import hf_greedy

from toolspec_core.drafters.base import LabelRates
from toolspec_core.drafters.methods import RequestInfo, make_method
from toolspec_core.drafters.suffix import SUFFIX_PRIOR, SuffixDrafter, SuffixMethod, suffix_key
from toolspec_core.drafters.suffix_trie import SuffixTrie
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, generate
from toolspec_core.spec.proposer import DraftContext
from toolspec_core.spec.tree import ROOT, DraftTree, VerifyResult, depths

PATTERN = [5, 9, 13, 17, 21, 25, 29, 33]


PROMPTS = [PATTERN * 4 + [5, 9], [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4]]


@pytest.fixture(scope="module")
def refs(tiny):
    """HF generate(do_sample=False) == our loop with no drafter, per prompt."""
    out = [hf_greedy(tiny, p, N) for p in PROMPTS]
    for p, ref in zip(PROMPTS, out):
        assert generate(tiny, list(p), None, DecodeConfig(max_new_tokens=N)).tokens == ref
    return out


@pytest.mark.parametrize("name", ["suffix", "token_recycling"])
@pytest.mark.parametrize("curve", ["flat", "cpu", "nobudget"])
def test_greedy_equality_and_acceptance(tiny, refs, name, curve):
    cost = {"flat": CostModel.flat(), "cpu": CostModel.cpu_reference(), "nobudget": None}[curve]
    method = make_method(name, None, vocab_size=128) if name == "token_recycling" else make_method(name, None)
    accepted = 0
    for rnd in range(2):  # the second round uses history / the recycled matrix
        for prompt, ref in zip(PROMPTS, refs):
            res = run(tiny, method, prompt, cost)
            assert res.tokens == ref, (name, rnd)
            assert res.stats.generated_tokens == N
            accepted += sum(res.stats.accepted)
            assert set(res.stats.step_labels) <= {name, "none"}
    if curve != "cpu":  # the steep CPU curve may rightly decide to draft little
        assert accepted > 0, f"{name} never had a draft accepted"


def test_suffix_history_drafts_whole_repeat(tiny, refs):
    """After observing an output, the same request is drafted almost entirely from history."""
    method = SuffixMethod()
    first = run(tiny, method, PROMPTS[1], CostModel.flat())
    again = run(tiny, method, PROMPTS[1], CostModel.flat())
    assert again.tokens == first.tokens == refs[1]
    assert again.stats.forwards < first.stats.forwards
    assert again.stats.mat >= 4.0


def test_suffix_drafter_prefers_frequent_continuation():
    m = SuffixMethod()
    m.observe(RequestInfo(prompt_ids=[50]), [1, 2, 3, 4], "")
    m.observe(RequestInfo(prompt_ids=[50]), [1, 2, 3, 4], "")
    m.observe(RequestInfo(prompt_ids=[50]), [1, 2, 7, 8], "")
    d = m.drafter(RequestInfo(prompt_ids=[60, 1, 2]))
    tree = d.propose(DraftContext([60, 1, 2], 3, 10))
    kids = {tree.tokens[i]: tree.conf[i] for i in tree.children(ROOT)}
    assert set(kids) == {3, 7} and kids[3] > kids[7]
    assert all(lab == "suffix" for lab in tree.labels)
    assert suffix_key(0.9, 5) == "suffix:hi:l" and suffix_key(0.3, 1) == "suffix:lo:s"
    assert suffix_key(0.9, 6) == "suffix:hi:L" and suffix_key(1.0, 2, seen=1) == "suffix:hi:s:1"


def test_rates_follow_pruned_tree_by_path():
    """feedback() sees a pruned, re-indexed tree; rate keys must still line up (by token path)."""
    m = SuffixMethod()
    m.observe(RequestInfo(prompt_ids=[50]), [1, 2, 3, 4, 5], "")
    d = m.drafter(RequestInfo(prompt_ids=[1, 2]))
    d.propose(DraftContext([1, 2], 2, 10))
    pruned = DraftTree()
    pruned.add_path([3, 4], 0.8, "suffix")
    d.feedback(pruned, VerifyResult(path=[0], token=9))
    # each continuation was seen once in the history: the weak-evidence buckets
    assert m.rates.tries == {"suffix:hi:s:1": 1.0, "suffix:hi:l:1": 1.0}
    assert m.rates.hits == {"suffix:hi:s:1": 1.0}


def test_suffix_drafter_extends_a_drafted_chain():
    """``extend`` continues the context + a draft path (what ToolSpec does after the schema's text)."""
    hist = SuffixTrie(32)
    hist.add_document([40, 5, 6, 7, 8, 9])
    d = SuffixDrafter(hist, LabelRates(SUFFIX_PRIOR))
    tree = DraftTree()
    leaf = tree.add_path([5, 6], 0.99, "schema")
    d.extend(DraftContext([1, 2, 40], 3, 20), tree, leaf, 0.98)
    deepest = max(range(len(tree)), key=lambda i: depths(tree.parents)[i])
    assert [tree.tokens[i] for i in tree.path_to(deepest)] == [5, 6, 7, 8, 9]
    assert tree.labels[:2] == ["schema", "schema"] and set(tree.labels[2:]) == {"suffix"}
    assert (5, 6, 7) in d.keys and (5, 6) not in d.keys  # rates keyed by the full path from the root
    d.extend(DraftContext([1, 2, 40], 3, 2), tree, leaf, 0.98)  # no depth left past the chain: nothing added


def test_suffix_rates_learn_only_from_the_nodes_suffix_owns_when_asked():
    """In a merged tree (ToolSpec) a suffix draft the schema also drafted carries the schema's label
    and is right more often; counting it would make the rate of suffix-only nodes too high."""
    hist = SuffixTrie(32)
    hist.add_document([40, 5, 6, 7])
    for owned, counted in ((False, 3), (True, 2)):
        d = SuffixDrafter(hist, LabelRates(SUFFIX_PRIOR))
        tree = d.propose(DraftContext([1, 2, 40], 3, 20))
        assert [tree.tokens[i] for i in range(3)] == [5, 6, 7]
        tree.add(ROOT, 5, 0.99, "schema")  # the schema drafted the first token too, with a higher conf
        assert tree.labels[0] == "schema"
        d.feedback(tree, VerifyResult(path=[0, 1, 2], token=9), owned=owned)
        assert sum(d.rates.tries.values()) == counted and sum(d.rates.hits.values()) == counted
