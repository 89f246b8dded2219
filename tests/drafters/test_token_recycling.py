"""Token Recycling: the static template, the adjacency matrix, greedy output unchanged."""

from __future__ import annotations

import torch

from toolspec_core.drafters.base import node_paths
from toolspec_core.drafters.methods import RequestInfo
from toolspec_core.drafters.token_recycling import TokenRecyclingMethod, bfs_template
from toolspec_core.spec.proposer import DraftContext
from toolspec_core.spec.tree import ROOT, DraftTree, VerifyResult, depths


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
