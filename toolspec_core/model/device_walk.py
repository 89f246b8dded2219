"""The greedy walk of every sequence's draft tree at once, on the device that holds the argmax.

A step's forward leaves the argmax of each logit row on the accelerator. Copying all of them back
and walking each tree in Python costs a transfer of every row and a host loop per sequence; here the
walk runs where the argmax is, for all greedy sequences together, and one small tensor comes back:
per sequence the accepted path length, the target's token after it and the path itself.

A node is accepted iff its token and every ancestor's token equal the argmax at their parent's row
(:func:`~toolspec_core.engine.verify.greedy_walk` followed from the root). Since a tree is a trie
(no two children of a node share a token, :meth:`DraftTree.is_trie`), the accepted nodes form one
chain, and as parents precede children its nodes in index order are the path. "All ancestors
match" is an AND along parent pointers, computed for every node at once by pointer jumping:
``ceil(log2 T)`` rounds of gathers, whatever the trees' shapes.

The inputs describe the trees only, so the host builds them while the forward runs
(:func:`walk_inputs`); the argmax is the forward's result. Sampling, grammar-constrained walks and
sequences that read their logits keep the host walk (:func:`~toolspec_core.engine.verify.walk`).
"""

from __future__ import annotations

import torch

from toolspec_core.spec.tree import ROOT, DraftTree, VerifyResult

PAD_TOKEN = -1  # a padded node's token: never an argmax, so never accepted


def walk_inputs(trees: list[DraftTree], bases: list[int]) -> torch.Tensor:
    """[B, 1 + 2T] long on the host: per sequence its root's logit row ``bases[b]`` (the row whose
    argmax its first node must equal), its nodes' parents [T] and tokens [T], padded to the
    largest tree ``T`` (padding: parent ROOT, token PAD_TOKEN)."""
    t = max((len(tree) for tree in trees), default=0)
    rows = []
    for tree, base in zip(trees, bases):
        pad = t - len(tree)
        rows.append([base] + tree.parents + [ROOT] * pad + tree.tokens + [PAD_TOKEN] * pad)
    return torch.tensor(rows, dtype=torch.long).reshape(len(trees), 1 + 2 * t)


def device_walk(choice: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The greedy walks of B trees from the argmax ``choice`` [M] (long) of a step's logit rows and
    ``inputs`` [B, 1 + 2T] (:func:`walk_inputs`, on ``choice``'s device).

    Returns [B, 2 + T] long on that device: per sequence the accepted path length L, the target's
    token after the path (the argmax at the last accepted node's row, or the root's), and the
    accepted nodes in path order, then -1s. Node ``i`` of sequence ``b`` has its logits at row
    ``base + 1 + i``; a node whose parent is ROOT hangs off row ``base``."""
    b, width = inputs.shape
    t = (width - 1) // 2
    base = inputs[:, :1]  # [B, 1]
    parents, tokens = inputs[:, 1 : 1 + t], inputs[:, 1 + t :]  # [B, T] each
    ok = tokens == choice[base + 1 + parents]  # [B, T] the node's token is the argmax at its parent
    up = parents  # [B, T] the 2^k-th ancestor (ROOT past the root), k = rounds so far
    for _ in range(max(0, (t - 1).bit_length())):  # after k rounds ok[i] covers i and 2^k - 1 ancestors
        has = up >= 0
        at = up.clamp(min=0)
        ok = ok & (~has | ok.gather(1, at))
        up = torch.where(has, up.gather(1, at), up)
    idx = torch.arange(t, device=inputs.device).expand(b, t)  # [B, T]
    path = torch.where(ok, idx, t).sort(1).values  # [B, T] accepted nodes first, in index (= path) order
    path = torch.where(path == t, -1, path)
    n = ok.sum(1, keepdim=True)  # [B, 1]
    last = torch.where(ok, idx, ROOT).amax(1, keepdim=True) if t else base.new_full((b, 1), ROOT)  # [B, 1]
    token = choice[base + 1 + last]  # [B, 1] the argmax after the deepest accepted node
    return torch.cat([n, token, path], 1)


def read_walks(rows: list[list[int]]) -> list[VerifyResult]:
    """:func:`device_walk`'s rows, copied to the host, as one :class:`VerifyResult` per sequence."""
    return [VerifyResult(row[2 : 2 + row[0]], row[1]) for row in rows]


def accept_greedy(
    choice: torch.Tensor, trees: list[DraftTree], bases: list[int], need: list[int]
) -> tuple[list[VerifyResult], list[int]]:
    """The greedy walks of ``trees`` (roots at logit rows ``bases``) on the device, and the argmax
    of logit rows ``need`` (what host walks and first tokens read), in the step's one copy back."""
    rows, picked = accept_rows(choice, walk_inputs(trees, bases) if trees else None, need)
    return read_walks(rows), picked


def accept_rows(
    choice: torch.Tensor, inputs: torch.Tensor | None, need: list[int]
) -> tuple[list[list[int]], list[int]]:
    """:func:`device_walk` of the trees ``inputs`` [B, 1 + 2T] (host, :func:`walk_inputs`; None:
    no tree) over the argmax ``choice`` [M] (long, wherever the forward left it), and the argmax
    of logit rows ``need``: the rows of the walks and the picked argmax, in one copy back.

    Everything the host sends goes in one transfer, from pinned memory on an accelerator so it
    queues behind the forward instead of waiting for it."""
    dev = choice.device
    b = 0 if inputs is None else inputs.shape[0]
    host = torch.tensor(need, dtype=torch.long)
    if b:
        host = torch.cat([host, inputs.reshape(-1)])
    if dev.type != "cpu":
        host = host.pin_memory().to(dev, non_blocking=True)
    k = len(need)
    parts = [choice[host[:k]]]
    width = 0
    if b:
        walked = device_walk(choice, host[k:].view(b, -1))  # [B, 2 + T]
        width = walked.shape[1]
        parts.append(walked.reshape(-1))
    flat = torch.cat(parts).tolist()  # the step's one sync
    return [flat[k + i * width : k + (i + 1) * width] for i in range(b)], flat[:k]
