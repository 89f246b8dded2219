"""The typed proposer contract (``spec/proposer.py``): every drafter of the registry is a
``DrafterBase`` with its flags as class attributes, a foreign object is adapted once, and the
scheduler reads the flags, not the object's other attributes."""

from __future__ import annotations

import pytest

from toolspec_core.drafters.methods import REGISTRY, RequestInfo, make_method
from toolspec_core.spec.proposer import Conformed, DraftContext, DrafterBase, NoDrafter, Proposer, conform
from toolspec_core.spec.tree import DraftTree


class Plain:
    """A drafter that is not a ``DrafterBase``: only ``propose`` and ``feedback``."""

    reads_logits = True  # not read: only DrafterBase's typed flags count

    def __init__(self):
        self.fed = 0

    def propose(self, ctx):
        t = DraftTree()
        t.add_path([7], 0.9, "x")
        return t

    def feedback(self, tree, result):
        self.fed += 1

    def prepare(self, prompt_ids):
        raise AssertionError("a foreign object's prepare is never called")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_method_drafter_conforms_with_typed_flags(name, tok):
    d = make_method(name, tok).drafter(RequestInfo(prompt_ids=tok.encode("hi"), tools=[]))
    assert isinstance(d, DrafterBase) and conform(d) is d
    assert isinstance(type(d).reads_logits, bool) and isinstance(type(d).prepares, bool)
    assert type(d).reads_logits == (name == "token_recycling")
    assert type(d).prepares == name.startswith("toolspec")


def test_a_foreign_drafter_is_adapted_once_and_keeps_the_default_flags():
    p = Plain()
    d = conform(p)
    assert isinstance(d, Conformed) and d.inner is p and conform(d) is d
    assert d.reads_logits is False and d.prepares is False
    Proposer.prepare([d], [[1, 2]])  # the adapter's prepare: nothing
    ctx = DraftContext([1, 2], 1, 8)
    (tree,) = Proposer.propose([d], [ctx])
    assert tree.tokens == [7]
    Proposer.feedback(d, tree, None)
    assert p.fed == 1
    assert isinstance(conform(None), NoDrafter)


def test_a_batch_that_returns_none_drafts_one_by_one():
    class One(DrafterBase):
        def propose(self, ctx):
            t = DraftTree()
            t.add_path([len(ctx.tokens)], 0.9, "x")
            return t

    out = Proposer.propose([One(), One()], [DraftContext([1], 1, 4), DraftContext([1, 2], 1, 4)])
    assert [t.tokens for t in out] == [[1], [2]]


def test_a_drafter_class_without_propose_cannot_be_made():
    class Flagged(DrafterBase):
        reads_logits = True

    with pytest.raises(TypeError, match="propose"):
        Flagged()
