"""Token Recycling: a static BFS tree filled from an adjacency matrix of the target's past top-k tokens."""

from __future__ import annotations

import heapq
from itertools import count

import torch

from toolspec_core.drafters.base import LabelRates, update_keyed_rates
from toolspec_core.spec.labels import TOKEN_RECYCLING
from toolspec_core.spec.proposer import DraftContext, DrafterBase
from toolspec_core.spec.tree import ROOT, DraftTree, VerifyResult

TR_TOPK = 8
TR_RANK_PRIOR = (0.55, 0.15, 0.07, 0.05, 0.035, 0.03, 0.025, 0.02)  # shapes the static tree


# Initial acceptance rates per rank, deliberately optimistic: rates only learn from drafted
# nodes, so a pessimistic start on a steep cost curve would never draft and never learn.
TR_CONF_PRIOR = (0.8, 0.35, 0.2, 0.12, 0.08, 0.06, 0.05, 0.04)


def bfs_template(size: int = 80, prior=TR_RANK_PRIOR, max_depth: int = 10) -> list[tuple[int, int]]:
    """Static tree (parent index, top-k rank) of the ``size`` most likely nodes under a
    per-rank acceptance prior, in BFS order (parents first). Token Recycling's tree is static
    like this; the engine's budget then cuts it per step."""
    tie = count()
    heap = [(-prior[r], next(tie), ROOT, r, 1) for r in range(len(prior))]
    chosen: list[tuple[float, int, int, int, int]] = []  # (prob, id, parent id, rank, depth)
    while heap and len(chosen) < size:
        neg, nid, parent, rank, depth = heapq.heappop(heap)
        chosen.append((-neg, nid, parent, rank, depth))
        if depth < max_depth:
            for r in range(len(prior)):
                heapq.heappush(heap, (neg * prior[r], next(tie), nid, r, depth + 1))
    chosen.sort(key=lambda x: (x[4], -x[0]))  # BFS: by depth, likely first
    index = {nid: i for i, (_, nid, _, _, _) in enumerate(chosen)}
    return [(index.get(parent, ROOT), rank) for _, _, parent, rank, _ in chosen]


class TokenRecyclingDrafter(DrafterBase):
    """Expands the static template from the root token through the adjacency matrix and
    recycles every verified row's top-k back into the matrix."""

    label = TOKEN_RECYCLING
    reads_logits = True  # feedback learns from every verified row's logits, not only the argmax

    def __init__(self, method: "TokenRecyclingMethod"):
        self.m = method
        self.root = -1
        self.context: list[int] = []  # the step's committed tokens (root chain at the end)
        self.keys: dict[tuple[int, ...], str] = {}

    def propose(self, ctx: DraftContext) -> DraftTree:
        self.root, self.context = ctx.tokens[-1], ctx.tokens[-64:]
        tree, self.keys = DraftTree(), {}
        rows: dict[int, list[int]] = {}
        placed: list[int] = []  # template index -> tree index (-2: not placed)
        paths: list[tuple[int, ...]] = []
        for parent, rank in self.m.template:
            tparent = ROOT if parent == ROOT else placed[parent]
            if tparent == -2 or (tparent != ROOT and len(paths[parent]) >= ctx.max_depth):
                placed.append(-2)
                paths.append(())
                continue
            ptok = self.root if tparent == ROOT else tree.tokens[tparent]
            row = rows.get(ptok)
            if row is None:
                row = rows[ptok] = self.m.row(ptok)
            tok = row[rank]
            if tok < 0:
                placed.append(-2)
                paths.append(())
                continue
            key = f"token_recycling:r{rank}"
            tree.tokens.append(tok)  # siblings are distinct top-k ids: no trie merge needed
            tree.parents.append(tparent)
            tree.conf.append(self.m.rates.rate(key, TR_CONF_PRIOR[rank]))
            tree.labels.append(self.label)
            path = (tok,) if tparent == ROOT else paths[parent] + (tok,)
            placed.append(len(tree.tokens) - 1)
            paths.append(path)
            self.keys[path] = key
        return tree

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None:
        update_keyed_rates(self.m.rates, tree, result, self.keys)
        if result.logits is not None:
            # logits rows: the root chain (the last R committed tokens; R > 1 when a grammar
            # forced tokens) then the tree nodes
            n_roots = min(result.logits.shape[0] - len(tree), len(self.context))
            rows = self.context[len(self.context) - n_roots :] + tree.tokens
            self.m.recycle(rows, result.logits[result.logits.shape[0] - len(rows) :])


class TokenRecyclingMethod:
    """Token Recycling: adjacency matrix [V, 8] of the last seen top-8 next tokens of each token.

    Updated from every verified row (draft tokens included, accepted or not -- that is the
    recycling); persists across requests like the paper's matrix.
    """

    name = "token_recycling"
    uses_history, uses_library = True, False

    def __init__(self, tokenizer=None, vocab_size: int | None = None, tree_size: int = 80, topk: int = TR_TOPK):
        self.vocab_size = vocab_size or (
            len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else 0
        )
        self.topk = topk
        self.template = bfs_template(tree_size, TR_RANK_PRIOR[:topk])
        self.matrix = torch.full((max(self.vocab_size, 1), topk), -1, dtype=torch.int32)  # [V, k]; -1 = unseen
        self.rates = LabelRates({f"token_recycling:r{r}": p for r, p in enumerate(TR_CONF_PRIOR[:topk])})

    def _grow(self, vocab: int) -> None:
        """Tokenizer length can undercount the model's padded vocab; grow on demand."""
        extra = torch.full((vocab - self.matrix.shape[0], self.topk), -1, dtype=torch.int32)
        self.matrix = torch.cat([self.matrix, extra])

    def row(self, tok: int) -> list[int]:
        return self.matrix[tok].tolist() if 0 <= tok < self.matrix.shape[0] else [-1] * self.topk

    def recycle(self, row_tokens: list[int], logits: torch.Tensor) -> None:
        """logits: [R+T, V] for input rows ``row_tokens`` (root chain first)."""
        if logits.shape[-1] > self.matrix.shape[0]:
            self._grow(logits.shape[-1])
        top = torch.topk(logits, self.topk, dim=-1).indices.to("cpu", torch.int32)  # [T+1, k]
        self.matrix[torch.tensor(row_tokens, dtype=torch.long)] = top

    def drafter(self, req) -> TokenRecyclingDrafter:
        return TokenRecyclingDrafter(self)

    def observe(self, req, output_ids: list[int], text: str) -> None:
        return None  # the matrix learns from verification logits, not from text
