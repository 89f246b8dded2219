"""Verify a draft tree against the target: tree inputs, accepted path, KV commit.

Input row 0 is the root (the last committed token, whose KV is not yet cached); row ``i + 1``
is tree node ``i``. Verification returns the accepted node path plus exactly one token from
the target (the bonus/correction token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .sampling import SamplingParams, sample, target_probs
from .tree import ROOT, DraftTree, depths, path_probs


@dataclass
class VerifyResult:
    path: list[int]  # accepted node indices, root's child first
    token: int  # the one token chosen by the target after the path
    logits: torch.Tensor | None = field(default=None, repr=False)  # [R+T, V] every row's logits, when asked for
    head_rows: list[int] = field(default_factory=list)  # rows lm_head projected, per pass (engine.verify_step)


@dataclass(frozen=True)
class LazyHead:
    """When to project only some rows of a verify forward to logits (see :class:`RowLogits`).

    The first pass projects the root's row and the nodes most likely to be reached: all of them
    while there are at most ``free_rows`` rows (on the dev CPU lm_head costs 20 ms for 1 row, 25 ms
    for 8, +2.4 ms a row above), further ones while their chance of being reached is at least
    ``min_reach`` (a second pass costs another ~20 ms weight stream, so a row is worth adding
    when reach x 20 ms > 2.4 ms: ``benchmarks/results/measurements/cpu-lazy-head.json``).
    """

    free_rows: int = 8
    min_reach: float = 0.12


def first_rows(tree: DraftTree, root_row: int, free_rows: int, min_reach: float) -> list[int]:
    """Input rows of the first lm_head pass: the root's, then nodes by the chance they are reached
    (product of ``conf`` along the path: parents never rank below children), all while at most
    ``free_rows`` rows, further ones while that chance is >= ``min_reach``. Increasing."""
    reach = path_probs(tree)
    rows = [root_row]
    for i in sorted(range(len(tree)), key=lambda i: (-reach[i], i)):
        if len(rows) >= free_rows and reach[i] < min_reach:
            break
        rows.append(root_row + 1 + i)
    return sorted(rows)


def subtree_rows(tree: DraftTree, node: int, root_row: int) -> list[int]:
    """Input rows of ``node`` and all its descendants (parents precede children)."""
    inside = {node}
    for j in range(node + 1, len(tree)):
        if tree.parents[j] in inside:
            inside.add(j)
    return [root_row + 1 + j for j in sorted(inside)]


class RowLogits:
    """A verify forward's logits, projected only for the rows a walk reads.

    A walk reads the root's row and each accepted node's, never a rejected node's; on the dev CPU
    the 151k-token lm_head is a quarter of a forward's flops and its cost grows with rows, so the
    first pass projects the likely rows (:func:`first_rows`) and a walk that leaves them projects
    the subtree it entered in one more pass. A row's logits do not depend on which rows share the
    pass (the few-rows kernel is row-invariant), so the walk sees what a full pass gives.
    ``rows[r]`` -> logits [V]; ``choice[r]`` -> argmax (one device sync per pass).
    """

    def __init__(self, project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tree: DraftTree,
                 root_row: int, first: list[int], to_cpu: bool = False):
        self.project, self.hidden, self.tree, self.root_row, self.to_cpu = project, hidden, tree, root_row, to_cpu
        self.rows: dict[int, torch.Tensor] = {}
        self.argmax: dict[int, int] = {}
        self.passes: list[int] = []  # rows projected per pass
        self._fetch(first)

    def _fetch(self, rows: list[int]) -> None:
        rows = [r for r in rows if r not in self.rows]
        if not rows:
            return
        idx = torch.tensor(rows, device=self.hidden.device)
        block = self.project(self.hidden.index_select(0, idx))  # [n, V]
        best = torch.argmax(block, -1).tolist()
        if self.to_cpu:
            block = block.cpu()
        for j, r in enumerate(rows):
            self.rows[r], self.argmax[r] = block[j], best[j]
        self.passes.append(len(rows))

    def _ensure(self, r: int) -> None:
        if r not in self.rows:
            self._fetch(subtree_rows(self.tree, r - self.root_row - 1, self.root_row) if r > self.root_row else [r])

    def __getitem__(self, r: int) -> torch.Tensor:
        self._ensure(r)
        return self.rows[r]

    @property
    def choice(self) -> "_Choice":
        return _Choice(self)


class _Choice:
    def __init__(self, logits: RowLogits):
        self.logits = logits

    def __getitem__(self, r: int) -> int:
        self.logits._ensure(r)
        return self.logits.argmax[r]


def tree_inputs(roots: list[int] | int, tree: DraftTree, prefix_len: int, dtype=torch.float32):
    """Flatten the root chain + tree into model inputs.

    ``roots`` are committed tokens whose KV is not cached yet (the last one, plus any tokens a
    grammar forced after it); they form a causal chain and the tree hangs off the last of them.
    Returns input_ids [1, R+T], position_ids [1, R+T] (prefix_len + depth) and an additive float
    mask [1, 1, R+T, prefix_len + R+T] where each row sees the prefix, the chain up to itself
    and its ancestors. A float mask is right under both SDPA and eager attention (a bool 4D mask
    is silently misread by eager attention).
    """
    roots = [roots] if isinstance(roots, int) else list(roots)
    r, n = len(roots), len(roots) + len(tree)
    ids = torch.tensor([list(roots) + tree.tokens], dtype=torch.long)
    pos = torch.tensor([list(range(prefix_len, prefix_len + r)) + [prefix_len + r - 1 + d for d in depths(tree.parents)]], dtype=torch.long)
    visible = torch.zeros(n, n, dtype=torch.bool)
    visible[:r, :r] = torch.tril(torch.ones(r, r, dtype=torch.bool))
    visible[r:, :r] = True
    for i, p in enumerate(tree.parents):
        row = r + i
        if p != ROOT:
            visible[row, r:] = visible[r + p, r:]
        visible[row, row] = True
    mask = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype)
    mask[0, 0, :, prefix_len:] = torch.where(visible, 0.0, torch.finfo(dtype).min)
    return ids, pos, mask


def greedy_walk(tree: DraftTree, choice: list[int], root_row: int = 0) -> VerifyResult:
    """Longest path whose tokens equal the target's argmax at each parent.

    ``choice[j]`` is the argmax at input row ``j`` (``root_row`` = the root, ``root_row + 1 + i``
    = node ``i``).
    """
    node, path = ROOT, []
    while True:
        want = choice[root_row + 1 + node]
        nxt = tree.child(node, want)
        if nxt < 0:
            return VerifyResult(path, want)
        path.append(nxt)
        node = nxt


def constrained_greedy_walk(tree: DraftTree, logits: torch.Tensor, constraint, root_row: int = 0) -> VerifyResult:
    """Greedy walk where the target's choice is the argmax over tokens the grammar allows.

    The constraint consumes the accepted path and the chosen token as it goes.
    """
    node, path = ROOT, []
    while True:
        row = logits[root_row + 1 + node]
        want = int(torch.argmax(row.masked_fill(~constraint.mask(), float("-inf"))))
        constraint.consume(want)
        nxt = tree.child(node, want)
        if nxt < 0:
            return VerifyResult(path, want)
        path.append(nxt)
        node = nxt


def sample_walk(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    constraint=None, root_row: int = 0,
) -> VerifyResult:
    """Recursive rejection sampling for point-mass drafts (lossless for any tree).

    At each accepted node, children are tried in order: child x is accepted with probability
    p'(x), where p' is the target distribution with already-rejected siblings zeroed and
    renormalised; on total rejection the token is drawn from that residual. logits: [R+T, V].
    With a grammar ``constraint`` the target distribution is the one restricted to allowed tokens.
    """
    node, path = ROOT, []
    while True:
        row = logits[root_row + 1 + node]
        if constraint is not None:
            row = row.masked_fill(~constraint.mask(), float("-inf"))
        residual = target_probs(row, params)
        for c in tree.children(node):
            x = tree.tokens[c]
            px = float(residual[x])
            if px > 0 and float(torch.rand((), generator=generator)) < px:
                path.append(c)
                node = c
                break
            residual[x] = 0.0
            total = float(residual.sum())
            residual = residual / total
        else:
            tok = sample(residual, generator)
            if constraint is not None:
                constraint.consume(tok)
            return VerifyResult(path, tok)
        if constraint is not None:
            constraint.consume(tree.tokens[node])


def kv_rows(path: list[int], n_roots: int = 1) -> list[int]:
    """Input rows whose KV must be kept: the root chain and each accepted node."""
    return list(range(n_roots)) + [n_roots + i for i in path]


def commit_kv(cache, prefix_len: int, rows: list[int]) -> None:
    """Keep exactly ``rows`` (input rows of the last forward) after ``prefix_len``, in order.

    Gather + crop by index; when the rows are already a contiguous prefix only a crop happens.
    """
    total = cache.get_seq_length()
    keep = len(rows)
    if rows != list(range(keep)):
        src = torch.tensor([prefix_len + r for r in rows], dtype=torch.long, device=cache.layers[0].keys.device)
        with torch.inference_mode():  # cache tensors are inference tensors
            _gather_rows(cache, prefix_len, keep, src)
    drop = total - (prefix_len + keep)
    if drop > 0:
        cache.crop(-drop)


def _gather_rows(cache, prefix_len: int, keep: int, src: torch.Tensor) -> None:
    for layer in cache.layers:
        # keys/values: [B, H_kv, S, D]
        layer.keys[:, :, prefix_len : prefix_len + keep] = layer.keys.index_select(2, src)
        layer.values[:, :, prefix_len : prefix_len + keep] = layer.values.index_select(2, src)
