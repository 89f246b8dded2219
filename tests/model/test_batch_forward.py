"""The batched forward equals HF's own forward per sequence, and its KV storage behaves like a cache."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import reference_mask, tiny_model, tiny_target

from toolspec_core.engine.commit import commit_kv, kv_rows
from toolspec_core.engine.verify import row_parents, tree_inputs
from toolspec_core.model.batch_forward import Segment, causal_mask, supports_batched, tree_masks
from toolspec_core.model.kv import GROW, SeqKV
from toolspec_core.spec.tree import DraftTree


def _random_tree(rng: random.Random, n: int) -> DraftTree:
    tree = DraftTree()
    for _ in range(n):
        parent = rng.randrange(-1, len(tree)) if len(tree) else -1
        tree.add(parent, rng.randrange(96), 0.5, "x")
    return tree


@pytest.mark.parametrize("seed", range(4))
def test_batched_forward_equals_hf_forward_per_sequence(seed):
    """Mixed segments -- prefill chunks, single decode rows, root chains with trees (given as their
    rows' parents, the masks built in the forward) -- in one forward."""
    rng = random.Random(seed)
    tg = tiny_target()
    prompts = [[rng.randrange(1, 96) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    ours = [tg.new_cache() for _ in prompts]
    hf = [tg.hf_cache() for _ in prompts]
    assert all(isinstance(c, SeqKV) for c in ours)
    # step 1: prefill all prompts together
    tg.forward([Segment(c, torch.tensor(p), torch.arange(len(p))) for c, p in zip(ours, prompts)])
    for c, p in zip(hf, prompts):
        tg.hf_hidden(torch.tensor([p]), torch.arange(len(p))[None], None, c)
    # step 2: each sequence a different shape of rows
    segs, inputs = [], []
    for i, (c, p) in enumerate(zip(ours, prompts)):
        roots = [rng.randrange(96) for _ in range(1 + (i % 2))]
        tree = _random_tree(rng, [0, 0, 3, 7, 12][i])
        ids, pos, parents = tree_inputs(roots, tree, len(p))
        single = len(roots) == 1 and not tree.tokens
        inputs.append((ids, pos, None if single else reference_mask(parents)))
        segs.append(Segment(c, ids[0], pos[0], None if single else parents))
    got = tg.logits(tg.forward(segs))
    o = 0
    for (ids, pos, mask), c in zip(inputs, hf):
        want = tg.logits(tg.hf_hidden(ids, pos, mask, c))
        n = ids.shape[1]
        torch.testing.assert_close(got[o : o + n], want, rtol=1e-4, atol=1e-5)
        o += n
    for a, b in zip(ours, hf):  # the caches hold the same rows
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-4, atol=1e-5)


def test_seqkv_grows_crops_and_commits():
    tg = tiny_target()
    kv = tg.new_cache()
    n = GROW + 40  # past the first allocation: the storage grows, the valid rows survive
    ids = torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(0))
    tg.hidden(ids[None], torch.arange(n)[None], None, kv)
    ref = tg.hf_cache()
    tg.hf_hidden(ids[None], torch.arange(n)[None], None, ref)
    assert kv.get_seq_length() == n
    torch.testing.assert_close(kv.layers[1].values, ref.layers[1].values, rtol=1e-4, atol=1e-5)
    clone = tg.new_cache()  # a second cache of the same rows: cropping one leaves the other
    tg.hidden(ids[None], torch.arange(n)[None], None, clone)
    kv.crop(-10)
    assert kv.get_seq_length() == n - 10 and clone.get_seq_length() == n
    kv.crop(5)
    assert kv.get_seq_length() == 5
    # commit: rows 0 and 2 of a 3-row forward kept, by index
    tree = DraftTree()
    tree.add_path([4, 5], 1.0, "x")
    tree.add(-1, 6, 1.0, "x")
    ids2, pos2, parents2 = tree_inputs(3, tree, clone.get_seq_length())
    tg.hidden(ids2, pos2, parents2, clone)
    commit_kv(clone, n, kv_rows([2], 1))
    assert clone.get_seq_length() == n + 2
    tg.hf_hidden(torch.tensor([[3, 6]]), torch.tensor([[n, n + 1]]), None, ref)
    torch.testing.assert_close(clone.layers[0].keys, ref.layers[0].keys, rtol=1e-4, atol=1e-5)


def test_masks_built_from_parents_are_the_rows_ancestors():
    """The masks the float-mask paths build from trees' parent rows (all trees at once, or one
    segment's own) let each row see itself and its ancestors, row for row, in each dtype's own
    minimum."""
    from toolspec_core.spec.tree import ROOT

    rng = random.Random(3)
    for dtype in (torch.float32, torch.bfloat16):
        want, parents, sizes, segs = [], [], [], []
        for _ in range(12):
            tree = DraftTree()
            for _ in range(rng.randrange(0, 20)):
                tree.add_path([rng.randrange(50)], 0.5, "x", rng.choice([ROOT] + list(range(len(tree)))))
            roots = [1] * rng.randrange(1, 4)
            ids, pos, rows = tree_inputs(roots, tree, 9)
            assert rows == row_parents(roots, tree.parents)
            want.append(reference_mask(rows, dtype))
            parents += rows
            sizes.append(len(rows))
            segs.append(Segment(None, ids[0], pos[0], rows))
        got = tree_masks(parents, sizes, dtype)
        assert len(got) == len(want) and all(torch.equal(g, w) and g.dtype == dtype for g, w in zip(got, want))
        assert all(torch.equal(s.attn_mask(dtype), w) for s, w in zip(segs, want))
    assert tree_masks([], [], torch.float32) == []
    causal = Segment(None, torch.tensor([1, 2]), torch.tensor([0, 1]))
    assert not causal.tree and causal.attn_mask(torch.float32) is None


def test_causal_mask_shape_and_values():
    m = causal_mask(2, 3, torch.float32, "cpu")
    assert m.shape == (1, 1, 3, 5)
    assert (m[0, 0] == 0).tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]


def test_unsupported_families_fall_back_to_hf_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    assert supports_batched(tiny_model())
    assert not supports_batched(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))


def test_a_family_outside_the_batched_forward_decodes_through_hf_caches():
    """A sliding-window Qwen2 runs HF's own forward over an HFKV cache: the scheduler's protocol
    calls (commit, register, release) reach it, and greedy stays HF generate's."""
    from scripted import ScriptedDrafter, branching
    from tiny import CharTokenizer, hf_greedy

    from toolspec_core.engine.loop import DecodeConfig, generate
    from toolspec_core.model.kv import HFKV
    from toolspec_core.model.target import from_model

    model = tiny_model(use_sliding_window=True, sliding_window=4096, max_window_layers=0)
    tg = from_model(model, CharTokenizer(96))
    assert not tg.batched and isinstance(tg.new_cache(), HFKV)
    prompt = [1, 2, 3, 4, 5, 6]
    want = hf_greedy(tg, prompt, 12)
    out = generate(tg, prompt, ScriptedDrafter(branching(want)), DecodeConfig(max_new_tokens=12))
    assert out.tokens == want and sum(out.stats.accepted) > 0
