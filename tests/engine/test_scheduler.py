"""The step scheduler on tiny random Qwen2 models: any batch leaves every sequence's output what it is alone."""

from __future__ import annotations

import random

import pytest
from scripted import PROMPT, N, ScriptedDrafter, branching, garbage, oracle
from scripted import reference as reference
from scripted import tiny as tiny
from tiny import hf_greedy

from toolspec_core.engine import scheduler as sched_mod
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, generate
from toolspec_core.engine.sampling import SamplingParams
from toolspec_core.engine.scheduler import BatchLimits, Scheduler, run_batch
from toolspec_core.engine.sequence import Sequence
from toolspec_core.model import device_walk as device_walk_mod
from toolspec_core.model.device_walk import accept_rows
from toolspec_core.model.step_runner import StepRunner
from toolspec_core.spec.tree import DraftTree

MAKERS = {"none": None, "oracle": oracle, "garbage": garbage, "branching": branching}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 96) for _ in range(rng.randint(2, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def refs(tiny):
    prompts = _prompts(10, 0)
    return prompts, [hf_greedy(tiny, p, N) for p in prompts]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_in_any_batch_equals_plain_greedy(tiny, refs, seed):
    """Random arrival steps, batch limits, prefill chunks, budgets, drafters and lengths."""
    prompts, want = refs
    rng = random.Random(seed)
    cost = rng.choice([None, CostModel.flat(), CostModel.cpu_reference()])
    limits = BatchLimits(max_running=rng.choice([1, 2, 3, 5, 16]), prefill_chunk=rng.choice([3, 8, 512]))
    sched = Scheduler(tiny, cost, limits, device_walk=seed % 2 == 0)  # the device walk, on the CPU too
    order = list(range(len(prompts)))
    rng.shuffle(order)
    seqs, arrivals = {}, {i: rng.randrange(0, 12) for i in order}
    step = 0
    while len(seqs) < len(order) or sched.has_work():
        for i in order:
            if i not in seqs and arrivals[i] <= step:
                make = MAKERS[rng.choice(list(MAKERS))]
                drafter = ScriptedDrafter(make(want[i])) if make else None
                n = rng.choice([N, N, 7, 1])
                seqs[i] = sched.add(Sequence(tiny, prompts[i], drafter, DecodeConfig(max_new_tokens=n)))
        sched.step()
        assert len(sched.running) <= limits.max_running
        step += 1
    for i, seq in seqs.items():
        n = seq.cfg.max_new_tokens
        assert seq.result.tokens == want[i][:n], (seed, i)
        assert seq.result.finish_reason == "length"
    assert all(r.prefill_rows <= limits.prefill_chunk for r in sched.steps)
    assert all(r.rows == r.prefill_rows + r.root_rows + r.draft_rows for r in sched.steps)
    if limits.max_running > 1:
        assert max(r.sequences for r in sched.steps) > 1  # sequences really were verified together


def test_decode_is_a_batch_of_one(tiny, reference):
    seq = Sequence(tiny, PROMPT, ScriptedDrafter(branching(reference)), DecodeConfig(max_new_tokens=N))
    batch = run_batch(tiny, [seq])[0]
    alone = generate(tiny, PROMPT, ScriptedDrafter(branching(reference)), DecodeConfig(max_new_tokens=N))
    assert batch.tokens == alone.tokens == reference
    assert batch.stats.forwards == alone.stats.forwards and batch.stats.accepted == alone.stats.accepted


def test_long_prompt_prefills_a_chunk_per_step_while_others_decode(tiny, refs, reference):
    prompts, _ = refs
    long_prompt = (prompts[0] * 20)[:300]
    long_ref = hf_greedy(tiny, long_prompt, 4)
    sched = Scheduler(tiny, None, BatchLimits(max_running=4, prefill_chunk=16))
    short = sched.add(Sequence(tiny, PROMPT, None, DecodeConfig(max_new_tokens=N)))
    sched.step()  # the short prompt (< one chunk) is prefilled and emits its first token
    assert len(short.generated) == 1
    long = sched.add(Sequence(tiny, long_prompt, None, DecodeConfig(max_new_tokens=4)))
    while long.prefilling:
        before = len(short.generated)
        sched.step()
        assert sched.steps[-1].prefill_rows <= 16
        assert len(short.generated) == before + 1  # the running sequence never waits for the whole prompt
    sched.run()
    assert short.result.tokens == reference and long.result.tokens == long_ref


def test_admission_limits(tiny, refs):
    prompts, want = refs
    cfg = DecodeConfig(max_new_tokens=6)
    reserve = [len(p) + 6 for p in prompts[:6]]
    limit = max(reserve[0] + reserve[1], max(reserve))
    sched = Scheduler(tiny, None, BatchLimits(max_running=3, max_kv_tokens=limit))
    seqs = [sched.add(Sequence(tiny, p, None, cfg)) for p in prompts[:6]]
    while sched.has_work():
        sched.step()
        assert len(sched.running) <= 3
        assert sum(s.reserved_tokens for s in sched.running) <= limit or len(sched.running) == 1
    assert [s.result.tokens for s in seqs] == [w[:6] for w in want[:6]]


def test_cancelling_one_sequence_leaves_the_others_unchanged(tiny, refs):
    prompts, want = refs
    sched = Scheduler(tiny, CostModel.flat(), BatchLimits(max_running=4))
    seqs = [
        sched.add(Sequence(tiny, p, ScriptedDrafter(make(w)), DecodeConfig(max_new_tokens=N)))
        for p, w, make in zip(prompts[:3], want[:3], (oracle, garbage, branching))
    ]
    stop_after = {"n": 0}

    def on_tokens(ids):
        stop_after["n"] += len(ids)
        return stop_after["n"] < 5  # the client goes away after 5 tokens

    streamed = sched.add(Sequence(tiny, prompts[3], None, DecodeConfig(max_new_tokens=N), on_tokens=on_tokens))
    for _ in range(3):
        sched.step()
    sched.cancel(seqs[1])
    sched.run()
    assert seqs[1].result.finish_reason == "cancelled" and seqs[1].result.tokens == want[1][: len(seqs[1].generated)]
    assert streamed.result.finish_reason == "cancelled" and streamed.result.tokens == want[3][:5]
    for i in (0, 2):
        assert seqs[i].result.tokens == want[i] and seqs[i].result.finish_reason == "length"


def test_cancelled_while_waiting_never_runs(tiny, refs):
    prompts, _ = refs
    sched = Scheduler(tiny, None, BatchLimits(max_running=1))
    a = sched.add(Sequence(tiny, prompts[0], None, DecodeConfig(max_new_tokens=3)))
    b = sched.add(Sequence(tiny, prompts[1], None, DecodeConfig(max_new_tokens=3)))
    sched.cancel(b)
    done = sched.step()
    assert b in done and b.result.finish_reason == "cancelled" and b.result.tokens == []
    sched.run()
    assert a.result.finish_reason == "length"


def test_sampled_sequence_in_a_batch_is_reproducible_and_leaves_greedy_alone(tiny, refs):
    """A sampled sequence depends only on its own seed and trees, whatever runs beside it (a flat
    cost keeps every tree whole, alone and in the batch)."""
    prompts, want = refs
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    cfg = DecodeConfig(max_new_tokens=N, sampling=params)
    alone = generate(tiny, prompts[0], ScriptedDrafter(garbage(want[0])), cfg, CostModel.flat()).tokens
    mixed = [
        Sequence(tiny, prompts[0], ScriptedDrafter(garbage(want[0])), DecodeConfig(max_new_tokens=N, sampling=params)),
        Sequence(tiny, prompts[1], ScriptedDrafter(oracle(want[1])), DecodeConfig(max_new_tokens=N)),
        Sequence(tiny, prompts[2], None, DecodeConfig(max_new_tokens=N)),
    ]
    out = run_batch(tiny, mixed, CostModel.flat())
    assert out[0].tokens == alone
    assert out[1].tokens == want[1] and out[2].tokens == want[2]


def test_device_and_host_walks_share_a_step(tiny, refs, monkeypatch):
    """Greedy sequences walked on the device beside one that reads its logits (logprobs: a host
    walk on the argmax of the step's one copy back) and a sampled one: each greedy output is
    plain greedy's, and the reading one's logprobs are of its own tokens."""
    prompts, want = refs
    sampled = DecodeConfig(max_new_tokens=N, sampling=SamplingParams(temperature=0.9, seed=3))
    seqs = [
        Sequence(tiny, prompts[0], ScriptedDrafter(branching(want[0])), DecodeConfig(max_new_tokens=N)),
        Sequence(tiny, prompts[1], ScriptedDrafter(branching(want[1])), DecodeConfig(max_new_tokens=N, logprobs=2)),
        Sequence(tiny, prompts[2], ScriptedDrafter(oracle(want[2])), DecodeConfig(max_new_tokens=N)),
        Sequence(tiny, prompts[3], ScriptedDrafter(garbage(want[3])), sampled),
    ]
    walked = []  # trees per device walk

    def counting(choice, inputs, need):
        walked.append(0 if inputs is None else inputs.shape[0])
        return accept_rows(choice, inputs, need)

    monkeypatch.setattr(device_walk_mod, "accept_rows", counting)
    sched = Scheduler(tiny, CostModel.flat(), BatchLimits(max_running=4), device_walk=True)
    for seq in seqs:
        sched.add(seq)
    sched.run()
    out = [s.result for s in seqs]
    assert [o.tokens for o in out[:3]] == want[:3]
    assert [lp[0] for lp in out[1].logprobs] == want[1]
    assert max(walked) == 2  # the two greedy sequences that read only the argmax, walked together


def test_batched_forward_steps_have_many_rows(tiny, refs, monkeypatch):
    """One forward per step carries every running sequence's rows (not one forward per sequence)."""
    prompts, want = refs
    calls = []
    forward = StepRunner.hidden

    def counting(runner, segments):
        calls.append(len(segments))
        return forward(runner, segments)

    monkeypatch.setattr(StepRunner, "hidden", counting)
    seqs = [
        Sequence(tiny, p, ScriptedDrafter(oracle(w)), DecodeConfig(max_new_tokens=8))
        for p, w in zip(prompts[:5], want[:5])
    ]
    run_batch(tiny, seqs, CostModel.flat())
    assert max(calls) == len(seqs)
    assert [s.result.tokens for s in seqs] == [w[:8] for w in want[: len(seqs)]]


def test_batch_wide_budget_shrinks_trees_as_the_batch_grows(tiny, refs):
    """On a curve where rows get dear past 8, eight sequences draft less each than one does."""
    curve = CostModel({1: 1.0, 4: 1.05, 8: 1.1, 16: 3.0, 64: 12.0}, max_nodes=15)
    prompts, want = refs
    sizes = {}
    for b in (1, 8):
        seqs = [
            Sequence(tiny, prompts[i % len(prompts)], ScriptedDrafter(oracle(want[i % len(prompts)])), DecodeConfig(N))
            for i in range(b)
        ]
        sched = Scheduler(tiny, curve, BatchLimits(max_running=b))
        for s in seqs:
            sched.add(s)
        sched.run()
        decode_steps = [r for r in sched.steps if r.prefill_rows == 0]
        sizes[b] = max(r.rows for r in decode_steps) / b
        assert [s.result.tokens for s in seqs] == [want[i % len(prompts)] for i in range(b)]
    assert sizes[1] > sizes[8] >= 1.0


def _wide(ref):
    """A tree of 6 x 6 nodes a step, all wrong: the sequence decodes one token a step, drafting on."""

    def fn(ctx):
        tree = DraftTree()
        for b in range(6):
            tree.add_path([(7 + b) % 96, 11, 12, 13, 14, 15], 0.9, f"wrong{b}")
        return tree

    return fn


@pytest.mark.parametrize("cost", ["none", "flat", "cpu"])
@pytest.mark.parametrize("pooled", [False, True])
def test_waiting_prompt_gets_its_first_chunk_whatever_the_draft_rows(tiny, refs, cost, pooled):
    """Sequences decoding with wide trees never delay a new prompt: the step that admits it
    carries its first chunk at the chunk's full size, and every output is plain greedy's."""
    prompts, want = refs
    model = {"none": None, "flat": CostModel.flat(), "cpu": CostModel.cpu_reference()}[cost]
    chunk = 16
    limits = BatchLimits(max_running=6, prefill_chunk=chunk, tree_rows=48)
    pool = tiny.block_pool(2048, 8) if pooled else None
    sched = Scheduler(tiny, model, limits, pool)
    decoding = [
        sched.add(Sequence(tiny, prompts[i], ScriptedDrafter(_wide(want[i])), DecodeConfig(max_new_tokens=N)))
        for i in range(4)
    ]
    while any(s.prefilling for s in decoding):  # waiting ones too: nothing filled before admission
        sched.step()
    late = [(prompts[5 + k] * 20)[: 40 + 7 * k] for k in range(3)]  # no prompt begins another: no cache hit
    seqs = []
    for prompt in late:  # each arrives while the others draft; one at a time, so no prompt waits on another
        seq = sched.add(Sequence(tiny, prompt, None, DecodeConfig(max_new_tokens=4)))
        sched.step()
        assert seq in sched.running and seq.filled == chunk  # admitted with its first chunk, whole
        step = sched.steps[-1]
        assert step.prefill_rows == chunk and step.sequences >= 4  # beside the four decoding sequences
        if model is None:
            assert step.draft_rows == 4 * 36  # their trees as drafted, in the same forward
        seqs.append(seq)
        while seq.prefilling:
            sched.step()
            assert sched.steps[-1].prefill_rows > 0  # and a chunk every step until its prompt is in
    sched.run()
    assert [s.result.tokens for s in decoding] == [want[i] for i in range(4)]
    assert [s.result.tokens for s in seqs] == [hf_greedy(tiny, p, 4) for p in late]


@pytest.mark.parametrize("pooled", [False, True])
def test_decoding_sequences_keep_their_trees_while_a_prompt_prefills(tiny, pooled):
    """Running sequences first: on a curve flat to 32 rows and dear past them, a step that carries
    a 16-row prompt chunk keeps the trees a decode-only step keeps (priced against the chunk, half
    of them would be cut), so the decoding sequences go on advancing several tokens a step while
    the prompt prefills; its first chunk is still whole, and every output is plain greedy's."""
    prompts = _prompts(5, 3)
    want = [hf_greedy(tiny, p, 64) for p in prompts[:4]]
    curve = CostModel({1: 1.0, 32: 1.0, 33: 1.2, 128: 20.0}, max_nodes=15)
    chunk = 16
    pool = tiny.block_pool(2048, 8) if pooled else None
    sched = Scheduler(tiny, curve, BatchLimits(max_running=5, prefill_chunk=chunk, tree_rows=16), pool)
    decoding = [
        sched.add(Sequence(tiny, prompts[i], ScriptedDrafter(oracle(want[i])), DecodeConfig(max_new_tokens=64)))
        for i in range(4)
    ]
    while any(s.prefilling for s in decoding):
        sched.step()
    sched.step()
    alone = sched.steps[-1]
    assert alone.prefill_rows == 0 and alone.draft_rows == 4 * 6  # decode-only: every oracle node pays
    late = (prompts[4] * 20)[:64]
    seq = sched.add(Sequence(tiny, late, None, DecodeConfig(max_new_tokens=4)))
    before = [len(s.generated) for s in decoding]
    steps = 0
    while seq.prefilling:
        sched.step()
        steps += 1
        step = sched.steps[-1]
        assert step.prefill_rows == chunk and step.draft_rows == alone.draft_rows  # the chunk on top of the trees
    advanced = [len(s.generated) - b for s, b in zip(decoding, before)]
    assert steps == 4 and all(a >= 4 * steps for a in advanced)  # several tokens a prompt step, not one
    sched.run()
    assert [s.result.tokens for s in decoding] == want
    assert seq.result.tokens == hf_greedy(tiny, late, 4)


def test_a_sequence_records_where_its_first_token_waited(tiny, refs):
    """Load studies read a request's wait from its stats: wall-clock marks in order (queued,
    admitted, first chunk, first token) and what each of its first steps carried."""
    prompts, want = refs
    sched = Scheduler(tiny, CostModel.cpu_reference(), BatchLimits(max_running=1, prefill_chunk=8))
    drafter = ScriptedDrafter(oracle(want[0]))
    first = sched.add(Sequence(tiny, prompts[0], drafter, DecodeConfig(max_new_tokens=N), early_steps=True))
    second = sched.add(Sequence(tiny, (prompts[1] * 4)[:20], None, DecodeConfig(max_new_tokens=2), early_steps=True))
    plain = sched.add(Sequence(tiny, prompts[1], None, DecodeConfig(max_new_tokens=2)))
    sched.run()
    assert plain.stats.early_steps is None and plain.stats.times["first_token"]  # not asked: no steps kept
    for seq in (first, second):
        t = seq.stats.times
        assert t["queued"] <= t["admitted"] <= t["prefill_start"] <= t["first_token"]
        pre = [s for s in seq.stats.early_steps if s["kind"] == "prefill"]
        assert sum(s["own_rows"] for s in pre) == len(seq.prompt_ids) and pre[-1]["generated"] == 1
        assert all(s["rows"] >= s["own_rows"] and s["forward_s"] > 0 for s in seq.stats.early_steps)
    assert second.stats.times["admitted"] >= first.stats.times["first_token"]  # it queued behind max_running 1
    assert [s["prefill_rows"] for s in second.stats.early_steps[:3]] == [8, 8, 4]
    assert first.result.tokens == want[0]


def test_budget_alone_sizes_a_lone_sequences_tree(tiny, refs):
    """No fixed per-tree cap below the budget: on a flat curve a sequence alone keeps every node
    its drafter offers, more than the curve's ``max_nodes``; eight sequences on a curve that gets
    dear are cut by the budget."""
    prompts, want = refs

    def long_chain(ref):
        def fn(ctx):
            done = len(ctx.generated)
            tree = DraftTree()
            tree.add_path(ref[done : done + 4], 0.99, "true")
            for b in range(4):
                tree.add_path([(7 + b) % 96, 11, 12, 13, 14], 0.98, f"wrong{b}")
            return tree

        return fn

    seq = Sequence(tiny, prompts[0], ScriptedDrafter(long_chain(want[0])), DecodeConfig(max_new_tokens=N))
    sched = Scheduler(tiny, CostModel.flat(max_nodes=7), BatchLimits(max_running=1))
    sched.add(seq)
    sched.run()
    assert max(r.draft_rows for r in sched.steps) > 7
    assert seq.result.tokens == want[0]


def test_drafters_see_the_budgets_floor_from_the_last_step(tiny, refs):
    """``DraftContext.min_prob``: FLOOR_SHARE of the path probability of the best node the last
    step's budget left out (0.0 on the first step, and with no budget); output unchanged."""
    prompts, want = refs
    for cost in (CostModel({1: 1.0, 4: 1.4, 8: 2.5, 16: 6.0}, max_nodes=15), None):
        floors, cuts = [], []

        def guesses(ctx, chain=oracle(want[0], 0.7)):  # path probabilities fall along the chain
            floors.append(ctx.min_prob)
            return chain(ctx)

        seq = Sequence(tiny, prompts[0], ScriptedDrafter(guesses), DecodeConfig(max_new_tokens=N))
        sched = Scheduler(tiny, cost, BatchLimits(max_running=1))
        if cost is not None:
            allocate = cost.allocate
            cost.allocate = lambda trees, rows: cuts.append(allocate(trees, rows)) or cuts[-1]
        sched.add(seq)
        sched.run()
        assert seq.result.tokens == want[0] and len(floors) > 2
        if cost is None:
            assert set(floors) == {0.0}
            continue
        assert floors == [0.0] + [sched_mod.FLOOR_SHARE * c.left_out for c in cuts[: len(floors) - 1]]
        assert any(f > 0 for f in floors)


def test_the_floor_holds_only_while_the_batch_keeps_its_size(tiny, refs):
    """A cut depends on how many sequences share the step: after one finishes (or one joins) the
    next step drafts with no floor, then the new size's cut gives one again."""
    prompts, want = refs
    cost = CostModel({1: 1.0, 4: 1.4, 8: 2.5, 16: 6.0}, max_nodes=15)
    steps, cuts = [], []
    seqs = [
        Sequence(tiny, prompts[i], ScriptedDrafter(oracle(want[i], 0.7)), DecodeConfig(max_new_tokens=n))
        for i, n in enumerate((N, N // 2, N))
    ]
    sched = Scheduler(tiny, cost, BatchLimits(max_running=3))
    allocate, propose = cost.allocate, sched._propose_all
    cost.allocate = lambda trees, rows: cuts.append((len(trees), allocate(trees, rows))) or cuts[-1][1]
    sched._propose_all = lambda ss: (ss and steps.append((len(ss), sched._floor))) or propose(ss)
    for s in seqs:
        sched.add(s)
    sched.run()
    assert [s.result.tokens for s in seqs] == [want[0], want[1][: N // 2], want[2]]
    assert len(steps) == len(cuts) and len({n for n, _ in cuts}) > 1
    for (n, floor), (n_last, cut) in zip(steps[1:], cuts):
        assert floor == (sched_mod.FLOOR_SHARE * cut.left_out if n == n_last else 0.0)
    assert any(floor == 0.0 and n != n_last and cut.left_out > 0 for (n, floor), (n_last, cut) in zip(steps[1:], cuts))


# ---------------------------------------------------------------------- with a KV block pool


@pytest.mark.parametrize("seed", range(3))
def test_pooled_greedy_in_any_batch_equals_plain_greedy(tiny, refs, seed):
    """Prompts that share prefixes run from one small pool: cached blocks are reused, a full pool
    makes sequences wait, blocks are evicted, and every output stays plain greedy's."""
    prompts, _ = refs
    rng = random.Random(100 + seed)
    base = [rng.randrange(1, 96) for _ in range(24)]  # a shared "system prompt" of three blocks
    family = [base + p[: rng.randint(1, 12)] for p in prompts[:6]] + [p for p in prompts[6:]]
    want = [hf_greedy(tiny, p, 10) for p in family]
    pool = tiny.block_pool(rng.choice([160, 256]), 8)
    limits = BatchLimits(max_running=rng.choice([2, 4, 16]), prefill_chunk=rng.choice([8, 512]), tree_rows=16)
    sched = Scheduler(tiny, rng.choice([None, CostModel.flat()]), limits, pool, device_walk=True)
    moved_at, move_slots = [], pool.move_slots  # the step each slot move came in

    def counting(src, dst):
        moved_at.append(len(sched.steps))
        move_slots(src, dst)

    pool.move_slots = counting
    order = list(range(len(family))) * 2  # every prompt twice: the second time its blocks are cached
    seqs = []
    for i in order:
        drafter = ScriptedDrafter(rng.choice([oracle, garbage, branching])(want[i]))
        seqs.append((i, sched.add(Sequence(tiny, family[i], drafter, DecodeConfig(max_new_tokens=10)))))
        if rng.random() < 0.5:
            sched.step()
    while sched.has_work():
        sched.step()
        used = sum(1 for r in pool.refs if r > 0)
        assert used <= pool.num_blocks
    for i, seq in seqs:
        assert seq.result.tokens == want[i], (seed, i)
    assert pool.stats().hit_tokens > 0
    assert any(s.stats.cached_tokens > 0 for _, s in seqs)
    assert all(r == 0 for r in pool.refs)  # every block given back
    assert moved_at and len(moved_at) == len(set(moved_at))  # the commits of a step: one slot move


def test_second_turn_prefills_only_its_new_tokens(tiny, refs, monkeypatch):
    """An agent's next turn repeats the previous prompt and output: their full blocks are cached."""
    prompts, _ = refs
    pool = tiny.block_pool(512, 8)
    sched = Scheduler(tiny, None, BatchLimits(max_running=4), pool)
    turn1 = (prompts[0] * 3)[:45]
    first = sched.add(Sequence(tiny, turn1, None, DecodeConfig(max_new_tokens=12)))
    sched.run()
    assert first.stats.cached_tokens == 0
    turn2 = turn1 + first.result.tokens + [7, 8, 9, 10, 11]
    rows = []
    forward = StepRunner.hidden

    def counting(runner, segments):
        rows.append(sum(len(s) for s in segments))
        return forward(runner, segments)

    monkeypatch.setattr(StepRunner, "hidden", counting)
    second = sched.add(Sequence(tiny, turn2, None, DecodeConfig(max_new_tokens=6)))
    sched.run()
    committed = len(turn1) + len(first.result.tokens) - 1  # the last output token's KV was never written
    assert second.stats.cached_tokens == committed // 8 * 8 > 0
    assert rows[0] == len(turn2) - second.stats.cached_tokens  # the prefill forward had only the new rows
    assert second.result.tokens == hf_greedy(tiny, turn2, 6)


def test_full_pool_makes_requests_wait_then_serves_them(tiny, refs):
    prompts, want = refs
    pool = tiny.block_pool(96, 8)  # 12 blocks; each sequence here needs 3-8
    limits = BatchLimits(max_running=8, tree_rows=8)
    sched = Scheduler(tiny, None, limits, pool)
    seqs = [
        sched.add(Sequence(tiny, p, ScriptedDrafter(oracle(w)), DecodeConfig(max_new_tokens=N)))
        for p, w in zip(prompts, want)
    ]
    waited = False
    while sched.has_work():
        sched.step()
        waited |= bool(sched.waiting) and len(sched.running) < limits.max_running
    assert waited
    assert [s.result.tokens for s in seqs] == want


def test_pool_refuses_a_sequence_it_can_never_hold(tiny):
    """The job's limits (toolspec_core.engine.limits) refuse it with a 400's error; a sequence
    made past them is a bug the scheduler asserts, never queued to wait forever."""
    from toolspec_core.engine.limits import target_limits, token_budget
    from toolspec_core.errors import ContextLengthError

    sched = Scheduler(tiny, None, BatchLimits(tree_rows=8), tiny.block_pool(64, 8))
    with pytest.raises(ContextLengthError, match="KV pool of 64 tokens"):
        token_budget(49, 16, target_limits(tiny, sched))
    assert token_budget(40, 16, target_limits(tiny, sched)) == 16
    with pytest.raises(ValueError, match="can never be held") as err:
        sched.add(Sequence(tiny, list(range(1, 50)), None, DecodeConfig(max_new_tokens=16)))
    assert not isinstance(err.value, ContextLengthError)
    assert not sched.has_work()


def test_run_raises_when_nothing_running_can_free_the_blocks_a_waiting_sequence_needs(tiny):
    """Blocks pinned outside the scheduler (a harness's cached prompt) with nothing running: the
    waiting sequence can never be admitted, and ``run`` says so rather than step forever."""
    pool = tiny.block_pool(64, 8)
    pinned = pool.allocate(4)
    sched = Scheduler(tiny, None, BatchLimits(tree_rows=8), pool)
    sched.add(Sequence(tiny, list(range(1, 30)), None, DecodeConfig(max_new_tokens=8)))
    with pytest.raises(RuntimeError, match="cannot free"):
        sched.run()
    pool.release(pinned)
    sched.run()
    assert not sched.has_work()


def test_cancel_and_failure_give_every_block_back(tiny, refs):
    prompts, _ = refs
    pool = tiny.block_pool(512, 8)
    sched = Scheduler(tiny, None, BatchLimits(max_running=4), pool)
    a = sched.add(Sequence(tiny, prompts[0], None, DecodeConfig(max_new_tokens=N)))
    b = sched.add(Sequence(tiny, prompts[1], None, DecodeConfig(max_new_tokens=N)))
    sched.step()
    sched.step()
    assert sum(1 for r in pool.refs if r) > 0
    sched.cancel(a)
    sched.step()
    assert a.result.finish_reason == "cancelled" and a.cache is None
    c = sched.add(Sequence(tiny, prompts[2], None, DecodeConfig(max_new_tokens=N)))
    sched.step()
    failed = sched.fail_all(RuntimeError("boom"))
    assert {s.id for s in failed} == {b.id, c.id}
    assert all(r == 0 for r in pool.refs)
    # a failed sequence keeps only its prompt blocks findable (registered when its prefill
    # completed); the rows it decoded are not registered
    b_tokens = prompts[1] + b.result.tokens + [0] * 16
    found, _ = pool.match(b_tokens, len(b_tokens))
    pool.release(found)
    assert len(b.result.tokens) >= 2 and len(found) == len(prompts[1]) // 8
