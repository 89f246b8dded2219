"""Verify a draft tree against the target: the tree as model inputs, and the walk of the target's
logits that picks the accepted path (the scheduler runs the forward and the KV commit).

Input row 0 is the root (the last committed token, whose KV is not yet cached); row ``i + 1``
is tree node ``i``. Verification returns the accepted node path plus exactly one token from
the target (the bonus/correction token).
"""

from __future__ import annotations

import torch

from toolspec_core.engine.sampling import SamplingParams, sample, target_probs
from toolspec_core.spec.tree import ROOT, DraftTree, VerifyResult, depths


def tree_inputs(roots: list[int] | int, tree: DraftTree, prefix_len: int):
    """Flatten the root chain + tree into model inputs.

    ``roots`` are committed tokens whose KV is not cached yet (the last one, plus any tokens a
    grammar forced after it); they form a causal chain and the tree hangs off the last of them.
    Returns input_ids [1, R+T], position_ids [1, R+T] (prefix_len + depth) and the rows' parent
    rows [R+T] (:func:`row_parents`): each row sees the chain up to itself and its ancestors,
    and every row sees the whole cache. That one encoding is what every forward path reads: the
    ragged plan as it is, the paths that take an additive float mask build it from it
    (:func:`~toolspec_core.model.batch_forward.tree_masks`).
    """
    ids, pos, parents = tree_rows(roots, tree, prefix_len)
    return torch.tensor([ids], dtype=torch.long), torch.tensor([pos], dtype=torch.long), parents


def tree_rows(roots: list[int] | int, tree: DraftTree, prefix_len: int) -> tuple[list[int], list[int], list[int]]:
    """:func:`tree_inputs` as lists (ids, positions, parent rows), for a caller that makes the
    tensors of many sequences at once (:func:`~toolspec_core.engine.planner.decode_segments`)."""
    roots = [roots] if isinstance(roots, int) else list(roots)
    r = len(roots)
    last = prefix_len + r - 1
    pos = list(range(prefix_len, prefix_len + r)) + [last + d for d in depths(tree.parents)]
    return roots + tree.tokens, pos, row_parents(r, tree.parents)


def row_parents(roots: list[int] | int, parents: list[int]) -> list[int]:
    """:func:`tree_inputs`' rows as parent rows [R+T]: the root chain's row ``k`` hangs off row
    ``k - 1`` (the first off the cache, -1), node ``i`` off its parent's row (the last root's for a
    top-level node). A row sees exactly itself and its ancestors: ints a step plan carries
    instead of an [R+T, R+T] mask."""
    r = roots if isinstance(roots, int) else len(roots)
    return list(range(-1, r - 1)) + [r - 1 if p == ROOT else r + p for p in parents]


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
    tree: DraftTree,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    constraint=None,
    root_row: int = 0,
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


def walk(
    tree: DraftTree,
    logits: torch.Tensor,
    params: SamplingParams,
    gen,
    constraint=None,
    root_row: int = 0,
    choice: list[int] | None = None,
) -> VerifyResult:
    """The accepted path and the target's token from one sequence's logits [R+T, V] (its rows of a
    forward): greedy, grammar-constrained greedy or sampling, by the sequence's own settings.
    ``choice``: the rows' argmax when the caller has it (one sync for a whole batch)."""
    if not params.greedy:
        return sample_walk(tree, logits.cpu(), params, gen, constraint, root_row)  # CPU generator
    if constraint is not None:
        return constrained_greedy_walk(tree, logits.cpu(), constraint, root_row)  # grammar mask on the host
    if choice is None:
        choice = torch.argmax(logits, -1).tolist()  # argmax on device, one sync
    return greedy_walk(tree, choice, root_row)
