"""The replay target answers as the model it recorded: same outputs, same acceptance, any batch."""

from __future__ import annotations

import random

import pytest
from scripted import ScriptedDrafter, branching, garbage, oracle
from tiny import tiny_target

from benchmarks.replay import RECORDING, greedy_rows, load_recording, replay_over
from toolspec_core.drafters.prompt_lookup import PromptLookupDrafter
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, prefill
from toolspec_core.engine.scheduler import BatchLimits, Scheduler
from toolspec_core.engine.sequence import Sequence

N = 16


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


@pytest.fixture(scope="module")
def recorded(tiny):
    rng = random.Random(3)
    base = [rng.randrange(1, 96) for _ in range(16)]  # a shared start, as a system prompt is
    prompts = [base + [rng.randrange(1, 96) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    return greedy_rows(tiny, prompts, N)


def _drafter(kind, want):
    if kind == "pld":
        return PromptLookupDrafter()
    return ScriptedDrafter({"oracle": oracle, "garbage": garbage, "branching": branching}[kind](want))


def _decode(target, rows, kinds, pooled: bool, chunk: int, prefilled: bool):
    pool = target.block_pool(2048, 8) if pooled else None
    if prefilled:  # each prompt run through the pool first: the sequences start from its cached blocks
        for r in rows:
            prefill(target, r["prompt_ids"], pool)
    sched = Scheduler(target, CostModel.flat(), BatchLimits(max_running=4, prefill_chunk=chunk, tree_rows=16), pool)
    seqs = []
    for r, kind in zip(rows, kinds):
        drafter = _drafter(kind, r["tokens"])
        seqs.append(sched.add(Sequence(target, r["prompt_ids"], drafter, DecodeConfig(max_new_tokens=N))))
    sched.run()
    if prefilled:
        assert all(s.stats.cached_tokens >= 8 for s in seqs)  # read back from the blocks the prefill left
    return seqs


@pytest.mark.parametrize(
    "pooled,chunk,prefilled", [(False, 512, False), (True, 512, True), (True, 7, False), (True, 512, False)]
)
def test_replay_gives_the_recorded_model_s_outputs_and_acceptance(tiny, recorded, pooled, chunk, prefilled):
    """Decoding through the replay gives the real model's tokens and, with drafters that branch and
    miss, the real model's accepted lengths at every step (prompts in caches of their own,
    prefilled into the pool first and found in its prefix cache, or in chunks by the scheduler in
    a block pool with shared prefix blocks)."""
    replay = replay_over(tiny, recorded)
    rng = random.Random(5)
    kinds = [rng.choice(["oracle", "garbage", "branching", "pld"]) for _ in recorded]
    real = _decode(tiny, recorded, kinds, pooled, chunk, prefilled)
    fake = _decode(replay, recorded, kinds, pooled, chunk, prefilled)
    for r, a, b in zip(recorded, real, fake):
        assert b.result.tokens == r["tokens"] == a.result.tokens
        if isinstance(a.drafter, ScriptedDrafter):
            assert b.drafter.accepted == a.drafter.accepted
        assert b.result.stats.forwards == a.result.stats.forwards


def test_rows_off_the_recording_get_a_token_no_draft_holds(tiny, recorded):
    """A draft that leaves the recording is never accepted: the answer there matches none of its children."""
    replay = replay_over(tiny, recorded[:1])
    r = recorded[0]
    off = [replay.off[0], replay.off[1], 5]

    def wrong(ctx):  # the first draft token is wrong; its children are both "off" tokens
        from toolspec_core.spec.tree import DraftTree

        t = DraftTree()
        done = len(ctx.generated)
        nxt = r["tokens"][done] if done < len(r["tokens"]) else 0
        first = t.add_path([(nxt + 1) % 96], 0.9, "x")
        t.add_path(off[:1], 0.9, "x", parent=first)
        t.add_path(off[1:2], 0.9, "x", parent=first)
        return t

    seq = Sequence(replay, r["prompt_ids"], ScriptedDrafter(wrong), DecodeConfig(max_new_tokens=N))
    sched = Scheduler(replay, None, BatchLimits(max_running=1))
    sched.add(seq)
    sched.run()
    assert seq.result.tokens == r["tokens"]
    assert set(seq.drafter.accepted) == {0}


@pytest.mark.skipif(not RECORDING.exists(), reason="no recording")
def test_committed_recording_replays_through_the_batch_bench(tmp_path):
    """The committed recording: plain greedy and ToolSpec through ``bench --batch --target replay``
    (B = 4, a block pool) give each recorded item's recorded output."""
    from benchmarks.batch import BatchRun
    from benchmarks.cli import parse

    rows = {(r["benchmark"], r["id"]): r["tokens"] for r in load_recording(RECORDING)}
    args = parse(
        ["--batch", "4", "--same-batch-reference", "--target", "replay", "--methods", "ar,toolspec", "--limit", "4"]
        + ["--max-new-tokens", "64", "--cost", "reference", "--out", str(tmp_path)]
        + ["--data", str(RECORDING.parent / "toolalpaca.dev.jsonl.gz")]
    )
    run = BatchRun(args)
    run.run()
    recs = list(run.store.records.values())
    assert {r["method"] for r in recs} == {"ar", "toolspec"}
    for rec in recs:
        for item, out in rec["outputs"].items():
            assert out["tokens"] == rows[(rec["benchmark"], item)][:64]
