"""The ragged attention (one write and one attention call a layer over the block pool) and the
static-buffer decode step of the CUDA graphs give what the per-sequence loop and plain greedy give."""

from __future__ import annotations

import random

import pytest
import torch
from scripted import ScriptedDrafter, branching, garbage, oracle
from tiny import CharTokenizer, hf_greedy, reference_mask, tiny_model

from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig
from toolspec_core.engine.scheduler import BatchLimits, Scheduler
from toolspec_core.engine.sequence import Sequence
from toolspec_core.engine.verify import tree_inputs
from toolspec_core.model import batch_forward, ragged, step_runner
from toolspec_core.model.batch_forward import Segment
from toolspec_core.model.block_pool import PagedKV
from toolspec_core.model.graphs import StepGraphs, grid_of
from toolspec_core.model.step_runner import StepRunner
from toolspec_core.model.target import from_model
from toolspec_core.spec.tree import DraftTree

BT = 8


def _target(attention: str = "ragged", device: str = "cpu", **kw):
    return from_model(tiny_model().to(device), CharTokenizer(96), name="tiny", attention=attention, **kw)


def _tree(rng: random.Random, n: int) -> DraftTree:
    tree = DraftTree()
    for _ in range(n):
        tree.add(rng.randrange(-1, len(tree)) if len(tree) else -1, rng.randrange(96), 0.5, "x")
    return tree


def _fragment(pool) -> None:
    """Leave every other block free, so later tables are scattered (no contiguous run)."""
    taken = [pool.allocate(1)[0] for _ in range(pool.num_blocks)]
    pool.release(taken[::2])
    pool.stray = taken[1::2]  # referenced for the rest of the test


@pytest.fixture(scope="module")
def tg():
    return _target()


def _caches(tg, pool, prompts, shared_prompt):
    """One PagedKV per prompt; the first ``len(shared_prompt) // BT`` blocks of each prompt that begins
    with ``shared_prompt`` come from the prefix cache."""
    first = PagedKV(pool, pool.allocate(pool.blocks_for(len(shared_prompt))))
    tg.forward([Segment(first, torch.tensor(shared_prompt), torch.arange(len(shared_prompt)))])
    first.release(shared_prompt)
    out = []
    for p in prompts:
        blocks, keys = pool.match(p, len(p) - 1)
        out.append(PagedKV(pool, blocks + pool.allocate(pool.blocks_for(len(p) + 80) - len(blocks)), len(blocks), keys))
    return out


def _steps(rng: random.Random, prompts, caches):
    """Segments of three steps: the prompts' rest (some past GRID_ROWS rows: calls of their own),
    then mixed steps of single roots, root chains and draft trees (each given as its rows'
    parents, as the scheduler draws it)."""
    yield [Segment(c, torch.tensor(p[c.length :]), torch.arange(c.length, len(p))) for p, c in zip(prompts, caches)]
    for _ in range(2):
        segs = []
        for i, c in enumerate(caches):
            kv = c.length
            kind = rng.choice(["single", "chain", "tree"])
            roots = [rng.randrange(96) for _ in range(1 if kind != "chain" else 2)]
            tree = _tree(rng, rng.randint(1, 12)) if kind == "tree" else DraftTree()
            ids, pos, parents = tree_inputs(roots, tree, kv)
            segs.append(Segment(c, ids[0], pos[0], None if kind == "single" else parents))
        yield segs


@pytest.mark.parametrize("seed", range(3))
def test_ragged_forward_equals_the_per_sequence_loop(tg, seed):
    """B = 16 sequences in one pool (shared prefix blocks, scattered tables): each step's hidden
    states and the pool's rows agree with the per-sequence loop over an identical pool."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 96) for _ in range(3 * BT)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(1, 96) for _ in range(rng.randint(1, 90))] for i in range(16)]
    pools, states = [], []
    for attention in ("ragged", "per_sequence"):
        pool = tg.block_pool(8192, BT)
        if seed:
            _fragment(pool)
        caches = _caches(tg, pool, prompts, shared)
        assert any(c.shared for c in caches) and (not seed or not any(c.contiguous for c in caches))
        hidden = [
            StepRunner(tg.model, pool, attention).hidden(segs)
            for segs in _steps(random.Random(seed + 10), prompts, caches)
        ]
        pools.append(caches)
        states.append(hidden)
    for a, b in zip(*states):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for ca, cb in zip(*pools):
        assert ca.length == cb.length
        for la, lb in zip(ca.layers, cb.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(la.values, lb.values, rtol=1e-5, atol=1e-5)


def test_the_plan_reads_each_trees_visibility_from_its_parents(tg):
    """A step's trees (``Segment.parents``, as the scheduler draws them) plan exactly the
    visibility of their rows' ancestors, eager and at a captured grid's shape."""
    rng = random.Random(5)
    pool = tg.block_pool(2048, BT)
    segs = []
    for _ in range(9):
        cache = PagedKV(pool, pool.allocate(4))
        roots = [1] * rng.randint(1, 3)
        ids, pos, parents = tree_inputs(roots, _tree(rng, rng.randint(0, 9)), 0)
        segs.append(Segment(cache, ids[0], pos[0], parents))
    segs.append(Segment(cache, torch.tensor([3]), torch.tensor([0])))  # a single row: no tree
    for grid in (None, (12, 16, 32)):
        g = ragged.plan_step(segs, pool, grid).groups[0]
        assert g.tree.tolist()[:10] == [1] * 9 + [0] and g.tree.sum() == 9
        for i, s in enumerate(segs[:9]):
            n = len(s)
            want = (reference_mask(s.parents)[0, 0] == 0).long()
            assert torch.equal(g.vis[i, :n, :n], want) and not g.vis[i, n:].any() and not g.vis[i, :, n:].any()


def test_a_long_chunk_gets_a_call_of_its_own(tg):
    pool = tg.block_pool(1024, BT)
    caches = [PagedKV(pool, pool.allocate(20)) for _ in range(3)]
    segs = [
        Segment(caches[0], torch.arange(1, 71), torch.arange(70)),  # a prefill chunk past GRID_ROWS
        Segment(caches[1], torch.tensor([5]), torch.tensor([0])),
        Segment(caches[2], torch.arange(1, 9), torch.arange(8)),
    ]
    plan = ragged.plan_step(segs, pool)
    assert [(g.B, g.n) for g in plan.groups] == [(2, 8), (1, 70)]
    assert plan.groups[0].inputs.tolist() == [70] + list(range(71, 79))


@pytest.mark.parametrize("seed", range(2))
def test_static_buffer_decode_steps_equal_the_eager_ragged_steps(tg, seed):
    """The CUDA-graph step run without capture (padded to its bucket: padded sequences, rows and
    KV columns) gives the eager ragged step's states, and leaves the same rows in the pool -- up to
    the linears' row-count-dependent rounding (the grid runs them over B * n rows, padding
    included; bitwise equality is the replay test's, at equal shapes)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 96) for _ in range(2 * BT)]
    prompts = [shared + [rng.randrange(1, 96) for _ in range(rng.randint(1, 40))] for _ in range(rng.choice([3, 11]))]
    runs = []
    for graphed in (False, True):
        pool = tg.block_pool(4096, BT)
        _fragment(pool)
        caches = _caches(tg, pool, prompts, shared)
        graphs = StepGraphs(tg.model, pool, capture=False)
        steps = list(_steps(random.Random(seed + 20), prompts, caches))
        out = [StepRunner(tg.model, pool, "ragged").hidden(steps[0])]  # the prompts: eager (a prefill chunk)
        assert grid_of(steps[0], pool) is None
        for segs in steps[1:]:
            assert grid_of(segs, pool) is not None
            out.append(graphs.run(segs) if graphed else StepRunner(tg.model, pool, "ragged").hidden(segs))
        runs.append((out, caches))
        if graphed:
            assert len(graphs.entries) >= 1
    for a, b in zip(runs[0][0], runs[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for ca, cb in zip(runs[0][1], runs[1][1]):
        for la, lb in zip(ca.layers, cb.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def family():
    rng = random.Random(7)
    base = [rng.randrange(1, 96) for _ in range(3 * BT)]
    prompts = [base + [rng.randrange(1, 96) for _ in range(rng.randint(1, 80))] for _ in range(10)]
    prompts += [[rng.randrange(1, 96) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    ref = _target("per_sequence")
    return prompts, [hf_greedy(ref, p, 10) for p in prompts]


@pytest.mark.parametrize("mode", ["ragged", "graph", "per_sequence"])
def test_pooled_scheduler_greedy_equals_plain_greedy(family, mode, monkeypatch):
    """B = 16 through the scheduler with prefill chunks, single roots, root chains and draft trees,
    prefix-cache hits and scattered tables: every output is plain greedy's (HF generate). "graph"
    replays decode steps through the static buffers (no capture on the CPU). A tree's visibility
    is made once a step, as parent rows: the ragged and graph steps never build a float mask
    (the forward's ``tree_masks``); the per-sequence loop builds one a step with trees, from the
    parents."""
    prompts, want = family
    tg = _target("ragged" if mode != "per_sequence" else "per_sequence")
    pool = tg.block_pool(4096, BT)
    _fragment(pool)
    built = {"tree_masks": 0}
    real_masks = batch_forward.tree_masks

    def counted(*a, **kw):
        if a[1]:  # masks of some trees
            built["tree_masks"] += 1
        return real_masks(*a, **kw)

    monkeypatch.setattr(batch_forward, "tree_masks", counted)
    if mode == "graph":
        # CUDA-only on a real target; the step runs uncaptured here
        tg.runner(pool).graphs = StepGraphs(tg.model, pool, capture=False)
    calls = []
    real = step_runner.ragged_forward if mode != "per_sequence" else step_runner.batched_forward
    name = "ragged_forward" if mode != "per_sequence" else "batched_forward"
    monkeypatch.setattr(step_runner, name, lambda *a: calls.append(1) or real(*a))
    sched = Scheduler(tg, CostModel.flat(), BatchLimits(max_running=16, prefill_chunk=96, tree_rows=16), pool)
    rng = random.Random(3)
    seqs = []
    for i in list(range(len(prompts))) * 2:  # twice: the second time the prompt's blocks are cached
        drafter = ScriptedDrafter(rng.choice([oracle, garbage, branching])(want[i]))
        seqs.append((i, sched.add(Sequence(tg, prompts[i], drafter, DecodeConfig(max_new_tokens=10)))))
    sched.run()
    for i, seq in seqs:
        assert seq.result.tokens == want[i], i
    assert calls and max(r.sequences for r in sched.steps) >= 8
    assert any(r.prefill_rows and r.sequences for r in sched.steps)  # prefill chunks beside decoding rows
    assert pool.stats().hit_tokens > 0
    if mode == "graph":
        assert tg.runner(pool).graphs.entries and tg.runner(pool).steps["graph"] > 0
    tree_steps = sum(1 for r in sched.steps if r.draft_rows)
    assert tree_steps > 0
    if mode == "per_sequence":
        assert built["tree_masks"] == tree_steps  # built in the forward, once a step that has trees
    else:
        assert built["tree_masks"] == 0


def test_attention_setting_is_validated_and_resolved():
    assert _target("auto").attention_mode == "per_sequence"  # the CPU keeps its loop
    assert _target("ragged").attention_mode == "ragged"
    with pytest.raises(ValueError, match="per_sequence, ragged"):
        _target("flash")
    with pytest.raises(ValueError, match="cuda_graphs"):
        _target("ragged", cuda_graphs=True)  # no CUDA here (or on CUDA: the model is on the CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_graph_replay_equals_the_uncaptured_step_and_eager():
    rng = random.Random(5)
    tg = _target("ragged", device="cuda", cuda_graphs=True)
    shared = [rng.randrange(1, 96) for _ in range(2 * BT)]
    prompts = [shared + [rng.randrange(1, 96) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    runs = []
    for how in ("replay", "static", "eager"):
        pool = tg.block_pool(4096, BT)
        caches = _caches(tg, pool, prompts, shared)
        graphs = StepGraphs(tg.model, pool, capture=how == "replay")
        outs = []
        for k, segs in enumerate(_steps(random.Random(6), prompts, caches)):
            if k == 0 or how == "eager":
                outs.append(StepRunner(tg.model, pool, "ragged").hidden(segs))
            else:
                outs.append(graphs.run(segs))
        if how == "replay":
            assert graphs.replays == 2
        runs.append(outs)
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)  # the same kernels over the same buffers
    for a, b in zip(runs[0], runs[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_kv_buckets_are_capped_at_the_pool_so_a_small_pool_replays_every_step():
    """A step's KV bucket never exceeds the pool (no table is longer): a pool of 757 rows -- the
    cost probe's own -- buckets 516 rows at 757, not at 1,024 (which would leave it eager)."""
    from toolspec_core.model.block_pool import BlockPool
    from toolspec_core.model.graphs import kv_bucket

    pool = BlockPool(1, 1, 8, 48, 16)  # 768 rows
    assert kv_bucket(10, pool) == 256 and kv_bucket(300, pool) == 512
    assert kv_bucket(516, pool) == 768 and kv_bucket(768, pool) == 768
    assert kv_bucket(769, pool) is None
