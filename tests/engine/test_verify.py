"""Tree verification: the tree forward equals per-branch runs and the greedy walk takes the longest matching path."""

from __future__ import annotations

import torch
from scripted import PROMPT
from scripted import tiny as tiny
from tiny import tiny_target

from toolspec_core.engine.verify import greedy_walk, tree_inputs
from toolspec_core.model.batch_forward import tree_masks
from toolspec_core.spec.tree import DraftTree


def test_greedy_walk_takes_longest_matching_path():
    tree = DraftTree()
    tree.add_path([10, 11, 12], 1.0, "x")
    tree.add_path([10, 13, 14], 1.0, "x")
    # choice per row: root->10, node0(10)->13, node1(11)->.., node2(12)->.., node3(13)->14, node4(14)->99
    res = greedy_walk(tree, [10, 13, 0, 0, 14, 99])
    assert res.path == [0, 3, 4] and res.token == 99
    res = greedy_walk(tree, [42, 0, 0, 0, 0, 0])
    assert res.path == [] and res.token == 42


def test_tree_forward_equals_per_branch_runs(tiny):
    """Logits of every tree node equal those of running its branch alone (SDPA + float mask)."""
    cache = tiny.new_cache()  # the prompt's KV: a forward over it
    tiny.hidden(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], None, cache)
    tree = DraftTree()
    tree.add_path([10, 11, 12], 1.0, "x")
    tree.add_path([10, 13], 1.0, "x")
    tree.add_path([20, 21], 1.0, "x")
    kv = cache.get_seq_length()
    ids, pos, parents = tree_inputs(PROMPT[-1], tree, kv)
    logits = tiny.logits(tiny.hidden(ids, pos, parents, cache))
    for node in range(len(tree)):
        branch = [tree.tokens[i] for i in tree.path_to(node)]
        full = torch.tensor([PROMPT + [PROMPT[-1]] + branch])
        ref = tiny.model(full).logits[0, -1]
        assert torch.allclose(logits[node + 1], ref, atol=2e-5), node


def test_eager_attention_with_our_float_mask_is_right():
    """A bool 4D mask is silently misread under eager attention; our float mask must not be."""
    tg = tiny_target(attn="eager")
    cache = tg.hf_cache()  # HF's own forward, eager attention
    tg.hf_hidden(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], None, cache)
    tree = DraftTree()
    tree.add_path([10, 11], 1.0, "x")
    tree.add_path([20, 21], 1.0, "x")
    kv = cache.get_seq_length()
    ids, pos, parents = tree_inputs(PROMPT[-1], tree, kv)
    mask = tree_masks(parents, [len(parents)], torch.float32)[0]  # what the per-sequence loop builds
    assert mask.dtype == torch.float32
    logits = tg.logits(tg.hf_hidden(ids, pos, mask, cache))
    branch = [20, 21]
    ref = tg.model(torch.tensor([PROMPT + [PROMPT[-1]] + branch])).logits[0, -1]
    assert torch.allclose(logits[4], ref, atol=2e-5)
