"""Who owns a KV row: the block pool holds every sequence's rows, prompts prefilled outside the
scheduler (the hidden retrieval key's prefill) included, and one place sets a sequence's cache."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from scripted import ScriptedDrafter, branching, oracle
from tiny import CharTokenizer, hf_greedy, tiny_model

from toolspec_core.engine.loop import DecodeConfig, prefill
from toolspec_core.engine.scheduler import BatchLimits, Scheduler
from toolspec_core.engine.sequence import Sequence
from toolspec_core.model.target import from_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ragged_tiny():
    return from_model(tiny_model(), CharTokenizer(96), name="tiny", attention="ragged")


def test_prefilled_prompts_are_placed_in_the_pool_and_run_ragged(ragged_tiny):
    """Sequences whose prompt was prefilled alone (the hidden-key path: prefill, search, then
    decode) share a step with sequences the scheduler prefills: the pool counts every one of them,
    every step runs the ragged attention, the caller's prefilled cache is left as it was, and each
    output is plain greedy's."""
    tg = ragged_tiny
    prompts = [[(7 * i + j) % 95 + 1 for j in range(10 + 3 * i)] for i in range(4)]
    want = [hf_greedy(tg, p, 12) for p in prompts]
    pres = [prefill(tg, p) for p in prompts[:2]]
    pool = tg.block_pool(1024, 8)
    sched = Scheduler(tg, None, BatchLimits(max_running=4, tree_rows=8), pool)
    seqs = [
        Sequence(tg, None, ScriptedDrafter(oracle(want[0])), DecodeConfig(max_new_tokens=12), prefilled=pres[0]),
        Sequence(tg, None, ScriptedDrafter(branching(want[1])), DecodeConfig(max_new_tokens=12), prefilled=pres[1]),
        Sequence(tg, prompts[2], ScriptedDrafter(oracle(want[2])), DecodeConfig(max_new_tokens=12)),
        Sequence(tg, prompts[3], None, DecodeConfig(max_new_tokens=12)),
    ]
    for s in seqs:
        sched.add(s)
    runner = tg.runner(pool)
    before = dict(runner.steps)
    sched.step()  # admission places all four; the prefilled two decode beside the others' prefill
    for s in seqs:
        assert s.cache.pool is pool
    held = sum(len(s.cache.table) for s in seqs)
    assert pool.stats().used_blocks == held  # the pool counts every row a sequence holds
    assert all(p.cache.get_seq_length() == len(p.prompt_ids) for p in pres)  # the caller's prefill is untouched
    sched.run()
    assert [s.result.tokens for s in seqs] == want
    assert runner.steps["ragged"] - before["ragged"] == len(sched.steps)
    assert runner.steps["per_sequence"] == before["per_sequence"]
    assert all(r == 0 for r in pool.refs)  # every block came back


def test_a_sequence_cache_is_set_once():
    tg = from_model(tiny_model(), CharTokenizer(96), name="tiny")
    seq = Sequence(tg, [1, 2, 3], None, DecodeConfig(max_new_tokens=2))
    with pytest.raises(AttributeError):
        seq.cache = tg.new_cache()  # read-only: only admission opens it
    pool = tg.block_pool(64, 8)
    sched = Scheduler(tg, None, BatchLimits(tree_rows=8), pool)
    sched.add(seq)
    sched.step()
    with pytest.raises(RuntimeError, match="already has its KV cache"):
        seq.place_cache(tg.new_cache(), 0)


def _calls_and_assignments(path: Path):
    """(function qualname, what) for every ``place_cache`` call and every ``._cache`` assignment."""
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            name = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                if child.func.attr == "place_cache":
                    out.append((name, "place_cache"))
            targets = child.targets if isinstance(child, ast.Assign) else [getattr(child, "target", None)]
            for t in targets:
                for e in ast.walk(t) if t is not None else ():
                    if isinstance(e, ast.Attribute) and e.attr == "_cache" and isinstance(e.ctx, ast.Store):
                        out.append((name, "_cache ="))
            visit(child, name)

    visit(tree, "")
    return out


def test_one_place_sets_a_sequence_cache():
    """``Scheduler._place`` is the one caller of ``Sequence.place_cache``, and nothing outside
    ``Sequence`` writes its ``_cache``: a second place that sets a sequence's cache fails here."""
    found = []
    for pkg in ("toolspec_core", "deployments", "benchmarks"):
        for path in (ROOT / pkg).rglob("*.py"):
            found += [(str(path.relative_to(ROOT)), *hit) for hit in _calls_and_assignments(path)]
    calls = sorted({(p, f) for p, f, what in found if what == "place_cache"})
    writes = sorted({(p, f.split(".")[0]) for p, f, what in found if what == "_cache ="})
    assert calls == [("toolspec_core/engine/scheduler.py", "Scheduler._place")]
    assert writes == [("toolspec_core/engine/sequence.py", "Sequence")]
