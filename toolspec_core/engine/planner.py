"""The scheduler's step plan, built from its sequences: prompt chunks first, then decoding sequences.

:func:`plan_step` lays the step out as one :class:`~toolspec_core.model.step_plan.StepPlan`: each
sequence's rows (a prompt chunk, or a root chain with its draft tree as parent rows), which rows'
logits and hidden states come back, and which greedy trees are walked where the argmax is. Every
target consumes that object unchanged; the functions here decide only what goes into it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from toolspec_core.engine.sequence import Sequence
from toolspec_core.engine.verify import tree_rows
from toolspec_core.model.batch_forward import Segment
from toolspec_core.model.device_walk import walk_inputs
from toolspec_core.model.step_plan import SeqRows, StepPlan, logit_index, logit_spans, row_starts
from toolspec_core.spec.tree import DraftTree


class Chunk(NamedTuple):
    """Prompt rows ``a .. a + n`` of ``seq`` in a step (a tuple: made per sequence per step, where
    a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``)."""

    seq: Sequence
    a: int
    n: int

    @property
    def done(self) -> bool:
        """The chunk completes the prompt: its last row's logits start the output."""
        return self.a + self.n == len(self.seq.prompt_ids)


class Decode(NamedTuple):
    """A decoding sequence's part of a step: its draft ``tree`` (cut by the budget) over ``kv_len``
    cached rows, verified after its root chain."""

    seq: Sequence
    tree: DraftTree
    kv_len: int


def reads_logits(seq: Sequence) -> bool:
    """Whether ``seq`` reads its rows' full logits, not only their argmax: sampling, a grammar,
    logprobs, or a drafter that learns from the target's logits (``reads_logits`` on the drafter)."""
    return (
        not seq.cfg.sampling.greedy
        or seq.constraint is not None
        or seq.logprobs is not None
        or seq.drafter.reads_logits
    )


def walks_greedy(seq: Sequence) -> bool:
    """Whether ``seq``'s walk reads the argmax alone (greedy, no grammar)."""
    return seq.cfg.sampling.greedy and seq.constraint is None


def prefill_chunks(running: list[Sequence], budget: int) -> list[Chunk]:
    """The prompt rows of a step: sequences still prefilling, in order, each given what is left of
    its prompt until ``budget`` rows are given out (a long prompt stalls the others by one chunk)."""
    out = []
    for seq in running:
        if seq.prefilling and budget > 0:
            n = min(budget, len(seq.prompt_ids) - seq.filled)
            out.append(Chunk(seq, seq.filled, n))
            budget -= n
    return out


def chunk_segments(chunks: list[Chunk]) -> list[Segment]:
    """Each chunk's causal rows over its sequence's cache."""
    return [
        Segment(c.seq.cache, torch.tensor(c.seq.prompt_ids[c.a : c.a + c.n]), torch.arange(c.a, c.a + c.n))
        for c in chunks
    ]


def decode_segments(decoding: list[Decode]) -> list[Segment]:
    """Each decoding sequence's root chain and tree (:func:`~toolspec_core.engine.verify.tree_rows`,
    the tree's visibility as parent rows; a sequence with one row -- its root, no tree -- runs
    causally, no parents). The ids and positions of all of them are made as two tensors and
    handed out as views: two tensor constructions a step, not two a sequence."""
    ids: list[int] = []
    pos: list[int] = []
    sizes: list[int] = []
    parents: list[list[int] | None] = []
    for d in decoding:
        if len(d.seq.roots) == 1 and not d.tree.tokens:  # [1], as tree_rows would make it
            ids.append(d.seq.roots[0])
            pos.append(d.kv_len)
            sizes.append(1)
            parents.append(None)
        else:
            i, p, par = tree_rows(d.seq.roots, d.tree, d.kv_len)
            ids += i
            pos += p
            sizes.append(len(i))
            parents.append(par)
    if not decoding:
        return []
    all_ids = torch.tensor(ids, dtype=torch.long).split(sizes)  # [n] views, one per sequence
    all_pos = torch.tensor(pos, dtype=torch.long).split(sizes)
    return [Segment(d.seq.cache, i, p, par) for d, i, p, par in zip(decoding, all_ids, all_pos, parents)]


def walked_on_device(decoding: list[Decode], reads: list[bool], greedy: bool, here: bool) -> list[bool]:
    """Which decoding sequences' greedy walks run where the argmax is (``here``: the target walks
    there): greedy, unconstrained ones that read nothing but the argmax (``reads``: which read
    their logits, :func:`reads_logits`) and whose tree is a trie. Sampling, a grammar, logprobs
    and drafters that learn from the logits walk on the host."""
    if not (greedy and here):
        return [False] * len(decoding)
    return [not r and d.tree.is_trie() for d, r in zip(decoding, reads)]


def host_argmax(chunks: list[Chunk], decoding: list[Decode], seqs: list[SeqRows], walked, greedy, here) -> list[int]:
    """Logit indices whose argmax the host reads: none where no walk is greedy; every one where the
    target walks nothing (``here`` False); else the completed prompts' last rows (a greedy start
    reads their argmax) and the rows of greedy trees walked on the host."""
    if not greedy:
        return []
    total = sum(s.logits for s in seqs)
    if not here:
        return list(range(total))
    need = list(range(sum(c.done for c in chunks)))  # completed prompts' logit indices come first
    for d, s, dev in zip(decoding, seqs[len(chunks) :], walked):
        if not dev and walks_greedy(d.seq):
            need.extend(range(s.logit, s.logit + s.logits))
    return need


def plan_step(chunks: list[Chunk], decoding: list[Decode], here: bool) -> StepPlan:
    """The step's plan: ``chunks``' rows, then ``decoding``'s, laid out in that order (row spans,
    logit spans, hidden spans), with the walks where the argmax is when ``here`` (the target's or
    scheduler's ``device_walk``)."""
    segments = chunk_segments(chunks) + decode_segments(decoding)
    sizes = [len(s) for s in segments]
    reads = [reads_logits(d.seq) for d in decoding]
    logits = [int(c.done) for c in chunks] + sizes[len(chunks) :]
    hiddens = [c.n if c.seq.states is not None else int(c.done) for c in chunks] + [0] * len(decoding)
    roots = [0] * len(chunks) + [len(d.seq.roots) for d in decoding]
    read_chunks = [c.done and reads_logits(c.seq) for c in chunks]
    full = read_chunks + reads
    greedy = any(walks_greedy(d.seq) for d in decoding) or any(c.done and not r for c, r in zip(chunks, read_chunks))
    walked = walked_on_device(decoding, reads, greedy, here)
    walk_at = row_starts([int(w) for w in walked])
    walk_row = [-1] * len(chunks) + [at if w else -1 for at, w in zip(walk_at, walked)]
    kv_lens = [c.seq.cache.get_seq_length() for c in chunks] + [d.kv_len for d in decoding]
    spans = zip(segments, row_starts(sizes), sizes, logit_spans(logits), row_starts(hiddens), kv_lens)
    seqs = [
        SeqRows(
            seg,
            sid=getattr(seg.cache, "sid", 0),
            kv_len=kv_len,
            start=start,
            n=n,
            roots=r,
            logit=logit,
            logits=m,
            hidden=hidden,
            hiddens=h,
            walk=w,
        )
        for (seg, start, n, logit, hidden, kv_len), r, m, h, w in zip(spans, roots, logits, hiddens, walk_row)
    ]
    hidden_rows = [r for s in seqs for r in range(s.start + s.n - s.hiddens, s.start + s.n)]
    need = host_argmax(chunks, decoding, seqs, walked, greedy, here)
    mine = [(d.tree, s.logit + s.roots - 1) for d, s in zip(decoding, seqs[len(chunks) :]) if s.walk >= 0]
    walk = walk_inputs([t for t, _ in mine], [b for _, b in mine]) if mine else None
    return StepPlan(seqs, logit_index(seqs, full, need), hidden_rows, walk, greedy)
