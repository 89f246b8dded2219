"""Drafting on recorded traffic (the replay target over the committed plain-greedy recording):
the fast drafter's trees are the reference drafter's node for node, and batched drafting, the
work done beside the forward, prefill chunks, shared prefix blocks and grammar rows leave every
output plain greedy's."""

from __future__ import annotations

import pytest

from benchmarks.replay import RECORDING, replay_target
from toolspec_core.drafters import tree_kernel
from toolspec_core.drafters.methods import RequestInfo, make_method
from toolspec_core.engine import scheduler as sched_mod
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, prefill
from toolspec_core.engine.scheduler import BatchLimits, Scheduler
from toolspec_core.engine.sequence import Sequence
from toolspec_core.spec.proposer import DrafterBase

pytestmark = pytest.mark.skipif(not RECORDING.exists(), reason="no recording")
N = 48  # tokens decoded an item: enough for a call's name, keys and first values


@pytest.fixture(scope="module")
def replay():
    return replay_target()


@pytest.fixture(scope="module")
def items(replay):
    from benchmarks.data import load_items
    from benchmarks.datasets import dev_set

    recs = {(r["benchmark"], r["id"]): r for r in replay.records}
    out = []
    for bench in ("api_bank", "toolalpaca", "bfcl_v3"):
        its = [it for it in load_items(dev_set(bench)) if (bench, it["id"]) in recs][:4]
        out += [(it, recs[(bench, it["id"])]) for it in its]
    return out


class Twin:
    """The fast drafter and the reference one on the same contexts: every tree compared."""

    def __init__(self, fast, ref, seen: list):
        self.fast, self.ref, self.seen = fast, ref, seen

    def propose(self, ctx):
        a, b = self.fast.propose(ctx), self.ref.propose(ctx)
        self.seen.append((a.tokens, a.parents, a.labels, a.conf) == (b.tokens, b.parents, b.labels, b.conf))
        return a

    def feedback(self, tree, result):
        self.fast.feedback(tree, result)
        self.ref.feedback(tree, result)


def _req(replay, it, rec):
    pre = prefill(replay, rec["prompt_ids"])  # the prompt's last state: the retrieval key
    return pre, RequestInfo(prompt_ids=rec["prompt_ids"], tools=it.get("tools") or [], embedding=pre.hidden)


def _decode_groups(replay, groups, methods, drafter_of) -> None:
    """Each group decoded together (B = its size) with ``drafter_of(request)``'s drafters: every
    output the recording's, then observed by each of ``methods`` (the next group retrieves it)."""
    for group in groups:
        sched = Scheduler(replay, CostModel.cpu_reference(), BatchLimits(max_running=len(group)))
        seqs = []
        for it, rec in group:
            pre, req = _req(replay, it, rec)
            seq = Sequence(replay, rec["prompt_ids"], drafter_of(req), DecodeConfig(max_new_tokens=N))
            seqs.append((seq, req, rec))
            sched.add(seq)
        sched.run()
        for seq, req, rec in seqs:
            assert seq.result.tokens == rec["tokens"][:N]
            for m in methods:
                m.observe(req, seq.result.tokens, seq.result.text)


def test_fast_drafter_trees_equal_the_reference_on_recorded_traffic(replay, items):
    """B = 6 through the batched scheduler, three groups (the second drafts from the library the first
    filled, the third sends the first's tool sets again: compiled tables and token tables from the
    cache): every step's tree, node for node (tokens, parents, labels, confidences) -- the default
    drafter (bounded expansion, compiled tool sets, compiled merge where built) against the reference."""
    fast, ref = make_method("toolspec", replay.tokenizer), make_method("toolspec", replay.tokenizer, reference=True)
    seen: list[bool] = []

    def twin(req):
        r = ref.drafter(req)
        r.suffix.context.lazy = False  # the eager subtrie build
        return Twin(fast.drafter(req), r, seen)

    _decode_groups(replay, (items[:6], items[6:], items[:6]), (fast, ref), twin)
    assert len(seen) > 50 and all(seen)
    assert fast.tool_sets.hits >= 6 and fast.tool_sets.stats()["entries"] > 0
    assert ref.tool_sets.stats()["entries"] == 0  # the reference compiles nothing


class BatchTwin(DrafterBase):
    """The fast drafters of a step drafted together (``SchemaDrafter.propose_batch``: the suffix
    walks of all in one compiled call), each tree compared with its reference drafter's, alone.
    Records instead of asserting: the proposer drafts a batch that raises again one by one."""

    prepares = True

    def __init__(self, fast, ref, seen: list, batches: list):
        self.fast, self.ref, self.seen, self.batches = fast, ref, seen, batches

    def prepare(self, prompt_ids):
        self.fast.prepare(prompt_ids)
        self.ref.prepare(prompt_ids)

    def propose(self, ctx):
        return Twin.propose(self, ctx)

    @classmethod
    def propose_batch(cls, drafters, ctxs):
        trees = type(drafters[0].fast).propose_batch([d.fast for d in drafters], ctxs)
        drafters[0].batches.append(trees is not None and len(trees))
        for d, ctx, a in zip(drafters, ctxs, trees or []):
            b = d.ref.propose(ctx)
            d.seen.append((a.tokens, a.parents, a.labels, a.conf) == (b.tokens, b.parents, b.labels, b.conf))
        return trees

    def feedback(self, tree, result):
        Twin.feedback(self, tree, result)


@pytest.mark.skipif(tree_kernel.load_suffix() is None, reason="no compiled suffix walk: each drafter drafts alone")
def test_batched_fast_drafter_trees_equal_the_reference_on_recorded_traffic(replay, items):
    """B = 6, two groups: every step drafts the batch's fast drafters in one ``propose_batch``
    (one compiled suffix walk for all of them) and each tree equals the reference drafter's,
    drafted alone with the Python walk, node for node."""
    fast, ref = make_method("toolspec", replay.tokenizer), make_method("toolspec", replay.tokenizer, reference=True)
    seen: list[bool] = []
    batches: list = []
    twin = lambda req: BatchTwin(fast.drafter(req), ref.drafter(req), seen, batches)  # noqa: E731
    _decode_groups(replay, (items[:6], items[6:]), (fast, ref), twin)
    assert len(seen) > 50 and all(seen)
    assert batches and all(batches) and max(batches) == 6  # every step drafted as one batch


def _serve(replay, items, overlap: bool, monkeypatch, grammar_on=()):
    """The server's way: prompts prefilled by the scheduler in chunks into a block pool with prefix
    caching (the chat template's shared start), at most 4 running, the rest waiting."""
    from toolspec_core.engine.grammar import make_tool_constraint

    if not overlap:
        monkeypatch.setattr(sched_mod.Scheduler, "_side_job", lambda self: None)  # drafters prepare at their first step
    method = make_method("toolspec", replay.tokenizer)
    pool = replay.block_pool(16 * 1024, 16)
    sched = Scheduler(
        replay, CostModel.cpu_reference(), BatchLimits(max_running=4, prefill_chunk=300), pool, overlap=overlap
    )
    seqs = []
    for k, (it, rec) in enumerate(items):
        req = RequestInfo(prompt_ids=rec["prompt_ids"], tools=it.get("tools") or [])
        grammar = make_tool_constraint(replay.tokenizer, req.tools, "required") if k in grammar_on else None
        drafter = method.drafter(req)
        seqs.append(sched.add(Sequence(replay, rec["prompt_ids"], drafter, DecodeConfig(max_new_tokens=N), grammar)))
    while sched.has_work():
        sched.step()
    return [s.result.tokens for s in seqs], [s.result.stats.forwards for s in seqs], pool.stats().hit_tokens


def test_overlap_and_batched_drafting_keep_outputs_plain_greedy(replay, items, monkeypatch):
    """Drafters prepared beside the forward (waiting and prefilling sequences) draft the same as
    drafters that do it all at their first step: outputs and step counts identical, and equal to
    plain greedy (the recording); a grammar row's output equals plain greedy under its grammar."""
    with_overlap, steps_a, hits = _serve(replay, items, True, monkeypatch)
    assert hits > 0  # shared prefix blocks were reused
    for (it, rec), out in zip(items, with_overlap):
        assert out == rec["tokens"][:N]
    monkeypatch.undo()
    without, steps_b, _ = _serve(replay, items, False, monkeypatch)
    assert without == with_overlap and steps_a == steps_b


def test_grammar_rows_in_a_drafted_batch_equal_plain_greedy_under_the_grammar(replay, items, monkeypatch):
    from toolspec_core.engine.grammar import make_tool_constraint

    pytest.importorskip("llguidance")
    out, _, _ = _serve(replay, items[:6], True, monkeypatch, grammar_on=(1, 4))
    for k in (1, 4):
        it, rec = items[k]
        g = make_tool_constraint(replay.tokenizer, it.get("tools") or [], "required")
        seq = Sequence(replay, rec["prompt_ids"], None, DecodeConfig(max_new_tokens=N), g)
        s = Scheduler(replay, None, BatchLimits(max_running=1))
        s.add(seq)
        s.run()
        assert out[k] == seq.result.tokens


def test_the_proposer_drafts_a_class_together_and_isolates_a_failing_drafter():
    """One ``propose_batch`` call for a class's drafters; a batch that raises is drafted again one by
    one, and only the drafter that raises gets its exception."""
    from toolspec_core.spec.proposer import DraftContext, DrafterBase, Proposer
    from toolspec_core.spec.tree import DraftTree

    calls = []

    class Batched(DrafterBase):
        def __init__(self, tok, bad=False):
            self.tok, self.bad = tok, bad

        @classmethod
        def propose_batch(cls, drafters, ctxs):
            calls.append(len(drafters))
            if any(d.bad for d in drafters):
                raise RuntimeError("one of them")
            return [d.propose(c) for d, c in zip(drafters, ctxs)]

        def propose(self, ctx):
            if self.bad:
                raise ValueError("bad drafter")
            t = DraftTree()
            t.add_path([self.tok], 0.9, "x")
            return t

    ctx = DraftContext([1, 2], 1, 8)
    good = [Batched(5), Batched(6)]
    out = Proposer.propose(good, [ctx, ctx])
    assert calls == [2] and [t.tokens for t in out] == [[5], [6]]
    out = Proposer.propose([Batched(5), Batched(0, bad=True), Batched(7)], [ctx] * 3)
    assert [t.tokens for t in (out[0], out[2])] == [[5], [7]] and isinstance(out[1], ValueError)


def test_a_drafter_that_raises_is_dropped_and_its_sequence_stays_plain_greedy():
    from scripted import PROMPT, ScriptedDrafter, oracle
    from tiny import hf_greedy, tiny_target

    from toolspec_core.spec.proposer import NoDrafter

    tiny = tiny_target()
    want = hf_greedy(tiny, PROMPT, 12)

    def boom(ctx):
        raise RuntimeError("drafter bug")

    sched = Scheduler(tiny, None, BatchLimits(max_running=3))
    seqs = [
        sched.add(Sequence(tiny, PROMPT, ScriptedDrafter(d), DecodeConfig(max_new_tokens=12)))
        for d in (oracle(want), boom, oracle(want))
    ]
    sched.run()
    assert [s.result.tokens for s in seqs] == [want] * 3
    assert isinstance(seqs[1].drafter, NoDrafter) and not isinstance(seqs[0].drafter, NoDrafter)
