"""The KV block pool: allocation, prefix keys, eviction, and a paged cache that behaves like SeqKV."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_target

from toolspec_core.engine.commit import commit_kv, kv_rows
from toolspec_core.engine.verify import tree_inputs
from toolspec_core.model.batch_forward import Segment
from toolspec_core.model.block_pool import BlockPool, PagedKV, block_keys, kv_bytes_per_token, pool_for

BT = 4


def _pool(blocks: int = 8) -> BlockPool:
    return BlockPool(n_layers=2, kv_heads=2, head_dim=4, num_blocks=blocks, block_tokens=BT)


def test_block_keys_name_the_whole_prefix():
    a = block_keys(list(range(12)), BT, 3)
    b = block_keys(list(range(12)) + [99], BT, 3)
    c = block_keys([7] + list(range(1, 12)), BT, 3)
    assert a == b  # a partial block adds nothing
    assert len(set(a)) == 3
    assert all(x != y for x, y in zip(a, c))  # one earlier token changes every later key
    assert block_keys(list(range(4, 12)), BT, 2, a[0]) == a[1:]  # chaining resumes from a key


def test_allocate_takes_a_contiguous_run_then_scattered_blocks():
    pool = _pool(8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4]
    pool.release(a)
    assert pool.allocate(4) == [0, 1, 2, 5]  # no run of 4 is free: lowest free blocks
    assert pool.available() == 2
    with pytest.raises(MemoryError):
        pool.allocate(3)
    with pytest.raises(RuntimeError):
        pool.release([6])  # never referenced


def test_registered_blocks_are_shared_then_evicted_least_recent_first():
    pool = _pool(4)
    tokens = list(range(10))
    table = pool.allocate(3)
    keys = pool.register(table, [], tokens, 10)  # two full blocks; the third is partial
    assert len(keys) == 2 and set(pool.key_of) == {table[0], table[1]}
    shared, got = pool.match(tokens + [50, 51], limit=11)
    assert shared == table[:2] and got == keys
    assert pool.refs[table[0]] == 2
    pool.release(shared)
    pool.release(table)
    st = pool.stats()
    assert st.cached_blocks == 2 and st.used_blocks == 0 and pool.available() == 4
    # a prompt that differs in its first block finds nothing
    assert pool.match([99] + tokens[1:], 10)[0] == []
    # the limit keeps the last rows of a prompt out of the match
    assert pool.match(tokens, 7)[0] == [table[0]]
    pool.release([table[0]])
    # four blocks asked: the two free ones, then the cached ones, oldest first; their keys go too
    taken = pool.allocate(4)
    assert sorted(taken) == [0, 1, 2, 3] and pool.stats().evictions == 2
    assert pool.by_key == {} and pool.match(tokens, 10)[0] == []
    pool.release(taken)
    assert pool.stats().free_blocks == 4


def test_a_prefix_another_block_holds_is_not_registered_twice():
    pool = _pool(6)
    tokens = list(range(8))
    t1, t2 = pool.allocate(2), pool.allocate(2)
    pool.register(t1, [], tokens, 8)
    pool.register(t2, [], tokens, 8)
    assert set(pool.key_of) == set(t1)
    pool.release(t2)
    assert pool.stats().free_blocks == 4 and pool.stats().cached_blocks == 0  # t2 went straight back to the free list


def _tree(rng: random.Random, n: int):
    from toolspec_core.spec.tree import DraftTree

    tree = DraftTree()
    for _ in range(n):
        tree.add(rng.randrange(-1, len(tree)) if len(tree) else -1, rng.randrange(96), 0.5, "x")
    return tree


@pytest.mark.parametrize("shared", [False, True])
def test_paged_cache_gives_the_same_states_as_a_sequence_cache(shared):
    """Prefill, a verify forward with a tree, its commit and a decode row: PagedKV (a view when
    contiguous, gathered after shared prefix blocks) and SeqKV agree."""
    rng = random.Random(int(shared))
    tg = tiny_target()
    pool = tg.block_pool(256, BT)
    assert pool.k.shape == (2, 2, 256 + BT, 16)  # and the scratch block
    prompt = [rng.randrange(1, 96) for _ in range(23)]
    ref = tg.new_cache()
    if shared:  # another sequence's first 16 prompt rows, registered, then matched
        first = PagedKV(pool, pool.allocate(8))
        tg.forward([Segment(first, torch.tensor(prompt), torch.arange(23))])
        first.release(prompt)
        blocks, keys = pool.match(prompt, 22)
        assert len(blocks) == 5
        pool.release(blocks[4:])  # keep 4: the sequence prefills 7 rows into its own blocks
        blocks = blocks[:4]
        paged = PagedKV(pool, blocks + pool.allocate(6), len(blocks), keys[:4])
        assert not paged.contiguous and paged.length == 16
        tg.forward([Segment(ref, torch.tensor(prompt[:16]), torch.arange(16))])
    else:
        paged = PagedKV(pool, pool.allocate(10))
        assert paged.contiguous
    a = paged.length
    h_ref = tg.forward([Segment(ref, torch.tensor(prompt[a:]), torch.arange(a, 23))])
    h_pag = tg.forward([Segment(paged, torch.tensor(prompt[a:]), torch.arange(a, 23))])
    torch.testing.assert_close(h_pag, h_ref)
    tree = _tree(rng, 9)
    for cache in (ref, paged):
        ids, pos, parents = tree_inputs([5, 6], tree, 23)
        out = tg.forward([Segment(cache, ids[0], pos[0], parents)])
        commit_kv(cache, 23, kv_rows([0, 3], 2))  # rows out of order: a gather, then a crop
        assert cache.get_seq_length() == 27
        if cache is ref:
            want = out
        else:
            torch.testing.assert_close(out, want)
    for i in range(2):
        torch.testing.assert_close(paged.layers[i].keys, ref.layers[i].keys)
        torch.testing.assert_close(paged.layers[i].values, ref.layers[i].values)
    h1 = tg.forward([Segment(ref, torch.tensor([9]), torch.tensor([27]))])
    h2 = tg.forward([Segment(paged, torch.tensor([9]), torch.tensor([27]))])
    torch.testing.assert_close(h2, h1)
    with pytest.raises(RuntimeError, match="reserved rows"):
        tg.forward([Segment(paged, torch.zeros(40, dtype=torch.long), torch.arange(28, 68))])


def test_pool_sizes_follow_the_model():
    tg = tiny_target()
    assert kv_bytes_per_token(tg.model.config, torch.float32) == 2 * 2 * 2 * 16 * 4
    pool = pool_for(tg.model, 100, 16)
    assert pool.num_blocks == 7 and pool.capacity_tokens == 112
    with pytest.raises(ValueError):
        BlockPool(2, 2, 4, 0)


def test_without_prefix_caching_nothing_is_shared():
    pool = BlockPool(2, 2, 4, 8, BT, prefix_caching=False)
    table = pool.allocate(3)
    assert pool.register(table, [], list(range(12)), 12) == []
    pool.release(table)
    assert pool.match(list(range(12)), 12)[0] == [] and pool.stats().free_blocks == 8
