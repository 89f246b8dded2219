"""Host work beside the forward (``Scheduler(overlap=...)``): outputs and statistics as without it,
and the work really runs while the forward does (event order from a target whose forward blocks)."""

from __future__ import annotations

import random
import threading

import pytest
from scripted import ScriptedDrafter, branching, garbage, oracle
from scripted import tiny as tiny
from tiny import hf_greedy

from toolspec_core.engine import scheduler as sched_mod
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig
from toolspec_core.engine.scheduler import BatchLimits, Scheduler, forward_overlaps_host
from toolspec_core.engine.sequence import Sequence

N = 16
WAIT_S = 10.0  # the longest a gated forward waits for the side work (a failure, never a pass, if reached)


@pytest.fixture(scope="module")
def refs(tiny):
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 96) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    return prompts, [hf_greedy(tiny, p, N) for p in prompts]


class Gated:
    """The tiny target, whose forward notes its start and end in ``log``; at the steps ``waits``
    names it blocks until side work has been noted (:meth:`note`, bounded by WAIT_S)."""

    forward_elsewhere = True  # what the scheduler's default overlap reads

    def __init__(self, inner, log: list, waits, overlap: bool):
        self.inner, self.log, self.waits, self.overlap = inner, log, waits, overlap
        self.started, self.noted = threading.Event(), threading.Event()
        self.steps, self.saw = 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def note(self, what: str) -> None:
        """Side work noting itself; with overlap it first waits for a forward to start (it would
        time out, and the order checks fail, if it ran before one or after the run)."""
        if self.overlap:
            assert self.started.wait(WAIT_S)
        self.log.append(what)
        self.noted.set()

    def begin(self) -> None:
        self.steps += 1
        self.log.append("forward start")
        self.started.set()

    def end(self) -> None:
        if self.waits(self.steps):
            self.saw.append(self.noted.wait(WAIT_S))
        self.log.append("forward end")
        self.started.clear()
        self.noted.clear()

    def step(self, req, pool=None):
        self.begin()
        self.end()
        return self.inner.step(req, pool)


class GatedLaunch(Gated):
    """The gated target launching its steps (the replay's way): a forward starts at ``launch``
    and ends in its ``result()``; the side work runs on the scheduler's thread between them."""

    def launch(self, req, pool=None):
        self.begin()
        return Pending(self, self.inner.step(req, pool))


class Pending:
    done_at = None  # the forward's end: when result() returned

    def __init__(self, gated: Gated, out):
        self.gated, self.out = gated, out

    def result(self):
        self.gated.end()
        return self.out


class Preparing(ScriptedDrafter):
    """A scripted drafter whose prompt-side work (``prepare``) notes itself on the gated target."""

    prepares = True

    def __init__(self, fn, gated: Gated):
        super().__init__(fn)
        self.gated = gated

    def prepare(self, prompt_ids):
        self.gated.note("prepare")


def _run(target, prompts, want, overlap: bool, pooled: bool, cancel_at: int | None = None):
    pool = target.block_pool(4096, 8) if pooled else None
    sched = Scheduler(target, CostModel.flat(), BatchLimits(max_running=3, prefill_chunk=9), pool, overlap=overlap)
    seqs = []
    for i, (p, w) in enumerate(zip(prompts, want)):
        make = (oracle, garbage, branching, None)[i % 4]
        d = ScriptedDrafter(make(w)) if make else None
        seqs.append(sched.add(Sequence(target, p, d, DecodeConfig(max_new_tokens=N - (i % 3)))))
    step = 0
    while sched.has_work():
        sched.step()
        step += 1
        if step == cancel_at:
            sched.cancel(seqs[1])  # a garbage drafter's: one token a step, mid-decode here
    return seqs


@pytest.mark.parametrize("pooled", [False, True])
def test_outputs_and_statistics_are_the_same_with_overlap_on_and_off(tiny, refs, pooled):
    """Every output equals plain greedy, and every sequence's statistics (forwards, accepted and
    drafted per step) are those without overlap -- also for a sequence cancelled mid-decode, whose
    last step's statistics were still waiting for the next step's side work."""
    prompts, want = refs
    on = _run(tiny, prompts, want, True, pooled, cancel_at=8)
    off = _run(tiny, prompts, want, False, pooled, cancel_at=8)
    for a, b, w in zip(on, off, want):
        assert a.result.tokens == b.result.tokens == w[: len(a.result.tokens)]
        assert a.result.finish_reason == b.result.finish_reason
        sa, sb = a.result.stats, b.result.stats
        assert (sa.forwards, sa.accepted, sa.drafted, sa.step_labels) == (
            sb.forwards,
            sb.accepted,
            sb.drafted,
            sb.step_labels,
        )
        assert sa.forwards == len(sa.accepted) > 0
    assert on[1].result.finish_reason == "cancelled" and 0 < len(on[1].result.tokens) < N - 1
    assert [s.result.finish_reason for i, s in enumerate(on) if i != 1] == ["length"] * (len(on) - 1)


@pytest.mark.parametrize("launches", [False, True])
def test_overlapped_work_runs_while_the_forward_does(tiny, refs, monkeypatch, launches):
    """With overlap, the drafter's prompt-side work and the last step's statistics run after the
    forward started and before it ended: the gated forward waits for them and they wait for it to
    start (either would time out otherwise); without overlap they run before the forward starts.
    A target that launches its steps gets the work between launch and result, one that does not
    on the worker thread while its ``step`` runs."""
    prompts, want = refs
    for overlap in (True, False):
        log: list[str] = []
        real = sched_mod.record_step
        # one sequence, its prompt in one chunk: step 1 prefills (side work: prepare), step 2 is the
        # first decode (nothing left from a decode step), steps 3.. count the step before them; the
        # last step's statistics are counted at once (the sequence finishes in it)
        gated = (GatedLaunch if launches else Gated)(tiny, log, lambda k, overlap=overlap: overlap and k != 2, overlap)
        mine: list[Sequence] = []

        def noted(stats, tree, result, gated=gated, real=real, mine=mine):
            if mine[0].reason is None:  # beside the next forward (with overlap)
                gated.note("stats")
            else:  # the finishing step's, at once
                gated.log.append("stats")
            real(stats, tree, result)

        monkeypatch.setattr(sched_mod, "record_step", noted)
        seq = Sequence(gated, prompts[0], Preparing(oracle(want[0]), gated), DecodeConfig(max_new_tokens=N))
        mine.append(seq)
        sched = Scheduler(gated, None, BatchLimits(max_running=1), overlap=overlap if not overlap else None)
        assert sched.overlap is overlap  # None: the target's forward_elsewhere
        sched.add(seq)
        sched.run()
        assert seq.result.tokens == want[0]
        steps = seq.result.stats.forwards
        assert steps >= 3
        spans = _spans(log)  # per forward: the side work noted during it, and just before it
        if overlap:
            assert gated.saw and all(gated.saw)
            assert spans[0] == ([], ["prepare"])
            assert spans[1] == ([], [])
            for k in range(2, len(spans)):
                before, during = spans[k]
                assert before == [] and during.count("stats") >= 1, (k, spans)
        else:
            assert spans[0] == (["prepare"], [])
            assert all(during == [] for _, during in spans)
        assert log.count("stats") == steps
        monkeypatch.undo()


def _spans(log: list[str]) -> list[tuple[list[str], list[str]]]:
    """(notes before a forward started, notes between its start and end) for each forward."""
    out, before, during, inside = [], [], [], False
    for x in log:
        if x == "forward start":
            inside = True
        elif x == "forward end":
            out.append((before, during))
            before, during, inside = [], [], False
        elif inside:
            during.append(x)
        else:
            before.append(x)
    return out


def test_overlap_defaults_to_what_the_target_says(tiny):
    """A torch target on the CPU: off (its forward uses every core; a worker thread would only add
    a hand-over each step); a target that says where its forward runs (an accelerator's, the
    replay's step model, or one that says no): as it says; one that says nothing: off; an explicit
    choice wins."""
    assert tiny.forward_elsewhere is False
    assert forward_overlaps_host(tiny) is False
    assert Scheduler(tiny).overlap is False
    assert Scheduler(tiny, overlap=True).overlap is True
    assert forward_overlaps_host(object()) is False

    class Elsewhere:
        forward_elsewhere = True

    class Here:
        forward_elsewhere = False

    assert forward_overlaps_host(Elsewhere()) is True
    assert forward_overlaps_host(Here()) is False
    assert Scheduler(Elsewhere(), overlap=None).overlap is True
