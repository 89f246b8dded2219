"""The step plan's index views from plain ints: row spans, draft parents, the logit indices each
draft node is checked at (target) and where a fully accepted branch reads its next token (bonus)."""

from __future__ import annotations

import torch

from toolspec_core.engine.verify import row_parents
from toolspec_core.model.batch_forward import Segment
from toolspec_core.model.step_plan import (
    LogitIndex,
    SeqRows,
    SpecIndex,
    bonus_indices,
    draft_parents,
    forward_plan,
    logit_index,
    logit_spans,
    row_starts,
    spec_index,
    target_indices,
)
from toolspec_core.spec.tree import ROOT

TREE = [ROOT, 0, 0, 1]  # node 0 off the root; 1 and 2 under 0; 3 under 1: leaves 2 and 3


class Cache:
    """What a plan reads of a cache: its block table's id and its length."""

    sid, length = 7, 11

    def get_seq_length(self) -> int:
        return self.length


def _seg(n: int, parents=None) -> Segment:
    return Segment(Cache(), torch.arange(n), torch.arange(n), parents)


def test_row_and_logit_spans_follow_each_other():
    assert row_starts([4, 3, 6, 1]) == [0, 4, 7, 13]
    assert row_starts([]) == []
    assert logit_spans([0, 1, 6, 1]) == [0, 0, 1, 7]


def test_draft_parents_invert_the_rows_parents():
    for roots in (1, 2, 3):
        assert draft_parents(row_parents(roots, TREE), roots) == TREE
    assert draft_parents(None, 0) == [] and draft_parents([-1], 1) == []


def test_target_and_bonus_indices_of_a_tree():
    assert target_indices(5, TREE) == [5, 6, 6, 7]  # each node at its parent's row; node 0 at the root's
    assert bonus_indices(5, TREE) == [8, 9]  # the leaves' rows
    assert bonus_indices(5, []) == [5]  # no tree: the root's row gives the next token
    chain = [ROOT, 0, 1]
    assert target_indices(0, chain) == [0, 1, 2] and bonus_indices(0, chain) == [3]  # vLLM's chain case


def test_logit_index_of_prompt_chunks_and_decoding_sequences():
    """A prompt chunk mid-prompt (no logits), a completed one (its last row), a decoding sequence
    of two roots and a four-node tree, a lone root: rows, full rows, draft counts, root, target and
    bonus indices, each sequence's span."""
    seqs = [
        SeqRows(_seg(4), 1, 0, 0, 4),
        SeqRows(_seg(3), 2, 5, 4, 3, 0, 0, 1),
        SeqRows(_seg(6, row_parents(2, TREE)), 3, 9, 7, 6, 2, 1, 6, walk=0),
        SeqRows(_seg(1), 4, 12, 13, 1, 1, 7, 1),
    ]
    got = logit_index(seqs, [False, True, False, True], [0, 7])
    assert got == LogitIndex(rows=[6, 7, 8, 9, 10, 11, 12, 13], full=[0, 7], need=[0, 7])
    assert spec_index(seqs) == SpecIndex(
        draft_counts=[4, 0], root=[2, 7], target=[2, 3, 3, 4], bonus=[5, 6, 7], bonus_counts=[2, 1]
    )
    assert [s.n for s in seqs] == [4, 3, 6, 1] and [s.decoding for s in seqs] == [False, False, True, True]
    assert seqs[2].draft_parents == TREE


def test_forward_plan_lays_out_a_step_made_outside_the_scheduler():
    """The cost probe's steps: a prefill with no logits, then a root and a chain of drafts read in full by argmax."""
    prefill = forward_plan([_seg(5)], argmax=False)
    assert prefill.logits.rows == [] and not prefill.wants_argmax and prefill.rows == 5
    assert [(s.sid, s.kv_len, s.start) for s in prefill.seqs] == [(7, 11, 0)]
    verify = forward_plan([_seg(4, row_parents(1, [ROOT, 0, 1]))], [4], [1], need=[0, 1, 2, 3])
    assert verify.logits.rows == [0, 1, 2, 3] and verify.logits.need == [0, 1, 2, 3] and verify.wants_argmax
    assert verify.spec.draft_counts == [3] and verify.spec.target == [0, 1, 2] and verify.spec.bonus == [3]
