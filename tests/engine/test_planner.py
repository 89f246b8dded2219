"""The scheduler's plan from its sequences (engine/planner.py): prompt chunks under the budget,
row and logit spans, the logit index views, which walks run where the argmax is and which argmax
the host reads."""

from __future__ import annotations

import pytest
from tiny import tiny_target

from toolspec_core.engine.planner import Chunk, Decode, decode_segments, plan_step, prefill_chunks
from toolspec_core.engine.sampling import SamplingParams
from toolspec_core.engine.sequence import DecodeConfig, Sequence
from toolspec_core.engine.verify import tree_inputs
from toolspec_core.model.device_walk import walk_inputs
from toolspec_core.spec.tree import ROOT, DraftTree


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=90)


def _seq(target, prompt, cfg=DecodeConfig(max_new_tokens=8), roots=None):
    seq = Sequence(target, prompt, None, cfg)
    seq.place_cache(target.new_cache(), 0)
    if roots is not None:  # a decoding sequence: its prompt in, its root chain to verify
        seq.filled, seq.roots = len(prompt), list(roots)
    return seq


def _tree(tokens, parents) -> DraftTree:
    tree = DraftTree()
    for t, p in zip(tokens, parents):
        tree.add(p, t, 0.5, "test")
    return tree


def test_prefill_chunks_share_the_budget_in_order(target):
    a, b, c = _seq(target, list(range(1, 11))), _seq(target, [4, 5, 6]), _seq(target, [7], roots=[3])
    assert prefill_chunks([a, b, c], 6) == [Chunk(a, 0, 6)]
    chunks = prefill_chunks([a, b, c], 16)
    assert chunks == [Chunk(a, 0, 10), Chunk(b, 0, 3)] and all(ch.done for ch in chunks)
    a.filled = 6
    assert prefill_chunks([a, b], 5) == [Chunk(a, 6, 4), Chunk(b, 0, 1)] and not Chunk(b, 0, 1).done


def test_plan_of_a_completed_prompt_a_device_walk_and_a_host_walk(target):
    """A completed prompt (its last row's logits), a greedy sequence walked where the argmax is and
    one that reads its logits (logprobs: walked on the host from the argmax it reads back)."""
    a = _seq(target, list(range(1, 11)))
    c = _seq(target, [7, 8], roots=[5])
    d = _seq(target, [9, 9], DecodeConfig(max_new_tokens=8, logprobs=2), roots=[7, 8])
    tc, td = _tree([11, 12, 13], [ROOT, 0, 0]), _tree([21, 22], [ROOT, 0])
    plan = plan_step([Chunk(a, 0, 10)], [Decode(c, tc, 0), Decode(d, td, 0)], here=True)
    assert [(s.start, s.n, s.roots, s.logit, s.logits, s.walk) for s in plan.seqs] == [
        (0, 10, 0, 0, 1, -1),
        (10, 4, 1, 1, 4, 0),
        (14, 4, 2, 5, 4, -1),
    ]
    ix = plan.logits
    assert ix.rows == [9] + list(range(10, 18))
    assert ix.full == [5, 6, 7, 8]  # the logprobs sequence's rows
    assert ix.need == [0, 5, 6, 7, 8]  # the first token's argmax, then the host walk's rows
    spec = plan.spec
    assert spec.draft_counts == [3, 2] and spec.root == [1, 6]
    assert spec.target == [1, 2, 2, 6, 7] and spec.bonus == [3, 4, 8] and spec.bonus_counts == [2, 1]
    assert plan.hidden_rows == [9] and plan.argmax and plan.rows == 18
    assert plan.walk.tolist() == walk_inputs([tc], [1]).tolist()
    assert [s.draft_parents for s in plan.seqs[1:]] == [tc.parents, td.parents]
    assert plan.seqs[2].segment.ids.tolist() == [7, 8, 21, 22]

    host = plan_step([Chunk(a, 0, 10)], [Decode(c, tc, 0), Decode(d, td, 0)], here=False)
    assert host.walk is None and all(s.walk == -1 for s in host.seqs)
    assert host.logits.need == list(range(9))  # every walk on the host: every row's argmax back


def test_a_step_that_reads_no_argmax(target):
    """Sampled sequences and a prompt chunk mid-prompt: nothing reads an argmax, no walk."""
    sampled = DecodeConfig(max_new_tokens=8, sampling=SamplingParams(temperature=0.7, seed=1))
    a = _seq(target, list(range(1, 11)), sampled)
    s = _seq(target, [3, 4], sampled, roots=[6])
    plan = plan_step([Chunk(a, 0, 4)], [Decode(s, DraftTree(), 0)], here=True)
    assert not plan.argmax and plan.logits.need == [] and plan.walk is None
    assert plan.logits.rows == [4] and plan.logits.full == [0] and plan.hidden_rows == []
    assert plan.seqs[1].segment.parents is None  # a lone root runs causally
    assert plan.spec.draft_counts == [0] and plan.spec.bonus == [0]


def test_decode_segments_are_each_sequences_tree_inputs(target):
    """The decoding sequences' rows made as two tensors for the batch: each sequence's ids,
    positions and parent rows are what ``tree_inputs`` gives it alone (a lone root: one causal row)."""
    seqs = [_seq(target, [7, 8], roots=[5]), _seq(target, [9], roots=[3]), _seq(target, [9, 9], roots=[7, 8])]
    trees = [_tree([11, 12, 13], [ROOT, 0, 0]), DraftTree(), _tree([21, 22, 23], [ROOT, 0, 1])]
    decodes = [Decode(s, t, kv) for s, t, kv in zip(seqs, trees, (4, 9, 17))]
    segs = decode_segments(decodes)
    for d, seg in zip(decodes, segs):
        if not d.tree.tokens and len(d.seq.roots) == 1:
            assert seg.ids.tolist() == d.seq.roots and seg.pos.tolist() == [d.kv_len] and seg.parents is None
            continue
        ids, pos, parents = tree_inputs(d.seq.roots, d.tree, d.kv_len)
        assert seg.ids.tolist() == ids[0].tolist() and seg.pos.tolist() == pos[0].tolist() and seg.parents == parents
        assert seg.cache is d.seq.cache
    assert decode_segments([]) == []
