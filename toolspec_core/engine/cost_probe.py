"""The start-up probe of the verify-cost curve: one k-token verify step timed right after a
1-token one, on the same code path decoding runs."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np
import torch

from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.commit import commit_kv
from toolspec_core.engine.verify import tree_inputs
from toolspec_core.model.batch_forward import Segment
from toolspec_core.model.step_plan import forward_plan
from toolspec_core.spec.labels import PROBE
from toolspec_core.spec.tree import DraftTree

DEFAULT_KS = (
    1,
    2,
    3,
    4,
    6,
    8,
    12,
    16,
    17,
    24,
    32,
    48,
    64,
)  # 16 | 17: where a CPU kernel may switch; 3, 6: small trees are common
# forwards of a batch: every sequence's root plus the trees the budget keeps across all of them
BATCH_KS = (96, 128, 192, 256)


def measure_cost_points(
    target, prefix_len: int = 500, ks=DEFAULT_KS, repeats: int = 7
) -> tuple[dict[int, float], dict[int, float]]:
    """(median seconds, cost relative to k=1) of one verify step of k tree tokens (chain) over a
    ``prefix_len`` cache -- the curve the budget uses, and ``toolspec bench-cost``'s measurement.

    Uses the same code path as decoding (hidden states + lm_head on all rows, float mask for
    k > 1, KV commit of one row), on random token ids (timing does not depend on values). Every
    k-token forward directly follows a 1-token one, as in real decoding, and is normalised by it;
    the median over rounds (each in a shuffled order) resists a shared machine whose speed
    drifts -- a 1-token forward slows more than a many-token one when memory bandwidth is
    contended, so ratios against a 1-token time from another moment come out too low.
    """
    steps = probe_steps(target, prefix_len, ks)
    return paired_cost(lambda k: steps[k](), ks, repeats)


def probe_steps(target, prefix_len: int = 500, ks=DEFAULT_KS) -> dict:
    """k -> a function running one verify step of k tree tokens (a chain of k-1 random drafts)
    over one shared random ``prefix_len``-token cache, cropping it back after, and returning the
    step's seconds (the crop untimed): what the cost probe times and ``benchmarks.studies.verify_profile``
    profiles. Each step is :meth:`~toolspec_core.model.target.Target.step` on a cache of the kind
    the scheduler gives a sequence, then the KV commit of one row -- the decoding path, for a
    tensor-parallel target too."""

    vocab = target.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prefix_len,), generator=g)
    cache, pool = probe_cache(target, prefix_len + max(ks) + 1)
    target.step(forward_plan([Segment(cache, ids, torch.arange(prefix_len))], argmax=False), pool)
    if cache.get_seq_length() != prefix_len:  # e.g. a cache argument the model ignored: k tokens would be timed alone
        raise RuntimeError(f"the prefill left {cache.get_seq_length()} cached positions, expected {prefix_len}")

    def step(tree: DraftTree) -> float:
        t0 = time.perf_counter()
        kv = cache.get_seq_length()
        tids, pos, parents = tree_inputs([0], tree, kv)
        n = tids.shape[1]
        segment = Segment(cache, tids[0], pos[0], parents if tree.tokens else None)
        target.step(forward_plan([segment], [n], [1], need=list(range(n))), pool)
        commit_kv(cache, kv, [0])
        dt = time.perf_counter() - t0
        cache.crop(-(cache.get_seq_length() - prefix_len))
        return dt

    out = {}
    for k in ks:
        tree = DraftTree()
        tree.add_path(torch.randint(0, vocab, (k - 1,), generator=g).tolist(), 0.5, PROBE)
        out[k] = functools.partial(step, tree)
    return out


def probe_cache(target, tokens: int):
    """(an empty cache of ``tokens`` rows as decoding uses, its pool): a block table in a pool of
    the target's (its own small one), or the target's per-sequence cache where it has no pool."""
    pool = target.block_pool(tokens, 16, prefix_caching=False)
    if pool is None:
        return target.new_cache(), None
    return pool.open(pool.allocate(pool.blocks_for(tokens))), pool


def paired_cost(once, ks, repeats: int) -> tuple[dict[int, float], dict[int, float]]:
    """(median seconds, cost relative to k=1) per k from ``once(k)`` -> seconds of one k-token forward.

    Every k-token forward directly follows a 1-token one and is normalised by it; median over
    ``repeats`` rounds, each in a shuffled order, after one warm-up of every k.
    """
    import random

    for k in ks:  # warm-up
        once(k)
    order = [k for k in ks if k != 1]
    times: dict[int, list[float]] = {k: [] for k in ks}
    ratios: dict[int, list[float]] = {k: [] for k in order}
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for k in order:
            base, t = once(1), once(k)
            times[1].append(base)
            times[k].append(t)
            ratios[k].append(t / base)
    points = {k: float(np.median(r)) for k, r in ratios.items()}
    return {k: float(np.median(t)) for k, t in times.items()}, {1: 1.0, **points}


def measure_cost_model(
    target,
    prefix_len: int = 500,
    max_nodes: int = 63,
    repeats: int = 7,
    calibrate: bool = False,
    max_rows: int = 0,
) -> CostModel:
    """The curve over one sequence's trees (k <= max_nodes + 1), and over a batch's forwards up to
    ``max_rows`` rows: k rows are timed in one sequence, which costs what k rows spread over a
    batch do in the linears and MLP (the bulk of a step) -- each sequence's attention over its
    own KV is the part it leaves out."""
    ks = tuple(k for k in DEFAULT_KS if k <= max_nodes + 1) + tuple(k for k in BATCH_KS if k <= max_rows)
    points = measure_cost_points(target, prefix_len, ks, repeats)[1]
    return CostModel(points, max_nodes, "measured", calibrate, max_rows=max_rows)


COST_SPECS = ("measure", "reference", "flat", "none")


def cost_model_for(spec: str, target=None, calibrate: bool = False, max_rows: int = 0) -> CostModel | None:
    """The cost model a config names: ``measure`` (probe ``target`` now, up to ``max_rows`` rows for
    batches), ``reference`` (the CPU reference curve), ``flat`` (free verification), ``none`` (no
    budget), or a path to a saved ``CostModel.to_dict`` JSON."""
    if spec in ("measure", "measured"):
        cost = measure_cost_model(target, max_rows=max_rows)
    elif spec == "reference":
        cost = CostModel.cpu_reference()
    elif spec == "flat":
        cost = CostModel.flat()
    elif spec == "none":
        return None
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"cost model must be one of {', '.join(COST_SPECS)} or a JSON file, got {spec!r}")
        cost = CostModel.from_dict(json.loads(path.read_text()), source=f"file:{path.name}")
    cost.calibrate = calibrate
    return cost
