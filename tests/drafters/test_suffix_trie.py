"""Suffix tries: counts, matches, thread-safe growth, and the on-demand context index."""

from __future__ import annotations

import pytest

from toolspec_core.drafters.base import LabelRates
from toolspec_core.drafters.suffix_trie import SuffixTrie
from toolspec_core.spec.tree import DraftTree


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
