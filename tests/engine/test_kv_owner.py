"""Who owns a KV row: the block pool holds every sequence's rows -- the hidden retrieval key's
prompts, prefilled by the scheduler in the pool, and prompts prefilled into the pool before
their sequences (a benchmark's) --, one place sets a sequence's cache, nothing else makes one
(every cache kind and every maker read from the source), and nothing copies one."""

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


def test_a_held_sequence_that_decodes_does_so_undrafted_beside_the_others(ragged_tiny):
    """``decode_held`` (the server's hidden-key search): held, the sequence takes a token a step
    without a draft instead of sitting out steps; once its future is done it drafts; outputs are
    plain greedy's, a held gate's (``decode_held`` off) sitting out as before."""
    tg = ragged_tiny
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]
    want = [hf_greedy(tg, p, 10) for p in prompts]
    gates = [Future(), Future()]
    drafters = [Counting(ScriptedDrafter(oracle(w))) for w in want]
    seqs = [
        Sequence(tg, p, d, DecodeConfig(max_new_tokens=10), on_prompt=lambda h, g=g: g, decode_held=dh)
        for p, d, g, dh in zip(prompts, drafters, gates, (True, False))
    ]
    sched = Scheduler(tg, None, BatchLimits(tree_rows=8), tg.block_pool(512, 8))
    for s in seqs:
        sched.add(s)
    while not all(s.generated for s in seqs):
        sched.step()
    at = [len(s.generated) for s in seqs]
    for _ in range(3):
        sched.step()
    assert all(s.held for s in seqs) and [d.proposals for d in drafters] == [0, 0]
    assert [len(s.generated) for s in seqs] == [min(at[0] + 3, len(want[0])), at[1]]  # one decodes, the gate waits
    for g in gates:
        g.set_result(None)
    sched.run()
    assert [s.result.tokens for s in seqs] == want
    assert drafters[1].proposals > 0


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


# what the cache checks read: everything that runs a model's KV (a study too)
SCANNED = ("toolspec_core", "deployments", "benchmarks")
PROTOCOL = ROOT / "toolspec_core" / "model" / "kv.py"


def _trees(root: Path = ROOT, packages=SCANNED) -> dict[str, ast.Module]:
    return {
        str(path.relative_to(root)): ast.parse(path.read_text())
        for pkg in packages
        for path in sorted((root / pkg).rglob("*.py"))
    }


def _scoped(tree: ast.AST):
    """Every AST node of ``tree`` with the qualified name of the function or class it is in."""

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            name = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}.{child.name}" if scope else child.name
            yield name, child
            yield from visit(child, name)

    return visit(tree, "")


def _functions(tree: ast.Module):
    """(qualname, in a class, the def) for every function of ``tree``, nested ones included."""
    for name, node in _scoped(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield name, "." in name, node


def _calls_and_assignments(tree: ast.Module):
    """(function qualname, what) for every ``place_cache`` call and every ``._cache`` assignment."""
    out = []
    for name, node in _scoped(tree):
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
    found = [(path, *hit) for path, tree in _trees().items() for hit in _calls_and_assignments(tree)]
    calls = sorted({(p, f) for p, f, what in found if what == "place_cache"})
    writes = sorted({(p, f.split(".")[0]) for p, f, what in found if what == "_cache ="})
    assert calls == [("toolspec_core/engine/scheduler.py", "Scheduler._place")]
    assert writes == [("toolspec_core/engine/sequence.py", "Sequence")]


def _body(fn: ast.AST):
    """The nodes of a function's own body (not those of the functions and classes inside it)."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo += ast.iter_child_nodes(node)


def _module_names(tree: ast.Module) -> set[str]:
    """The names ``import m`` binds in a file: ``os.open(...)`` is a module's call, not a pool's."""
    return {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}


def cache_classes(trees: dict[str, ast.Module]) -> set[str]:
    """The KV cache kinds, read from the source: every class that implements all of the
    ``KVCache`` protocol (``model/kv.py``), and every ``*Cache`` class taken from transformers."""
    proto = next(n for n in ast.walk(ast.parse(PROTOCOL.read_text())) if getattr(n, "name", "") == "KVCache")
    needed = {f.name for f in proto.body if isinstance(f, ast.FunctionDef)}
    found = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name != "KVCache":
                if needed <= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}:
                    found.add(node.name)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
                found |= {a.name for a in node.names if a.name.endswith("Cache")}
    return found


class Makers:
    """What makes a KV cache: the cache classes, and every function or method that returns one
    it made or got from another maker (found to a fixed point, so a wrapper of a maker is one)."""

    def __init__(self, trees: dict[str, ast.Module], classes: set[str]):
        self.classes, self.functions, self.methods = set(classes), set(), set()
        self.where: set[str] = set()  # the makers' qualnames
        changed = True
        while changed:
            changed = False
            for tree in trees.values():
                modules = _module_names(tree)
                for qual, method, fn in _functions(tree):
                    if qual not in self.where and self.returns_a_cache(fn, modules):
                        self.where.add(qual)
                        (self.methods if method else self.functions).add(fn.name)
                        changed = True

    def made(self, node: ast.AST, modules: set[str]) -> str | None:
        """The class or maker ``node`` calls, if it is a call that makes a cache."""
        if not isinstance(node, ast.Call):
            return None
        f = node.func
        if isinstance(f, ast.Name):
            return f.id if f.id in self.classes | self.functions else None
        if isinstance(f, ast.Attribute):
            if f.attr in self.classes:
                return f.attr
            on_module = isinstance(f.value, ast.Name) and f.value.id in modules
            if f.attr in (self.functions if on_module else self.methods):
                return f.attr
        return None

    def returns_a_cache(self, fn: ast.AST, modules: set[str]) -> bool:
        bound: set[str] = set()
        for node in sorted(_body(fn), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
            if isinstance(node, ast.Assign) and any(self.made(n, modules) for n in ast.walk(node.value)):
                bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            if isinstance(node, ast.Return) and node.value is not None:
                parts = list(ast.walk(node.value))
                if any(self.made(n, modules) for n in parts) or any(
                    isinstance(n, ast.Name) and n.id in bound for n in parts
                ):
                    return True
        return False


def _constructions(path: str, tree: ast.Module, makers: Makers):
    """(file, function qualname, what it calls) for every call that makes a KV cache."""
    modules = _module_names(tree)
    out = set()
    for name, node in _scoped(tree):
        if made := makers.made(node, modules):
            out.add((path, name, made))
    return out


# what holds a cache by its name (``seq.cache``, a pool's ``kv``, HF's ``past_key_values``)
CACHE_NAMES = {"cache", "_cache", "caches", "kv", "hf_cache", "past_key_values"}


def _copies(path: str, tree: ast.Module, makers: Makers):
    """(file, function qualname, line, copies a cache) for every copy in ``tree``: ``copy.copy``,
    ``copy.deepcopy`` (however imported) and ``.clone()`` / ``.copy()``. What is copied holds a
    cache if it is a maker's call, a name bound from one in the function, a parameter annotated
    with a cache kind, ``self`` in a cache class, or an expression through a cache's name."""
    modules = _module_names(tree)
    copy_fns = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "copy"
        for a in n.names
        if a.name in ("copy", "deepcopy")
    }
    kinds = makers.classes | {"KVCache"}
    out = []
    for qual, _, fn in [("", False, tree), *_functions(tree)]:  # the module's own code too
        cls = qual.rsplit(".", 2)[-2] if "." in qual else ""
        held = {"self"} if cls in makers.classes else set()
        params = fn.args.args + fn.args.kwonlyargs if hasattr(fn, "args") else []
        held |= {a.arg for a in params if a.annotation is not None and _names(a.annotation) & kinds}
        for node in sorted(_body(fn), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
            if isinstance(node, ast.Assign) and any(makers.made(n, modules) for n in ast.walk(node.value)):
                held |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            if not isinstance(node, ast.Call):
                continue
            f, what = node.func, None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "copy":
                what = node.args[0] if f.attr in ("copy", "deepcopy") and node.args else None
            elif isinstance(f, ast.Name) and f.id in copy_fns:
                what = node.args[0] if node.args else None
            elif isinstance(f, ast.Attribute) and f.attr in ("clone", "copy"):
                what = f.value
            if what is not None:
                out.append((path, qual, node.lineno, _holds(what, held, makers, modules)))
    return out


def _names(expr: ast.AST) -> set[str]:
    return {
        n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(expr) if isinstance(n, (ast.Name, ast.Attribute))
    }


def _holds(expr: ast.AST, held: set[str], makers: Makers, modules: set[str]) -> bool:
    if any(makers.made(n, modules) for n in ast.walk(expr)):
        return True
    names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(expr) if isinstance(n, ast.Attribute)}
    return bool(names & (held | CACHE_NAMES) or attrs & CACHE_NAMES)


@pytest.fixture(scope="module")
def source():
    trees = _trees()
    return trees, Makers(trees, cache_classes(trees))


def test_the_cache_kinds_and_their_makers_are_read_from_the_source(source):
    """Every KV cache kind and every function that hands one out, found in the source: a new kind
    or a new maker fails here until it is named (and its callers are held below)."""
    trees, makers = source
    assert makers.classes == {"SeqKV", "HFKV", "PagedKV", "DynamicCache"}
    assert makers.where == {
        "BlockPool.open",
        "RemoteBlockPool.open",
        "Target.hf_cache",
        "Target.new_cache",
        "probe_cache",
    }


def test_nothing_outside_the_pool_makes_a_kv_cache(source):
    """A sequence's KV is a block table the pool opens (``BlockPool.open``, the only maker of a
    ``PagedKV``; a tensor-parallel rank replays the replica's tables through it, and the replica's
    pool tells the ranks of each table it opens); a cache of a sequence's own (``Target.new_cache``,
    over HF's ``Target.hf_cache`` for the families the batched forward does not cover) is made only
    where there is no pool -- admission without one (``Scheduler._place``) and the cost probe of a
    target without one. A prompt prefilled into a cache of its own anywhere else fails here."""
    trees, makers = source
    found = set()
    for path, tree in trees.items():
        found |= _constructions(path, tree, makers)
    assert sorted(found) == [
        ("deployments/tp/target.py", "RemoteBlockPool.open", "open"),
        ("deployments/tp/worker.py", "apply_ops", "open"),
        ("toolspec_core/engine/cost_probe.py", "probe_cache", "new_cache"),
        ("toolspec_core/engine/cost_probe.py", "probe_cache", "open"),
        ("toolspec_core/engine/cost_probe.py", "probe_steps", "probe_cache"),
        ("toolspec_core/engine/scheduler.py", "Scheduler._place", "new_cache"),
        ("toolspec_core/engine/scheduler.py", "Scheduler._place", "open"),
        ("toolspec_core/model/block_pool.py", "BlockPool.open", "PagedKV"),
        ("toolspec_core/model/target.py", "Target.hf_cache", "DynamicCache"),
        ("toolspec_core/model/target.py", "Target.new_cache", "HFKV"),
        ("toolspec_core/model/target.py", "Target.new_cache", "SeqKV"),
        ("toolspec_core/model/target.py", "Target.new_cache", "hf_cache"),
    ]


def test_no_kv_cache_is_copied(source):
    """A cache is never copied (``copy.copy``, ``copy.deepcopy``, ``.clone()``, ``.copy()``): a
    copy would be a second owner of the same rows, outside the pool's count. The copies the source
    does make (a chat message, a call tracker) are seen and are not of a cache."""
    trees, makers = source
    copies = [c for path, tree in trees.items() for c in _copies(path, tree, makers)]
    assert len(copies) >= 2  # the reader sees copies
    assert [c for c in copies if c[3]] == []


def test_the_cache_checks_see_a_new_maker_and_a_copy(tmp_path, source):
    """A module written here: a class whose method returns a ``SeqKV`` it made (a new maker,
    through a local name), its caller, and three copies of a cache -- ``copy.deepcopy`` of what the
    maker returned, an aliased ``deepcopy`` of ``seq.cache``, a ``.clone()`` of a cache's rows --
    beside a ``copy.copy`` of a list, which is no cache's."""
    _, real = source
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "m.py").write_text(
        "import copy\n"
        "from copy import deepcopy as dc\n"
        "from toolspec_core.model.kv import SeqKV\n"
        "class Store:\n"
        "    def fresh(self):\n"
        "        kv = SeqKV(2)\n"
        "        return kv\n"
        "def use(store, seq, rows):\n"
        "    c = store.fresh()\n"
        "    a = copy.deepcopy(c)\n"
        "    b = dc(seq.cache)\n"
        "    d = seq.cache.layers[0].keys.clone()\n"
        "    e = copy.copy(rows)\n"
        "    return a, b, d, e\n"
    )
    trees = _trees(tmp_path, ("fake",))
    makers = Makers(trees, real.classes)
    assert makers.where == {"Store.fresh"} and makers.methods == {"fresh"}
    tree = trees["fake/m.py"]
    assert _constructions("fake/m.py", tree, makers) == {
        ("fake/m.py", "Store.fresh", "SeqKV"),
        ("fake/m.py", "use", "fresh"),
    }
    copies = _copies("fake/m.py", tree, makers)
    assert [(line, bad) for _, _, line, bad in copies] == [(10, True), (11, True), (12, True), (13, False)]
