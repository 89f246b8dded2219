"""KV commit: exactly the root chain and the accepted rows stay in the cache."""

from __future__ import annotations

import torch
from scripted import PROMPT
from scripted import tiny as tiny

from toolspec_core.engine.commit import commit_kv, kv_rows
from toolspec_core.engine.loop import prefill
from toolspec_core.engine.tree import DraftTree
from toolspec_core.engine.verify import tree_inputs


def test_commit_kv_keeps_exactly_the_accepted_rows(tiny):
    pre = prefill(tiny, PROMPT)
    cache = pre.cache
    kv = cache.get_seq_length()
    tree = DraftTree()
    tree.add_path([30, 31], 1.0, "x")
    tree.add_path([40, 41, 42], 1.0, "x")
    ids, pos, mask = tree_inputs(PROMPT[-1], tree, kv)
    tiny.hidden(ids, pos, mask, cache)
    path = [2, 3]  # tokens 40, 41
    commit_kv(cache, kv, kv_rows(path))
    assert cache.get_seq_length() == kv + 3
    ref = tiny.new_cache()
    seq = PROMPT + [PROMPT[-1], 40, 41]
    tiny.hidden(torch.tensor([seq]), torch.arange(len(seq))[None], None, ref)
    for a, b in zip(cache.layers, ref.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
