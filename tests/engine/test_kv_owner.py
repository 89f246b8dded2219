"""Who owns a KV row: the block pool holds every sequence's rows -- the hidden retrieval key's
prompts, prefilled by the scheduler in the pool, and prompts prefilled into the pool before
their sequences (a benchmark's) --, one place sets a sequence's cache, and nothing else makes one."""

from __future__ import annotations

import ast
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from scripted import ScriptedDrafter, branching, oracle
from tiny import CharTokenizer, hf_greedy, tiny_model

from toolspec_core.engine.loop import DecodeConfig, prefill
from toolspec_core.engine.scheduler import BatchLimits, Scheduler
from toolspec_core.engine.sequence import Sequence
from toolspec_core.model.target import from_model
from toolspec_core.spec.proposer import DrafterBase

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ragged_tiny():
    return from_model(tiny_model(), CharTokenizer(96), name="tiny", attention="ragged")


def test_prefilled_prompts_are_found_in_the_pool_and_run_ragged(ragged_tiny):
    """Prompts prefilled into the pool first (a benchmark's untimed prefill, ``loop.prefill``) are
    found in its prefix cache by their sequences, which share a step with sequences the scheduler
    prefills from scratch: the pool counts every one of them (the shared blocks too, referenced
    by the sequence and still cached), every step runs the ragged attention, and each output is
    plain greedy's."""
    tg = ragged_tiny
    prompts = [[(7 * i + j) % 95 + 1 for j in range(10 + 3 * i)] for i in range(4)]
    want = [hf_greedy(tg, p, 12) for p in prompts]
    pool = tg.block_pool(1024, 8)
    pres = [prefill(tg, p, pool) for p in prompts[:2]]
    assert all(p.cached_tokens == 0 for p in pres) and all(r == 0 for r in pool.refs)  # cached, unreferenced
    sched = Scheduler(tg, None, BatchLimits(max_running=4, tree_rows=8), pool)
    seqs = [
        Sequence(tg, prompts[0], ScriptedDrafter(oracle(want[0])), DecodeConfig(max_new_tokens=12)),
        Sequence(tg, prompts[1], ScriptedDrafter(branching(want[1])), DecodeConfig(max_new_tokens=12)),
        Sequence(tg, prompts[2], ScriptedDrafter(oracle(want[2])), DecodeConfig(max_new_tokens=12)),
        Sequence(tg, prompts[3], None, DecodeConfig(max_new_tokens=12)),
    ]
    for s in seqs:
        sched.add(s)
    runner = tg.runner(pool)
    before = dict(runner.steps)
    sched.step()  # admission places all four; the prefilled two prefill only their last block
    for s in seqs:
        assert s.cache.pool is pool
    assert [s.stats.cached_tokens for s in seqs] == [8, 8, 0, 0]
    assert sched.steps[-1].prefill_rows == sum(len(p) for p in prompts) - 16
    held = sum(len(s.cache.table) for s in seqs)
    assert pool.stats().used_blocks == held  # the pool counts every row a sequence holds
    sched.run()
    assert [s.result.tokens for s in seqs] == want
    assert runner.steps["ragged"] - before["ragged"] == len(sched.steps)
    assert runner.steps["per_sequence"] == before["per_sequence"]
    assert all(r == 0 for r in pool.refs)  # every block came back


class Counting(DrafterBase):
    """A drafter around another that counts its proposals."""

    def __init__(self, inner):
        self.inner, self.proposals = inner, 0

    def propose(self, ctx):
        self.proposals += 1
        return self.inner.propose(ctx)

    def feedback(self, tree, result):
        self.inner.feedback(tree, result)


def test_hidden_key_prompts_are_prefilled_in_the_pool_and_hold_their_first_draft(ragged_tiny):
    """The hidden retrieval key's path: the scheduler prefills the prompt in its pool blocks like
    any other (the pool counts them), hands the prompt's last state to ``on_prompt`` -- the key a
    separate prefill gives, to float tolerance, finding the same library items -- and the future
    it returns holds the sequence's first draft while the others step on, every step ragged; every
    output is plain greedy's."""
    from retrieval_service.embedding import from_hidden
    from toolspec_core.drafters.toolcall.library import MemoryLibrary, PastCall

    tg = ragged_tiny
    prompts = [[(5 * i + 3 * j) % 95 + 1 for j in range(12 + 5 * i)] for i in range(4)]
    want = [hf_greedy(tg, p, 12) for p in prompts]
    lib = MemoryLibrary()
    for i, p in enumerate(prompts):  # the library's keys, from a prefill of each prompt alone
        lib.add("t", PastCall(f"tool{i % 2}", [i]), from_hidden(prefill(tg, p).hidden))
        lib.add("t", PastCall(f"tool{i % 2}", [i, i]), from_hidden(prefill(tg, p[:-3]).hidden))
    alone = [from_hidden(prefill(tg, p).hidden) for p in prompts[:2]]  # the keys a separate prefill gives
    keys: dict[int, np.ndarray] = {}
    gates = [Future() for _ in prompts[:2]]

    def keyed(i):
        def on_prompt(hidden):
            keys[i] = from_hidden(hidden)
            return gates[i]

        return on_prompt

    pool = tg.block_pool(1024, 8)
    sched = Scheduler(tg, None, BatchLimits(max_running=4, prefill_chunk=32, tree_rows=8), pool)
    drafters = [Counting(ScriptedDrafter(oracle(w))) for w in want]
    cfg = DecodeConfig(max_new_tokens=12)
    seqs = [
        Sequence(tg, p, d, cfg, on_prompt=keyed(i) if i < 2 else None)
        for i, (p, d) in enumerate(zip(prompts, drafters))
    ]
    for s in seqs:
        sched.add(s)
    runner = tg.runner(pool)
    before = dict(runner.steps)
    sched.step()
    assert all(s.cache.pool is pool for s in seqs)
    assert pool.stats().used_blocks == sum(len(s.cache.table) for s in seqs)  # the pool counts every row
    while not all(s.generated for s in seqs[:2]):
        sched.step()
    for _ in range(5):  # held: no draft while the others decode
        sched.step()
    assert [d.proposals for d in drafters[:2]] == [0, 0] and all(s.held for s in seqs[:2])
    assert all(len(s.generated) == 1 for s in seqs[:2]) and drafters[2].proposals > 0 and drafters[3].proposals > 0
    for i in range(2):
        assert np.allclose(keys[i], alone[i], atol=1e-5)  # the key a separate prefill gives
        found = [(c.tool_name, c.token_ids) for c in lib.search("t", keys[i], None, 4)]
        assert found == [(c.tool_name, c.token_ids) for c in lib.search("t", alone[i], None, 4)]
    threading.Timer(0.02, gates[0].set_result, (None,)).start()  # released while the engine waits
    gates[1].set_result(None)
    sched.run()
    assert [s.result.tokens for s in seqs] == want
    assert all(d.proposals > 0 for d in drafters)
    assert runner.steps["ragged"] - before["ragged"] == sum(1 for r in sched.steps)
    assert runner.steps["per_sequence"] == before["per_sequence"]
    assert all(r == 0 for r in pool.refs)


def test_a_failing_on_prompt_leaves_the_sequence_drafting(ragged_tiny):
    """A hook that raises is logged; the sequence drafts without waiting and its output is greedy's."""
    tg = ragged_tiny
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = hf_greedy(tg, prompt, 8)

    def broken(hidden):
        raise RuntimeError("the search could not start")

    seq = Sequence(tg, prompt, ScriptedDrafter(oracle(want)), DecodeConfig(max_new_tokens=8), on_prompt=broken)
    sched = Scheduler(tg, None, BatchLimits(tree_rows=8), tg.block_pool(256, 8))
    sched.add(seq)
    sched.run()
    assert seq.result.tokens == want and seq.hold is None


def test_a_hold_is_read_purely_and_released_at_the_top_of_a_step(ragged_tiny):
    """``Sequence.held`` reads without side effects (a done future stays until the scheduler drops
    it); the next step drops it at its top and the sequence drafts in that same step."""
    tg = ragged_tiny
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = hf_greedy(tg, prompt, 6)
    gate = Future()
    drafter = Counting(ScriptedDrafter(oracle(want)))
    seq = Sequence(tg, prompt, drafter, DecodeConfig(max_new_tokens=6), on_prompt=lambda hidden: gate)
    sched = Scheduler(tg, None, BatchLimits(tree_rows=8), tg.block_pool(256, 8))
    sched.add(seq)
    sched.step()  # the prompt: held from here
    assert seq.held and seq.generated and drafter.proposals == 0
    gate.set_result(None)
    assert seq.held and seq.held and seq.hold is gate  # reading it changes nothing
    sched.step()
    assert seq.hold is None and not seq.held and drafter.proposals == 1
    sched.run()
    assert seq.result.tokens == want


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


def _scoped(path: Path):
    """Every AST node of ``path`` with the qualified name of the function or class it is in."""

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            name = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}.{child.name}" if scope else child.name
            yield name, child
            yield from visit(child, name)

    return visit(ast.parse(path.read_text()), "")


def _calls_and_assignments(path: Path):
    """(function qualname, what) for every ``place_cache`` call and every ``._cache`` assignment."""
    out = []
    for name, node in _scoped(path):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "place_cache":
            out.append((name, "place_cache"))
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            for e in ast.walk(t) if t is not None else ():
                if isinstance(e, ast.Attribute) and e.attr == "_cache" and isinstance(e.ctx, ast.Store):
                    out.append((name, "_cache ="))
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


def _constructions(path: Path):
    """(function qualname, name) of every call of a KV cache class or of ``new_cache``."""
    kinds = {"SeqKV", "HFKV", "PagedKV", "DynamicCache", "new_cache"}
    out = []
    for name, node in _scoped(path):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if called in kinds:
                out.append((name, called))
    return out


def test_nothing_outside_the_pool_makes_a_kv_cache():
    """A sequence's KV is a block table the pool opens (``BlockPool.open``, the only maker of a
    ``PagedKV``; a tensor-parallel rank replays the replica's tables through it); a cache of a
    sequence's own (``Target.new_cache``) is made only where there is no pool -- admission
    without one (``Scheduler._place``) and the cost probe of a target without one. A prompt
    prefilled, cloned or copied anywhere else fails here."""
    found = set()
    for pkg in ("toolspec_core", "deployments", "benchmarks"):
        for path in (ROOT / pkg).rglob("*.py"):
            found |= {(str(path.relative_to(ROOT)), *hit) for hit in _constructions(path)}
    assert sorted(found) == [
        ("toolspec_core/engine/cost_probe.py", "probe_cache", "new_cache"),
        ("toolspec_core/engine/scheduler.py", "Scheduler._place", "new_cache"),
        ("toolspec_core/model/block_pool.py", "BlockPool.open", "PagedKV"),
        ("toolspec_core/model/target.py", "Target.hf_cache", "DynamicCache"),
        ("toolspec_core/model/target.py", "Target.new_cache", "HFKV"),
        ("toolspec_core/model/target.py", "Target.new_cache", "SeqKV"),
    ]
