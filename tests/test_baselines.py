"""Baseline drafters (suffix, token recycling) on tiny random Qwen2 models: greedy equality
with plain decoding and HF generate, drafts actually accepted, structures behave."""

from __future__ import annotations

import pytest
import torch

from tiny import hf_greedy, tiny_target
from toolspec_core.drafters.suffix import SUFFIX_PRIOR, SuffixDrafter, SuffixMethod, suffix_key
from toolspec_core.drafters.suffix_trie import SuffixTrie
from toolspec_core.drafters.token_recycling import TokenRecyclingMethod, bfs_template
from toolspec_core.drafters.base import node_paths
from toolspec_core.drafters.base import LabelRates
from toolspec_core.engine.budget import CostModel
from toolspec_core.drafters.base import DraftContext
from toolspec_core.engine.loop import DecodeConfig, decode, prefill
from toolspec_core.drafters.methods import RequestInfo, make_method
from toolspec_core.engine.tree import ROOT, DraftTree, depths
from toolspec_core.engine.verify import VerifyResult

PATTERN = [5, 9, 13, 17, 21, 25, 29, 33]
PROMPTS = [PATTERN * 4 + [5, 9], [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4]]
N = 40


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(vocab=128)


@pytest.fixture(scope="module")
def refs(tiny):
    """HF generate(do_sample=False) == our loop with no drafter, per prompt."""
    out = [hf_greedy(tiny, p, N) for p in PROMPTS]
    for p, ref in zip(PROMPTS, out):
        assert decode(tiny, prefill(tiny, list(p)), None, DecodeConfig(max_new_tokens=N)).tokens == ref
    return out


def run(tiny, method, prompt, cost):
    req = RequestInfo(prompt_ids=list(prompt))
    res = decode(tiny, prefill(tiny, list(prompt)), method.drafter(req), DecodeConfig(max_new_tokens=N), cost)
    method.observe(req, res.tokens, res.text)
    return res


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


def test_suffix_trie_counts_and_matches():
    t = SuffixTrie(depth=4)
    t.add_document([1, 2, 3, 1, 2, 4])
    assert t.count[t.walk([1, 2])] == 2
    assert t.walk([3, 1, 2, 4]) >= 0 and t.walk([2, 3, 1, 2, 4]) == -1  # depth limit
    node, m = t.longest_match([9, 3, 1, 2], max_match=8)
    assert m == 3 and sorted(t.kids[node]) == [4]
    assert t.longest_match([7, 7], 8) == (-1, 0)
    # documents do not run into each other
    t.add_document([7])
    assert t.walk([4, 7]) == -1
    # the active match of the current document excludes its own (continuation-less) occurrence
    c = SuffixTrie(depth=8)
    c.extend([1, 2, 3, 9, 1, 2])
    node, m = c.active_match(8)
    assert m == 2 and list(c.kids[node]) == [3]


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
    tree = d.propose(DraftContext([1, 2], 2, 10))
    pruned = DraftTree()
    pruned.add_path([3, 4], 0.8, "suffix")
    d.feedback(pruned, VerifyResult(path=[0], token=9))
    # each continuation was seen once in the history: the weak-evidence buckets
    assert m.rates.tries == {"suffix:hi:s:1": 1.0, "suffix:hi:l:1": 1.0}
    assert m.rates.hits == {"suffix:hi:s:1": 1.0}


def test_token_recycling_template_and_matrix():
    tpl = bfs_template(80)
    assert len(tpl) == 80 and all(p < i for i, (p, _) in enumerate(tpl))
    assert sum(1 for p, _ in tpl if p == ROOT) == 8
    assert max(depths([p for p, _ in tpl])) >= 4
    m = TokenRecyclingMethod(vocab_size=16)
    d = m.drafter(RequestInfo(prompt_ids=[1]))
    assert len(d.propose(DraftContext([1, 2], 1, 10))) == 0  # nothing seen yet
    logits = torch.zeros(2, 16)  # rows: root 2, node 5
    logits[0, 5], logits[0, 6], logits[1, 7] = 3.0, 2.0, 3.0
    tree = DraftTree()
    tree.add_path([5], 0.5, "token_recycling")
    d.feedback(tree, VerifyResult(path=[0], token=7, logits=logits))
    assert m.matrix[2, :2].tolist() == [5, 6] and m.matrix[5, 0].item() == 7
    tree = m.drafter(RequestInfo(prompt_ids=[1])).propose(DraftContext([1, 2], 1, 10))
    assert {p: tree.tokens[i] for i, p in enumerate(node_paths(tree)) if len(p) == 1}[(5,)] == 5
    assert (5, 7) in node_paths(tree)
    assert tree.labels[0] == "token_recycling" and tree.conf[0] > tree.conf[1]
    # depth cap honoured
    short = m.drafter(RequestInfo(prompt_ids=[1])).propose(DraftContext([1, 2], 1, 1))
    assert max(depths(short.parents)) == 1


def test_token_recycling_root_chain_rows():
    """With grammar-forced tokens the forward starts with a root chain: rows map to its tokens."""
    m = TokenRecyclingMethod(vocab_size=16)
    d = m.drafter(RequestInfo(prompt_ids=[1]))
    tree = DraftTree()
    tree.add_path([9], 0.5, "token_recycling")
    d.propose(DraftContext([1, 3, 4], 1, 10))  # root chain (3, 4): 4 is the tree's root
    logits = torch.zeros(3, 16)  # rows: 3, 4, node 9
    logits[0, 11], logits[1, 12], logits[2, 13] = 1.0, 1.0, 1.0
    d.feedback(tree, VerifyResult(path=[], token=12, logits=logits))
    assert [m.matrix[t, 0].item() for t in (3, 4, 9)] == [11, 12, 13]


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


def test_tenant_histories_bound_tokens_and_tenants_and_skip_repeats():
    from toolspec_core.drafters.history import TenantHistories

    h = TenantHistories(depth=8, max_tokens=40, max_tenants=2)
    assert len(h.trie("a")) == 1  # empty for an unknown tenant
    assert h.add("a", [1, 2, 3], lead=[0]) and not h.add("a", [1, 2, 3])  # the same output once
    assert h.trie("a").walk([0, 1, 2, 3]) > 0 and h.trie("b").walk([1, 2]) < 0  # tenants apart
    for i in range(10):
        h.add("a", [10 + i] * 5)
    assert 20 <= h.tokens("a") <= 40  # shrank to the newest half, not to nothing
    assert h.trie("a").walk([19] * 5) > 0 and h.trie("a").walk([10] * 5) < 0  # oldest gone
    assert h.add("a", [10] * 5)  # a dropped output may come back
    h.add("b", [7, 7])
    h.trie("a")  # a used more recently than b
    h.add("c", [8, 8])
    assert h.tokens("b") == 0 and h.tokens("a") > 0 and h.tokens("c") == 2  # least recently used tenant dropped


def test_suffix_trie_reader_never_sees_an_unbuilt_node():
    """A node id is published in its parent's dict only after the node exists (server threads)."""
    t = SuffixTrie(4)
    seen = []

    class Spy(list):
        def append(self, x):
            seen.append(all(c < len(self) for d in self for c in d.values()))
            super().append(x)

    t.kids = Spy(t.kids)
    t.add_document([1, 2, 3, 1, 2])
    assert seen and all(seen)


@pytest.mark.parametrize("seed", range(6))
def test_context_index_is_the_suffix_trie_of_its_document(seed):
    """ContextIndex (O(1) append, subtrie built per match) answers every match exactly as a full
    SuffixTrie of the same document does, and drafts the same tree from it."""
    import random

    from toolspec_core.drafters.suffix import SUFFIX_PRIOR, grow_from_trie
    from toolspec_core.drafters.suffix_trie import ContextIndex

    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 20])  # small vocabularies: many repeats, deep shared suffixes
    depth = rng.choice([4, 8, 32])
    doc = [rng.randrange(vocab) for _ in range(rng.randint(1, 300))]
    trie, index = SuffixTrie(depth), ContextIndex(depth)

    def drafted(structure, node, m):
        tree = DraftTree()
        grow_from_trie(tree, {}, structure, node, m, LabelRates(dict(SUFFIX_PRIOR)), 64, depth)
        return tree.tokens, tree.parents, [round(c, 9) for c in tree.conf]

    done = 0
    while done < len(doc):
        step = doc[done : done + rng.randint(1, 40)]
        trie.extend(step)
        index.extend(step)
        done += len(step)
        for max_match in (1, 3, 8):
            (tn, tm), (inode, im) = trie.active_match(max_match), index.active_match(max_match)
            assert tm == im and (tn < 0) == (inode < 0)
            if tn >= 0:
                assert drafted(trie, tn, tm) == drafted(index, inode, im)
            pattern = doc[max(0, done - 5) : done] + [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
            (tn, tm), (inode, im) = trie.longest_match(pattern, max_match), index.longest_match(pattern, max_match)
            assert tm == im and (tn < 0) == (inode < 0)
            if tn >= 0:
                assert drafted(trie, tn, tm) == drafted(index, inode, im)
