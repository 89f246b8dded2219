"""The schema candidates' expansion graph (``candidates.Graph``) and its compiled walk
(``kernels/cand_walk.c``): the compiled walk is the Python walk bit for bit, on random graphs
(every instruction kind and level op, cuts under both floors and the levels, ties, empty
segments, shared slots, nodes built as the walk reaches them) and at every character of real
gold calls; a graph kept across an output's positions gives what a fresh one gives, and builds
again exactly the nodes that read what changed."""

from __future__ import annotations

import random

import pytest

from benchmarks.data import gold_requests
from toolspec_core.drafters import tree_kernel
from toolspec_core.drafters.toolcall import candidates as cd
from toolspec_core.drafters.toolcall.candidates import Graph, Priors, _Ref, continuations
from toolspec_core.drafters.toolcall.compiled import compile_tools
from toolspec_core.drafters.toolcall.fsm import CallTracker, ToolIndex
from toolspec_core.spec.layouts import layout_by_name, render_calls

kernel = tree_kernel.load_walk()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler / Python headers here")

SEGS = [(), (("", "v"),), (("a", "k"),), (("b", "v"), ("", "v")), ((("x",), "end"),), (("c", "k"), ("d", "v"))]


def _random_graph(rng: random.Random, n_nodes: int) -> tuple[Graph, list]:
    """A graph of ``n_nodes`` nodes (children always later nodes: acyclic), built on demand, and a
    root; probabilities from a few values (ties) and random ones, some zero."""
    g = Graph()
    probs = [1.0, 0.5, 0.25, 0.0, 1 / 3]

    def prob():
        return rng.choice(probs) if rng.random() < 0.4 else rng.random()

    class Builder:
        def instrs(self, i: int) -> list:  # a node's instructions (``Graph.build`` flattens them)
            out, slot = [], None
            for _ in range(rng.randrange(0, 6)):
                later = rng.randrange(i + 1, n_nodes) if i + 1 < n_nodes else None
                kinds = [cd.SEQ_LEAF, cd.LEAF, cd.CAND, cd.GUARD]
                kinds += [cd.SEQ, cd.SHARED, cd.MUL, cd.DIV, cd.INLINE] if later is not None else []
                kinds += [cd.SEQ_SHARED] * 2 if slot is not None else []
                kind = rng.choice(kinds)
                segs = rng.choice(SEGS)
                ref = _Ref(later if later is not None else -1, rng.choice([cd.SAME, cd.DOWN, cd.DOWN_IF, cd.ZERO]))
                if kind == cd.SHARED:
                    g.slots += 1
                    slot = g.slots
                    out.append(cd._instr(cd.SHARED, prob(), child=ref, slot=slot))
                elif kind == cd.SEQ_SHARED:
                    out.append(cd._instr(cd.SEQ_SHARED, prob(), segs, slot=slot))
                elif kind == cd.DIV:
                    out.append(cd._instr(cd.DIV, float(rng.randrange(1, 4)), child=ref))
                elif kind == cd.INLINE:
                    out.append(cd._instr(cd.INLINE, child=_Ref(later, cd.SAME)))
                else:
                    out.append(cd._instr(kind, prob(), segs, child=ref))
            return out

    g.builder, g.style = Builder(), ()
    for i in range(n_nodes):
        g.node("instrs", (i,))
    return g, cd.flat(g.builder.instrs(-1))


def _walk_both(g_args, keep, min_prob, max_cands, levels):
    seed, n = g_args
    g1, root1 = _random_graph(random.Random(seed), n)
    g2, root2 = _random_graph(random.Random(seed), n)
    py = [(c.prob, c.segs) for c in cd.walk(g1, root1, keep, min_prob, max_cands, levels)]
    c = kernel.walk(root2, g2.nodes, g2.build, keep, min_prob, max_cands, levels)
    built = [i for i, x in enumerate(g2.nodes) if x is not None]
    return py, c, built, [i for i, x in enumerate(g1.nodes) if x is not None]


@needs_kernel
@pytest.mark.parametrize("keep", [0, 1, 3, 8])
@pytest.mark.parametrize("min_prob", [0.0, 0.05, 0.3])
def test_the_compiled_walk_is_the_python_walk_on_random_graphs(keep, min_prob):
    nonempty = 0
    for seed in range(300):
        py, c, built_c, built_py = _walk_both((seed, 1 + seed % 12), keep, min_prob, 5 + seed % 7, seed % 4)
        assert c == py, seed
        assert built_c == built_py, seed  # the same nodes reached, so the same ones built
        nonempty += bool(py)
    assert nonempty > 100


def _gold_positions(n_per: int):
    """Every character of real gold calls (both layouts): (a new output's first position?, the
    tracker there, tools, request extras with this output's finished calls as ``own`` -- a new
    list whenever it changes, as the drafter's -- and the compiled tables, the text so far)."""
    for it, idx, extra in gold_requests(n_per):
        past = extra["past"]
        tables = compile_tools(it["tools"], None)
        for layout in ("hermes", "fence"):
            text = render_calls(it["gold_calls"], layout_by_name(layout))
            t, own = CallTracker(idx), []
            for k in range(len(text) + 1):
                if k:
                    t.feed(text[k - 1])
                if len(t.calls) != len(own):
                    own = past[: len(t.calls)]
                yield k == 0, t, idx, dict(extra, own=own, tables=tables), text[:k]


@needs_kernel
def test_kept_graphs_walked_compiled_give_a_fresh_python_expansions_candidates():
    """At every character of gold calls: the drafter's way (graphs kept across the output's
    positions, the compiled walk) and a fresh graph walked in Python agree candidate for candidate
    (segments, probability, order) at the cuts and floors the drafter uses."""
    checked = 0
    for first, t, idx, extra, text in _gold_positions(3):
        if first:
            graph, pri = Graph(), Priors()
        for keep, floor in ((64, 0.0), (64, 0.02), (8, 0.0)):
            kw = dict(max_cands=keep, min_prob=floor, **extra)
            kept = continuations(t, idx, pri, [7], graph=graph, **kw)
            fresh = continuations(t, idx, pri, [7], compiled=False, **kw)
            assert [(c.segs, c.prob) for c in kept] == [(c.segs, c.prob) for c in fresh], text
            checked += 1
    assert checked > 3000


def test_a_node_is_built_again_when_what_it_read_changes():
    """Tool frequencies are read when a node is built: after ``observe`` moves them (and the
    version), a kept graph must not serve the old weights -- and only the nodes that read the
    priors are built again."""
    tools = [{"name": n, "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}} for n in "ab"]
    idx = ToolIndex.from_tools(tools)
    t = CallTracker(idx)
    t.feed('<tool_call>\n{"name"')  # the names are a node of the graph, not the step's own instructions
    pri, graph = Priors(), Graph()

    def names():
        return {c.segs[1][0]: c.prob for c in continuations(t, idx, pri, [0], levels=0, graph=graph)}

    assert names() == pytest.approx({'a"': 0.5, 'b"': 0.5})
    continuations(t, idx, pri, [0], levels=3, graph=graph)  # the calls' structure below the names
    built = {i for i, n in enumerate(graph.nodes) if n is not None}
    pri.tool_counts["a"] = 2.0
    pri.version += 1
    graph.sync(cd.style(t, pri, ()))
    dropped = {graph.thunks[i][0] for i in built if graph.nodes[i] is None}
    kept = {graph.thunks[i][0] for i in built if graph.nodes[i] is not None}
    assert dropped == {"tool_names"}
    assert {"args_open", "arg_names", "value_start", "_typed_start"} <= kept
    assert names() == pytest.approx({'a"': 0.75, 'b"': 0.25})


def test_a_kept_graph_follows_the_priors_and_this_outputs_calls_along_gold_calls():
    """Along gold calls with the priors moving every few characters (as other requests finish)
    and this output's calls growing: a kept graph walked compiled == a fresh graph in Python."""
    rng = random.Random(7)
    checked = 0
    for first, t, idx, extra, text in _gold_positions(2):
        if first:
            graph, pri = Graph(), Priors()
        if rng.random() < 0.2:
            name = rng.choice(idx.names) if idx.names else "x"
            pri.tool_counts[name] = pri.tool_counts.get(name, 0.0) + 1.0
            pri.events.count("prose_after", rng.random() < 0.5)
            pri.version += 1
        kw = dict(max_cands=64, min_prob=0.01, **extra)
        kept = continuations(t, idx, pri, [7], graph=graph, compiled=kernel is not None, **kw)
        fresh = continuations(t, idx, pri, [7], compiled=False, **kw)
        assert [(c.segs, c.prob) for c in kept] == [(c.segs, c.prob) for c in fresh], text
        checked += 1
    assert checked > 1000
