"""What every drafter shares: online acceptance rates and copy drafts (the contract the engine
calls is ``spec.proposer``).

A drafter returns a draft tree, never a decision: the engine prunes it to the budget, the
target verifies it, and the outcome comes back through ``feedback``.
"""

from __future__ import annotations

from toolspec_core.spec.labels import base_label, is_chain
from toolspec_core.spec.tree import ROOT, DraftTree, VerifyResult, tried


def add_copies(
    tree: DraftTree, conts: list[list[int]], label: str, rates: "LabelRates", shares: list[float] | None = None
) -> DraftTree:
    """Copy drafts as chains: first token at the label's rate (× share, default 1/rank), the rest at
    the continuation rate -- the one conf rule of prompt lookup, value spans and retrieval."""
    first, more = rates.rate(label), rates.rate(label + "+")
    for rank, cont in enumerate(conts):
        share = shares[rank] if shares is not None else 1.0 / (rank + 1)
        tree.add_path(cont, [first * share] + [more] * (len(cont) - 1), label)
    return tree


def rate_key(tree: DraftTree, i: int) -> str:
    """The acceptance-rate key of node ``i``: copy drafts learn their first token and their
    continuation separately ("pld" vs "pld+"), so long copies can earn a long draft."""
    p = tree.parents[i]
    return label_rate_key(tree.labels[i], tree.labels[p] if p >= 0 else None)


def label_rate_key(label: str, parent_label: str | None) -> str:
    """:func:`rate_key` of a node from its label and its parent's (None at the root)."""
    return label + "+" if parent_label == label and is_chain(label) else label


class LabelRates:
    """Online acceptance rate per draft label: P(node accepted | parent accepted).

    A Beta prior keeps early estimates sane; rates are shared across the requests of a drafter
    factory so a server learns its own hardware/model behaviour.
    """

    def __init__(self, prior: dict[str, float] | None = None, strength: float = 4.0):
        self.prior = dict(prior or {})
        self.strength = strength
        self.hits: dict[str, float] = {}
        self.tries: dict[str, float] = {}

    def rate(self, label: str, default: float = 0.5) -> float:
        generic = base_label(label) + ("+" if label.endswith("+") else "")
        p = self.prior.get(label, self.prior.get(generic, default))
        return (self.hits.get(label, 0.0) + p * self.strength) / (self.tries.get(label, 0.0) + self.strength)

    def count(self, label: str, hit: bool) -> None:
        """One chance of ``label``, taken or not."""
        self.tries[label] = self.tries.get(label, 0.0) + 1.0
        if hit:
            self.hits[label] = self.hits.get(label, 0.0) + 1.0

    def update(self, tree: DraftTree, result: VerifyResult, skip=None) -> None:
        """Count every node whose parent was accepted (it had its chance), unless ``skip(i, key)``."""
        accepted = set(result.path)
        for i in tried(tree.parents, result.path):
            lab = rate_key(tree, i)
            if skip is None or not skip(i, lab):
                self.count(lab, i in accepted)


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token path (root's child first) of every node; parents precede children."""
    out: list[tuple[int, ...]] = []
    for tok, p in zip(tree.tokens, tree.parents):
        out.append((tok,) if p == ROOT else out[p] + (tok,))
    return out


def update_keyed_rates(
    rates: LabelRates, tree: DraftTree, result: VerifyResult, keys: dict, label: str | None = None
) -> None:
    """Like ``LabelRates.update`` but counts node i under ``keys[path of i]`` (its rate key).

    Only nodes whose parent was accepted count as tries (they had their chance); with ``label``,
    only the nodes this source owns in the merged tree.
    """
    accepted = set(result.path)
    paths = node_paths(tree)
    for i in tried(tree.parents, result.path):
        key = keys.get(paths[i])
        if key is None or (label is not None and tree.labels[i] != label):
            continue
        rates.tries[key] = rates.tries.get(key, 0.0) + 1.0
        if i in accepted:
            rates.hits[key] = rates.hits.get(key, 0.0) + 1.0
