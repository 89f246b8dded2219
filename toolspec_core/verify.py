"""Verify a draft tree against the target: tree inputs, accepted path, KV commit.

Input row 0 is the root (the last committed token, whose KV is not yet cached); row ``i + 1``
is tree node ``i``. Verification returns the accepted node path plus exactly one token from
the target (the bonus/correction token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, sample, target_probs
from .tree import ROOT, DraftTree, depths


@dataclass
class VerifyResult:
    path: list[int]  # accepted node indices, root's child first
    token: int  # the one token chosen by the target after the path
    logits: torch.Tensor | None = field(default=None, repr=False)  # [T+1, V] target logits per row


def tree_inputs(root_token: int, tree: DraftTree, prefix_len: int, dtype=torch.float32):
    """Flatten root + tree into model inputs.

    Returns input_ids [1, T+1], position_ids [1, T+1] (prefix_len + depth) and an additive
    float mask [1, 1, T+1, prefix_len + T+1] where each row sees the prefix, itself and its
    ancestors. A float mask is right under both SDPA and eager attention (a bool 4D mask is
    silently misread by eager attention).
    """
    n = len(tree) + 1
    ids = torch.tensor([[root_token] + tree.tokens], dtype=torch.long)
    pos = torch.tensor([[prefix_len] + [prefix_len + d for d in depths(tree.parents)]], dtype=torch.long)
    visible = torch.eye(n, dtype=torch.bool)
    visible[:, 0] = True
    for i, p in enumerate(tree.parents, start=1):
        if p != ROOT:
            visible[i] |= visible[p + 1]
    mask = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype)
    mask[0, 0, :, prefix_len:] = torch.where(visible, 0.0, torch.finfo(dtype).min)
    return ids, pos, mask


def greedy_walk(tree: DraftTree, choice: list[int]) -> VerifyResult:
    """Longest path whose tokens equal the target's argmax at each parent.

    ``choice[j]`` is the argmax at input row ``j`` (0 = root, ``i + 1`` = node ``i``).
    """
    node, path = ROOT, []
    while True:
        want = choice[node + 1]
        nxt = tree.child(node, want)
        if nxt < 0:
            return VerifyResult(path, want)
        path.append(nxt)
        node = nxt


def sample_walk(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> VerifyResult:
    """Recursive rejection sampling for point-mass drafts (lossless for any tree).

    At each accepted node, children are tried in order: child x is accepted with probability
    p'(x), where p' is the target distribution with already-rejected siblings zeroed and
    renormalised; on total rejection the token is drawn from that residual. logits: [T+1, V].
    """
    node, path = ROOT, []
    while True:
        residual = target_probs(logits[node + 1], params)
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
            return VerifyResult(path, sample(residual, generator))


def kv_rows(path: list[int]) -> list[int]:
    """Input rows whose KV must be kept: the root and each accepted node."""
    return [0] + [i + 1 for i in path]


def commit_kv(cache, prefix_len: int, rows: list[int]) -> None:
    """Keep exactly ``rows`` (input rows of the last forward) after ``prefix_len``, in order.

    Gather + crop by index; when the rows are already a contiguous prefix only a crop happens.
    """
    total = cache.get_seq_length()
    keep = len(rows)
    if rows != list(range(keep)):
        src = torch.tensor([prefix_len + r for r in rows], dtype=torch.long)
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
