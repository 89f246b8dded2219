"""KV commit: exactly the root chain and the accepted rows stay in the cache."""

from __future__ import annotations

import torch
from scripted import PROMPT
from scripted import tiny as tiny

from toolspec_core.engine.commit import commit_kv, kv_rows
from toolspec_core.engine.verify import tree_inputs
from toolspec_core.spec.tree import DraftTree


def test_commit_kv_keeps_exactly_the_accepted_rows(tiny):
    cache = tiny.new_cache()  # the prompt's KV: a forward over it
    tiny.hidden(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], None, cache)
    kv = cache.get_seq_length()
    tree = DraftTree()
    tree.add_path([30, 31], 1.0, "x")
    tree.add_path([40, 41, 42], 1.0, "x")
    ids, pos, parents = tree_inputs(PROMPT[-1], tree, kv)
    tiny.hidden(ids, pos, parents, cache)
    path = [2, 3]  # tokens 40, 41
    commit_kv(cache, kv, kv_rows(path))
    assert cache.get_seq_length() == kv + 3
    ref = tiny.new_cache()
    seq = PROMPT + [PROMPT[-1], 40, 41]
    tiny.hidden(torch.tensor([seq]), torch.arange(len(seq))[None], None, ref)
    for a, b in zip(cache.layers, ref.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


def test_every_cache_kind_commits_through_the_protocol(tiny):
    """SeqKV, PagedKV, HF's cache (HFKV) and the tensor-parallel replica's storage-less shadow all
    speak KVCache: the same commit keeps the same rows (the shadow queues the slot move)."""
    from deployments.tp.target import RemoteBlockPool, TPGroup
    from toolspec_core.model.block_pool import PagedKV
    from toolspec_core.model.kv import HFKV, KVCache, SeqKV

    pool = tiny.block_pool(128, 8)
    caches = [tiny.new_cache(), PagedKV(pool, pool.allocate(8)), HFKV(tiny.hf_cache())]
    tree = DraftTree()
    tree.add_path([30, 31], 1.0, "x")
    tree.add_path([40, 41, 42], 1.0, "x")
    kv = len(PROMPT)
    for cache in caches:
        assert isinstance(cache, KVCache) and cache.room() in (None, 64)
        tiny.hidden(torch.tensor([PROMPT]), torch.arange(kv)[None], None, cache)
        ids, pos, parents = tree_inputs(PROMPT[-1], tree, kv)
        tiny.hidden(ids, pos, parents, cache)
        commit_kv(cache, kv, kv_rows([2, 3]))
        cache.register(PROMPT)
        assert cache.get_seq_length() == kv + 3
    ref = SeqKV(2)
    seq = PROMPT + [PROMPT[-1], 40, 41]
    tiny.hidden(torch.tensor([seq]), torch.arange(len(seq))[None], None, ref)
    for cache in caches:
        for a, b in zip(cache.layers, ref.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        cache.release()
    assert all(r == 0 for r in pool.refs)
    group = TPGroup([], [], local=True)
    shadow = PagedKV(RemoteBlockPool(group, 2, 16, 8, 8, torch.float32), [3, 5])
    assert isinstance(shadow, KVCache)
    shadow.advance(7)
    commit_kv(shadow, 4, [0, 2])
    moves = group.ops().moves
    assert (moves[0].tolist(), moves[1].tolist()) == ([30], [29])  # row 0 is in place already
    assert shadow.get_seq_length() == 6
    group.shutdown()
