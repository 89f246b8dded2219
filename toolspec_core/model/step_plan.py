"""The step plan: one typed object for what one verify forward runs and what it reads back.

The scheduler (:mod:`toolspec_core.engine.planner`) builds one :class:`StepPlan` a step; every
target consumes it as it is -- the single-device step runner (:class:`~toolspec_core.model.step_runner.StepRunner`),
every tensor-parallel rank (``deployments/tp``: the step channel carries this object's fields and
the rank rebuilds the same object over its share of the KV), and the targets without a forward
(scripted, replay). Per sequence a :class:`SeqRows` (its row span, new tokens, draft tree as
parent rows, its KV); for the step a :class:`LogitIndex` of named index views, the speculative
ones (:class:`SpecIndex`) in the words of vLLM's ``SpecDecodeMetadata`` (draft counts, target and bonus indices).

Indices: a *row* is one of the step's N new rows (every sequence's, concatenated in plan order); a
*logit index* ``j`` is the ``j``-th row whose logits the head computes, row ``logits.rows[j]``.
The small functions here build the index views from plain ints, so tests call them directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from toolspec_core.model.batch_forward import Segment
from toolspec_core.spec.tree import ROOT


@dataclass(slots=True)
class SeqRows:
    """One sequence's part of a step (made once by the planner and only read after: not frozen,
    which would make it three times as slow to build, a step's worth of them every step).

    ``segment``: its KV view (``cache``), new tokens ``ids`` [n], positions ``pos`` [n] and, for a
    decoding sequence, each row's parent row ``parents`` [n] (None: causal rows, a prompt chunk or
    a lone root). ``sid``: the block table its KV is in (``PagedKV.sid``; 0: a cache of its own);
    ``kv_len``: rows its cache holds before the step. Its rows of the step are ``start .. start + n``
    (``n``: the segment's length);
    a decoding sequence's first ``roots`` rows are its root chain (the last committed token and any
    tokens a grammar forced), the rest its draft tree's nodes; ``roots`` 0: a prompt chunk. Its
    logit indices are ``logit .. logit + logits`` (a completed prompt: 1, its last row; a decoding
    sequence: all n; else 0), its hidden rows' indices ``hidden .. hidden + hiddens``, ``walk`` its
    row of the plan's walk inputs (-1: walked on the host, or not decoding)."""

    segment: Segment
    sid: int
    kv_len: int
    start: int
    n: int
    roots: int = 0
    logit: int = 0
    logits: int = 0
    hidden: int = 0
    hiddens: int = 0
    walk: int = -1

    @property
    def decoding(self) -> bool:
        return self.roots > 0

    @property
    def draft_parents(self) -> list[int]:
        """Its draft tree's parents [T] (``DraftTree.parents``: ROOT for a node off the last root)."""
        return draft_parents(self.segment.parents, self.roots)


@dataclass(frozen=True)
class LogitIndex:
    """The logit indices the step's consumers read (see the module docstring for rows and logit
    indices). ``rows`` [M]: the rows whose logits the head computes. ``full`` [K]: logit indices
    whose full logits come back (sampling, a grammar, logprobs, a drafter that reads logits).
    ``need``: logit indices whose argmax the host reads (host walks, greedy first tokens)."""

    rows: list[int] = field(default_factory=list)
    full: list[int] = field(default_factory=list)
    need: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SpecIndex:
    """The step's speculative views, per decoding sequence (D of them, in plan order):
    ``draft_counts`` [D] its draft nodes; ``root`` [D] the logit index of its last root row (where
    its tree hangs). ``target`` [sum draft_counts]: per draft node the logit index whose argmax its
    token is checked against, its parent's row; ``bonus`` [sum bonus_counts]: per decoding sequence
    the logit indices where a fully accepted branch reads the target's next token, its leaves'
    rows (the root's for an empty tree)."""

    draft_counts: list[int] = field(default_factory=list)
    root: list[int] = field(default_factory=list)
    target: list[int] = field(default_factory=list)
    bonus: list[int] = field(default_factory=list)
    bonus_counts: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepPlan:
    """One verify forward: ``seqs`` in row order, the ``logits`` views (and ``spec``), ``hidden_rows`` (rows whose
    last-layer state comes back: a completed prompt's retrieval key, every prompt row of a sequence
    that keeps them), ``walk`` [B, 1 + 2T] long on the host (the trees walked where the argmax is,
    :func:`~toolspec_core.model.device_walk.walk_inputs`; None: none) and ``argmax`` (False:
    nothing in the step reads an argmax)."""

    seqs: list[SeqRows]
    logits: LogitIndex = field(default_factory=LogitIndex)
    hidden_rows: list[int] = field(default_factory=list)
    walk: torch.Tensor | None = None
    argmax: bool = True

    @functools.cached_property
    def spec(self) -> SpecIndex:
        """The speculative views (:func:`spec_index`), made when first read: no consumer of the
        step needs them to run it."""
        return spec_index(self.seqs)

    @property
    def segments(self) -> list[Segment]:
        return [s.segment for s in self.seqs]

    @property
    def rows(self) -> int:
        """N: the step's new rows."""
        return sum(s.n for s in self.seqs)

    @property
    def wants_argmax(self) -> bool:
        return self.argmax and bool(self.logits.need or (self.walk is not None and self.walk.shape[0]))


def row_starts(sizes: list[int]) -> list[int]:
    """Each span's first row when spans of ``sizes`` rows follow each other from row 0."""
    out, o = [], 0
    for n in sizes:
        out.append(o)
        o += n
    return out


def draft_parents(row_parents: list[int] | None, roots: int) -> list[int]:
    """A decoding sequence's draft parents [T] from its rows' parent rows [R+T]
    (:func:`~toolspec_core.engine.verify.row_parents` inverted): the last root's row is ROOT."""
    if not roots or row_parents is None:
        return []
    return [ROOT if p == roots - 1 else p - roots for p in row_parents[roots:]]


def target_indices(root: int, parents: list[int]) -> list[int]:
    """Per draft node, the logit index whose argmax its token must equal: its parent's row (node
    ``i``'s row is ``root + 1 + i``; a node off the root is checked at ``root``)."""
    return [root + 1 + p for p in parents]


def bonus_indices(root: int, parents: list[int]) -> list[int]:
    """The logit indices where a fully accepted branch reads the target's next token: the rows of
    the tree's leaves in node order, ``[root]`` for an empty tree."""
    inner = set(parents)
    leaves = [root + 1 + i for i in range(len(parents)) if i not in inner]
    return leaves or [root]


def logit_index(seqs: list[SeqRows], full: list[bool], need: list[int]) -> LogitIndex:
    """The step's :class:`LogitIndex` from its sequences (their logit spans laid out in order,
    :func:`logit_spans`), which read their full logits (``full``, one flag per sequence) and the
    logit indices whose argmax the host reads."""
    rows: list[int] = []
    fulls: list[int] = []
    for s, f in zip(seqs, full):
        first = s.start + s.n - s.logits  # a span's logit rows are its last ``logits`` rows
        rows.extend(range(first, first + s.logits))
        if f:
            fulls.extend(range(s.logit, s.logit + s.logits))
    return LogitIndex(rows, fulls, list(need))


def spec_index(seqs: list[SeqRows]) -> SpecIndex:
    """The :class:`SpecIndex` of the decoding sequences among ``seqs``."""
    out = SpecIndex()
    for s in seqs:
        if s.decoding:
            root, parents = s.logit + s.roots - 1, s.draft_parents
            out.draft_counts.append(len(parents))
            out.root.append(root)
            out.target.extend(target_indices(root, parents))
            b = bonus_indices(root, parents)
            out.bonus.extend(b)
            out.bonus_counts.append(len(b))
    return out


def logit_spans(counts: list[int]) -> list[int]:
    """Each sequence's first logit index when they read ``counts`` logit rows each, in order."""
    return row_starts(counts)


def forward_plan(
    segments: list[Segment],
    logits: list[int] | None = None,
    roots: list[int] | None = None,
    need: list[int] = (),
    argmax: bool = True,
) -> StepPlan:
    """A plan of ``segments`` in which segment ``i`` reads the logits of its last ``logits[i]``
    rows (None: none) and is a decoding sequence of ``roots[i]`` root rows (None: prompt chunks),
    nothing comes back in full and the host reads the argmax of logit indices ``need``: a step made
    outside the scheduler (the cost probe's)."""
    sizes = [len(s) for s in segments]
    logits = logits or [0] * len(segments)
    roots = roots or [0] * len(segments)
    seqs = [
        SeqRows(seg, getattr(seg.cache, "sid", 0), seg.cache.get_seq_length(), a, n, r, j, m)
        for seg, a, n, r, j, m in zip(segments, row_starts(sizes), sizes, roots, logit_spans(logits), logits)
    ]
    return StepPlan(seqs, logit_index(seqs, [False] * len(seqs), list(need)), [], None, argmax)
