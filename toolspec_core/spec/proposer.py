"""The proposer contract between the engine and the drafters: what the scheduler calls, typed.

The engine never imports a drafter; drafters never import the scheduler. Both meet here (and in
``spec.tree``, the draft tree they pass). A *drafter* is one sequence's: it proposes a draft tree
for a step context and takes the verification result back (``feedback``) -- never a decision.
What the scheduler needs to know of it is said by typed class attributes of ``DrafterBase``,
which every drafter of this project subclasses (an object that only has ``propose`` and
``feedback`` is wrapped once by ``conform``, the one adapter):

- ``reads_logits``: its feedback learns from the verified rows' full logits (token recycling),
  so the step keeps them on the host;
- ``prepares``: its ``prepare(prompt_ids)`` does prompt-side work worth running beside a forward.

The *proposer* is the batch-level side the scheduler calls once per step, as vLLM's proposer is:
``prepare`` for admitted sequences that have not drafted yet, ``propose`` for every decoding
sequence (drafters of one class with ``propose_batch`` draft together), ``feedback`` with each
sequence's result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

from toolspec_core.spec.tree import DraftTree, VerifyResult


@dataclass
class DraftContext:
    """What a drafter sees at a step. ``tokens[-1]`` is the root (committed, KV not cached yet).

    ``text`` is the request's decoded output text (the engine's ``Detokenizer``, shared with stop
    strings and streaming, so a drafter never decodes the output again): the text of
    ``generated[:text_tokens]``; tokens past it end inside a character. None in contexts built
    by hand (a drafter that needs the text then decodes it itself).
    """

    tokens: list[int]
    prompt_len: int
    max_depth: int  # never draft deeper than this (remaining max_new_tokens - 1)
    text: str | None = None
    text_tokens: int = 0
    # nodes of a tree the engine's budget can keep for this sequence (None: no bound): a drafter
    # may stop building there, since the budget drops the rest unverified
    max_nodes: int | None = None
    # the budget's floor: nodes less probable than this (path probability) were not worth their
    # row in the batch's last step (``tree.Allocation.left_out``, with a margin); a drafter may
    # leave unexpanded what could only build such nodes (0.0: no floor)
    min_prob: float = 0.0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Drafter(Protocol):
    """One sequence's drafter, as the engine sees it (``DrafterBase`` implements it)."""

    reads_logits: ClassVar[bool]
    prepares: ClassVar[bool]

    def prepare(self, prompt_ids: list[int]) -> None: ...

    def propose(self, ctx: DraftContext) -> DraftTree: ...

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None: ...


class DrafterBase(ABC):
    """What every drafter has: the flags (off), no prompt-side work, no feedback, and a batch
    proposal that drafts one by one (a class that drafts a batch at once overrides it). ``propose``
    is abstract: a drafter class without it cannot be made."""

    reads_logits: ClassVar[bool] = False
    prepares: ClassVar[bool] = False

    def prepare(self, prompt_ids: list[int]) -> None:
        return None

    @abstractmethod
    def propose(self, ctx: DraftContext) -> DraftTree:
        """The sequence's draft tree at this step (an empty tree: nothing worth drafting)."""

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None:
        return None

    @classmethod
    def propose_batch(cls, drafters: list, ctxs: list[DraftContext]) -> list[DraftTree] | None:
        """Trees of ``drafters`` (all of this class) in one call, or None: each drafts alone."""
        return None


class NoDrafter(DrafterBase):
    """Plain autoregressive decoding through the same loop and cache (the baseline)."""

    def propose(self, ctx: DraftContext) -> DraftTree:
        return DraftTree()


class Conformed(DrafterBase):
    """An object with only ``propose`` and ``feedback`` (a test's or a user's drafter) as a
    ``DrafterBase``: no flags, no prompt-side work. ``inner`` is the object."""

    def __init__(self, inner):
        self.inner = inner

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.inner.propose(ctx)

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None:
        self.inner.feedback(tree, result)


def conform(drafter) -> DrafterBase:
    """``drafter`` as a ``DrafterBase`` (itself where it is one; None: ``NoDrafter``)."""
    if drafter is None:
        return NoDrafter()
    return drafter if isinstance(drafter, DrafterBase) else Conformed(drafter)


class Proposer:
    """The batch-level contract the scheduler calls; holds no state of its own (each sequence's
    drafter holds its own), so one serves every scheduler."""

    @staticmethod
    def propose(drafters: list[DrafterBase], ctxs: list[DraftContext]) -> list[DraftTree | BaseException]:
        """Every sequence's tree of one step in one call: drafters of a class whose
        ``propose_batch`` drafts a batch draft together (the place a compiled or shared-work
        drafter does a batch at once), the rest one by one. A drafter that raises gets its
        exception in its slot (the caller drops it); a batch that raises is drafted again one by
        one, so one bad sequence cannot take the others' trees."""
        out: list[DraftTree | BaseException | None] = [None] * len(drafters)
        groups: dict[type, list[int]] = {}
        for i, d in enumerate(drafters):
            groups.setdefault(type(d), []).append(i)
        for cls, idx in groups.items():
            if len(idx) > 1:
                try:
                    trees = cls.propose_batch([drafters[i] for i in idx], [ctxs[i] for i in idx])
                except Exception:  # noqa: BLE001 -- drafted again one by one below: the failing one is found there
                    trees = None
                if trees is not None:
                    for i, t in zip(idx, trees):
                        out[i] = t
                    continue
            for i in idx:
                try:
                    out[i] = drafters[i].propose(ctxs[i])
                except Exception as exc:  # noqa: BLE001 -- the caller logs and drops this drafter
                    out[i] = exc
        return out  # type: ignore[return-value]

    @staticmethod
    def prepare(drafters: list[DrafterBase], prompts: list[list[int]]) -> None:
        """Prompt-side work of drafters whose sequences have not drafted yet (indexing the prompt,
        scanning it for values): what does not depend on any forward's result, so the scheduler
        runs it beside one. Errors surface at ``propose``, which does the work again."""
        for d, p in zip(drafters, prompts):
            try:
                d.prepare(p)
            except Exception:  # noqa: BLE001 -- propose does the work again and reports it
                pass

    @staticmethod
    def feedback(drafter: DrafterBase, tree: DraftTree, result: VerifyResult) -> None:
        """One sequence's verification result back to its drafter (the caller drops a drafter that raises)."""
        drafter.feedback(tree, result)
