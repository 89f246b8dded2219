"""Speculative sampling keeps the target's distribution (statistical tests with fixed seeds).

Tolerance: a chi-square goodness-of-fit test against the exact distribution must not reject
at p < 0.001. Seeds are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny import tiny_target

from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, generate
from toolspec_core.engine.sampling import SamplingParams, target_probs
from toolspec_core.engine.scheduler import run_batch
from toolspec_core.engine.sequence import Sequence
from toolspec_core.engine.verify import sample_walk
from toolspec_core.spec.proposer import DraftContext
from toolspec_core.spec.tree import DraftTree

V = 8


def _fit(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability zero"
    if keep.sum() == 1:
        return 1.0  # a point mass: the assert above is the whole test
    exp = probs[keep].astype(np.float64) / probs[keep].astype(np.float64).sum() * counts.sum()
    return chisquare(counts[keep], exp).pvalue


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8, top_k=5)]
)
def test_sample_walk_first_and_second_token_marginals(params):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, V, generator=g) * 1.5  # rows: root + 7 nodes
    tree = DraftTree()
    # root children 2, 5, 0 (multi-branch); node "2" has children 1 and 3; node "5" has child 4
    n2 = tree.add(-1, 2, 0.5, "a")
    tree.add(n2, 1, 0.5, "a")
    tree.add(n2, 3, 0.5, "a")
    n5 = tree.add(-1, 5, 0.5, "a")
    tree.add(n5, 4, 0.5, "a")
    tree.add(-1, 0, 0.5, "a")
    p_root = target_probs(logits[0], params).numpy()
    rows = {2: n2 + 1, 5: n5 + 1}
    gen = torch.Generator().manual_seed(2)
    n = 20000
    first = np.zeros(V)
    second = {t: np.zeros(V) for t in rows}
    for _ in range(n):
        res = sample_walk(tree, logits, params, gen)
        toks = [tree.tokens[i] for i in res.path] + [res.token]
        first[toks[0]] += 1
        if toks[0] in rows:
            second[toks[0]][toks[1]] += 1
    assert _fit(first, p_root) > 1e-3
    for t, row in rows.items():
        assert _fit(second[t], target_probs(logits[row], params).numpy()) > 1e-3


class FixedTree:
    """Always drafts the same two-level tree of the tokens that are likely in the tiny model."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, ctx: DraftContext) -> DraftTree:
        tree = DraftTree()
        for a in self.tokens[:3]:
            node = tree.add(-1, a, 0.5, "x")
            for b in self.tokens[:2]:
                tree.add(node, b, 0.5, "x")
        return tree

    def feedback(self, tree, result):
        return None


def _exact_three_token_distribution(tg, prompt):
    with torch.inference_mode():
        p1 = torch.softmax(tg.model(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.stack([torch.softmax(tg.model(torch.tensor([prompt + [a]])).logits[0, -1], -1) for a in range(V)])
        p3 = {
            (a, b): torch.softmax(tg.model(torch.tensor([prompt + [a, b]])).logits[0, -1], -1)
            for a, b in itertools.product(range(V), range(V))
        }
    exact = np.array([float(p1[a] * p2[a, b] * p3[(a, b)][c]) for a, b, c in itertools.product(range(V), repeat=3)])
    return exact, torch.argsort(p1, descending=True).tolist()


def _chi_square_p(counts: np.ndarray, exact: np.ndarray) -> float:
    # pool rare outcomes so the chi-square approximation holds
    order = np.argsort(-exact)
    top, rest = order[:40], order[40:]
    obs = np.append(counts[top], counts[rest].sum())
    exp = np.append(exact[top], exact[rest].sum())
    return chisquare(obs, exp.astype(np.float64) / exp.sum() * obs.sum()).pvalue


def test_speculative_sampling_matches_exact_sequence_distribution():
    tg = tiny_target(vocab=V, hidden=32, init=0.4, seed=3)
    prompt = [1, 2, 3]
    exact, likely = _exact_three_token_distribution(tg, prompt)
    counts = np.zeros(V**3)
    n = 3000
    for s in range(n):
        cfg = DecodeConfig(max_new_tokens=3, sampling=SamplingParams(temperature=1.0, seed=1000 + s))
        res = generate(tg, prompt, FixedTree(likely), cfg)
        a, b, c = res.tokens
        counts[a * V * V + b * V + c] += 1
    assert _chi_square_p(counts, exact) > 1e-3


def test_speculative_sampling_inside_mixed_batches_matches_exact_distribution():
    """The same test with every sample decoded in a batch of 16 beside greedy and other sampled
    sequences (other prompts, other trees, other temperatures) under one batch-wide budget."""
    tg = tiny_target(vocab=V, hidden=32, init=0.4, seed=3)
    prompt = [1, 2, 3]
    exact, likely = _exact_three_token_distribution(tg, prompt)
    counts = np.zeros(V**3)
    n, per_batch = 3000, 12
    greedy_ref = None
    for b in range(n // per_batch):
        seqs = [
            Sequence(
                tg,
                prompt,
                FixedTree(likely),
                DecodeConfig(max_new_tokens=3, sampling=SamplingParams(temperature=1.0, seed=1000 + b * per_batch + i)),
            )
            for i in range(per_batch)
        ]
        others = [
            Sequence(tg, [4, 5, 6, 7], FixedTree(likely[::-1]), DecodeConfig(max_new_tokens=4)),
            Sequence(tg, [2, 2], None, DecodeConfig(max_new_tokens=2, sampling=SamplingParams(temperature=0.5))),
            Sequence(tg, [7], FixedTree(likely), DecodeConfig(max_new_tokens=5, sampling=SamplingParams(top_k=2))),
        ]
        mixed = seqs[: b % per_batch] + others + seqs[b % per_batch :]  # the batch's order varies too
        run_batch(tg, mixed, CostModel.cpu_reference() if b % 2 else CostModel.flat())
        for s in seqs:
            a, b2, c = s.result.tokens
            counts[a * V * V + b2 * V + c] += 1
        greedy_ref = greedy_ref or others[0].result.tokens
        assert others[0].result.tokens == greedy_ref
    assert _chi_square_p(counts, exact) > 1e-3


def test_seed_makes_sampling_reproducible():
    tg = tiny_target(vocab=V, hidden=32, init=0.4, seed=3)
    cfg = DecodeConfig(max_new_tokens=6, sampling=SamplingParams(temperature=1.0, seed=7))
    a = generate(tg, [1, 2, 3], FixedTree([1, 2, 3]), cfg).tokens
    b = generate(tg, [1, 2, 3], FixedTree([1, 2, 3]), cfg).tokens
    assert a == b
