"""Shared by the engine tests: a tiny random Qwen2 target, its plain greedy reference, and scripted drafters (oracle, garbage, branching) whose trees test losslessness."""

from __future__ import annotations

import pytest
from tiny import hf_greedy, tiny_target

from toolspec_core.spec.proposer import DraftContext, DrafterBase
from toolspec_core.spec.tree import DraftTree

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]


N = 24


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


@pytest.fixture(scope="module")
def reference(tiny):
    return hf_greedy(tiny, PROMPT, N)


class ScriptedDrafter(DrafterBase):
    """Drafts from a function of the generated-so-far tokens (oracle / garbage / branching)."""

    def __init__(self, fn):
        self.fn = fn
        self.accepted = []

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.fn(ctx)

    def feedback(self, tree, result):
        self.accepted.append(len(result.path))


def oracle(ref, conf: float = 0.9):
    """The next 6 reference tokens as a chain, each node at ``conf``."""

    def fn(ctx):
        done = len(ctx.generated)
        tree = DraftTree()
        tree.add_path(ref[done : done + 6], conf, "oracle")
        return tree

    return fn


def garbage(ref):
    def fn(ctx):
        done = len(ctx.generated)
        tree = DraftTree()
        want = ref[done] if done < len(ref) else 0
        tree.add_path([(want + 1) % 96, 5, 6, 7], 0.9, "garbage")
        return tree

    return fn


def branching(ref):
    """Two wrong branches first, the true continuation as the third branch, plus a wrong sub-branch."""

    def fn(ctx):
        done = len(ctx.generated)
        true = ref[done : done + 5]
        tree = DraftTree()
        if not true:
            return tree
        tree.add_path([(true[0] + 1) % 96, 3, 4], 0.5, "b0")
        tree.add_path([(true[0] + 2) % 96, 9], 0.5, "b1")
        node = tree.add_path(true[:2], 0.5, "b2")
        tree.add_path([(true[2] + 7) % 96 if len(true) > 2 else 1], 0.5, "b3", parent=node)
        tree.add_path(true[2:], 0.5, "b2", parent=node)
        return tree

    return fn
