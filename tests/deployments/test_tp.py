"""Tensor parallelism: the step protocol (replica-side block tables, rank-side KV and weights) gives
the single-process engine's output; the sharded loader reads exactly a rank's slices; DeepSpeed
AutoTP over 2 Ray actors (gloo, CPU) in a placement group equals the single process; workers that
cannot be placed fail within the timeout, naming what they need."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.util
import time

import numpy as np
import pytest
import torch
from serve_fixtures import TOOLS

from toolspec_core.engine.sampling import SamplingParams
from toolspec_core.engine.scheduler import BatchLimits, Scheduler, run_batch
from toolspec_core.engine.sequence import DecodeConfig, Sequence
from toolspec_core.spec.tree import DraftTree

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed (pip install -e '.[tp]')"
)


class OracleDrafter:
    """Drafts a wrong branch first, then the reference continuation (sometimes corrupted after one
    token): accepted rows are not a prefix of the tree, so commits move KV slots on the ranks."""

    def __init__(self, ref: list[int]):
        self.ref = ref

    def propose(self, ctx) -> DraftTree:
        n = len(ctx.generated)
        tree = DraftTree()
        tree.add_path([(x + 7) % 90 for x in self.ref[n : n + 2]], 0.5, "junk")
        good = self.ref[n : n + 3]
        if n % 3 == 1 and len(good) > 1:
            good = good[:1] + [(good[1] + 3) % 90]
        tree.add_path(good[: ctx.max_depth], 0.9, "oracle")
        return tree

    def feedback(self, tree, result) -> None:
        return None


def local_tp(ref, attention: str = "per_sequence"):
    """A one-rank TPTarget whose rank is an in-process TPWorker over a copy of ``ref``'s model with
    a vocabulary-parallel head (the whole vocabulary): the protocol and the step channel without
    Ray or DeepSpeed. ``attention``: the rank's (its step runner's) attention path."""
    from deployments.tp.shards import VocabParallelHead
    from deployments.tp.target import in_process_tp

    model = copy.deepcopy(ref.model)
    vocab, hidden = model.lm_head.weight.shape
    head = VocabParallelHead(0, vocab, hidden, torch.float32).to_empty(device="cpu")
    head.weight.data.copy_(model.lm_head.weight.data)
    model.lm_head = head
    return in_process_tp(dataclasses.replace(ref, model=model), attention)


def _batch(target, prompts, cfgs, drafters):
    pool = target.block_pool(4096, 16, True)
    seqs = [Sequence(target, p, d, c) for p, c, d in zip(prompts, cfgs, drafters)]
    return run_batch(target, seqs, None, BatchLimits(max_running=4, tree_rows=16), pool)


@pytest.mark.parametrize("attention", ["per_sequence", "ragged"])
def test_step_protocol_equals_single_process(attention):
    """Greedy with KV moves, sampling, logprobs, shared prompt prefixes: the TP step (block tables
    replayed on the rank, the greedy walks there, only the asked-for rows back) changes nothing,
    whichever attention the rank's step runner runs."""
    from tiny import tiny_target

    ref = tiny_target(vocab=90)
    tp = local_tp(ref, attention)
    shared = [5, 9, 2, 44, 17, 3, 8, 60, 12, 7, 1, 33, 20, 4, 6, 2, 9, 11]  # > one 16-token block
    prompts = [shared + [i, i + 1] for i in range(3)] + [[3, 1, 4, 1, 5]]
    n = 20
    plain = _batch(ref, prompts, [DecodeConfig(max_new_tokens=n)] * 4, [None] * 4)
    cfgs = [
        DecodeConfig(max_new_tokens=n),
        DecodeConfig(max_new_tokens=n, logprobs=2),
        DecodeConfig(max_new_tokens=n, sampling=SamplingParams(temperature=0.8, seed=3)),
        DecodeConfig(max_new_tokens=n),
    ]
    for _ in range(2):  # the second round starts from the first round's cached prefix blocks
        want = _batch(ref, prompts, cfgs, [OracleDrafter(r.tokens) for r in plain])
        got = _batch(tp, prompts, cfgs, [OracleDrafter(r.tokens) for r in plain])
        for a, b in zip(want, got):
            assert a.tokens == b.tokens
        assert [r.tokens for r in want[:2]] == [r.tokens for r in plain[:2]]
        assert sum(got[0].stats.accepted) > 0
        if attention == "per_sequence":  # the reference's own attention: the same floats
            assert want[1].logprobs and want[1].logprobs == got[1].logprobs
        else:  # one padded call a layer: the same tokens, logprobs to float rounding
            assert [t for t, _, _ in want[1].logprobs] == [t for t, _, _ in got[1].logprobs]
            assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(want[1].logprobs, got[1].logprobs))
    w = tp.group.workers[0]
    assert w.steps == tp.group.transport.steps and tp.group.transport.ray_calls == 0  # the channel, no calls
    assert w.runner.steps[attention] > 0 and sum(w.runner.steps.values()) == w.runner.steps[attention]
    assert len(w.views) <= 4  # finished sequences are freed on the rank at the next step
    tp.group.shutdown()


def _planned(target, **kw) -> tuple[list, list]:
    """The step plans the scheduler hands ``target`` over a batch of four (greedy with trees,
    logprobs, sampling, a shared prompt prefix) on its own pool, and the outputs."""
    plans = []
    real = target.step

    def step(plan, pool=None):
        plans.append(plan)
        return real(plan, pool)

    target.step = step
    try:
        pool = target.block_pool(4096, 16, True)
        prompts = [[5, 9, 2, 44, 17, 3, 8, 60, 12, 7, 1, 33, 20, 4, 6, 2, 9, i] for i in range(3)] + [[3, 1, 4, 1, 5]]
        cfgs = [
            DecodeConfig(max_new_tokens=8),
            DecodeConfig(max_new_tokens=8, logprobs=2),
            DecodeConfig(max_new_tokens=8, sampling=SamplingParams(temperature=0.8, seed=3)),
            DecodeConfig(max_new_tokens=8),
        ]
        seqs = [Sequence(target, p, OracleDrafter(list(range(1, 40))), c) for p, c in zip(prompts, cfgs)]
        sched = Scheduler(target, None, BatchLimits(max_running=4, prefill_chunk=24, tree_rows=16), pool, **kw)
        for s in seqs:
            sched.add(s)
        sched.run()
    finally:
        del target.step
    return plans, [s.result.tokens for s in seqs]


def test_step_channel_carries_plans_and_large_answers():
    """The scheduler's plans and a step's KV operations through the shared-memory slot come out as
    they went in -- every field of every sequence, the index views, the walks, each segment over
    the rank's view of its table; a message larger than the slot goes through a one-off segment."""
    from tiny import tiny_target

    from deployments.tp.channel import Bell, Mailbox, channel_dir, remove_dir
    from deployments.tp.codec import KVOps, decode_ops, decode_plan, encode_step, plan_arrays

    plans, _ = _planned(tiny_target(vocab=90), device_walk=True)
    assert any(p.walk is not None for p in plans) and any(p.logits.full for p in plans)
    assert any(s.segment.tree for p in plans for s in p.seqs) and any(p.hidden_rows for p in plans)
    ops = KVOps([(4, [9, 2, 7], 1), (5, [3], 0)], [1, 2], (np.array([10, 11]), np.array([20, 21])))
    d = channel_dir()
    box, reader = Mailbox(size=4096), None
    bell = Bell(Bell.make(d, "r0"))
    try:
        reader = Mailbox(box.name)
        for plan in plans:
            box.send(encode_step(plan, ops, 12.5))
            bell.ring()
            assert bell.wait(1.0) and not bell.wait(0.01)
            arrays = reader.receive()
            got_ops, sent = decode_ops(arrays)
            assert got_ops.tables == ops.tables and got_ops.frees == ops.frees and sent == 12.5
            assert got_ops.moves[1].tolist() == [20, 21]
            views = {s.sid: object() for s in plan.seqs}
            got = decode_plan(arrays, views)
            assert all(np.array_equal(a, b) for a, b in zip(plan_arrays(got), plan_arrays(plan)))
            assert got.logits == plan.logits and got.hidden_rows == plan.hidden_rows and got.argmax == plan.argmax
            assert [s.segment.cache for s in got.seqs] == [views[s.sid] for s in plan.seqs]
            assert [s.segment.parents for s in got.seqs] == [s.segment.parents for s in plan.seqs]
            assert [dataclasses.replace(s, segment=None) for s in got.seqs] == [
                dataclasses.replace(s, segment=None) for s in plan.seqs
            ]
        big = [np.arange(5000, dtype=np.float32).reshape(50, 100)]  # past the 4 KiB slot
        box.send(big)
        assert np.array_equal(reader.receive()[0], big[0])
        box.send([np.zeros(2, dtype=np.int64)])  # drops the one-off segment
        assert reader.receive()[0].tolist() == [0, 0]
    finally:
        reader.close()
        box.close()
        bell.close()
        remove_dir(d)


def test_the_plan_is_the_same_on_the_single_device_and_the_rank():
    """The rank runs the scheduler's plan as it is: step by step, the plans the single-device
    target is handed and those the in-process rank decoded and ran are the same (sids aside:
    they are of each pool), and so are the outputs."""
    from tiny import tiny_target

    from deployments.tp.codec import plan_digest

    ref = tiny_target(vocab=90)
    tp = local_tp(ref)
    try:
        single, want = _planned(ref, device_walk=True)
        on_tp, got = _planned(tp)
        assert got == want
        assert len(single) == len(on_tp) > 5
        chain = 0
        for a, b in zip(single, on_tp):
            assert plan_digest(a) == plan_digest(b)
            chain = plan_digest(a, chain)
        assert tp.group.worker_reports()[0]["plan_digest"] == chain
    finally:
        tp.group.shutdown()


def test_vocab_parallel_argmax_and_rows_on_one_rank():
    from deployments.tp.shards import gather_rows, vocab_argmax, vocab_range

    assert [vocab_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert [vocab_range(4, r, 8) for r in (3, 4, 7)] == [(3, 4), (4, 4), (4, 4)]  # more ranks than rows
    x = torch.tensor([[1.0, 3.0, 3.0], [0.0, -1.0, 2.0]])
    assert vocab_argmax(x, 5).tolist() == [6, 7]  # the first maximal index, offset by the range start
    assert torch.equal(gather_rows(x), x)


def test_sharded_reads_are_the_checkpoint_slices(tmp_path):
    """read_slice (pread, dim 0 and dim 1, straight into the parameter or not) == the tensor's slice."""
    import os

    from safetensors.torch import save_file

    from deployments.tp.shards import read_slice, safetensors_header, tensor_files

    w = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    b = torch.arange(5, dtype=torch.bfloat16)
    save_file({"w": w, "b": b}, str(tmp_path / "model.safetensors"))
    assert set(tensor_files(tmp_path)) == {"w", "b"}
    base, head = safetensors_header(tmp_path / "model.safetensors")
    fd = os.open(tmp_path / "model.safetensors", os.O_RDONLY)
    try:
        assert torch.equal(read_slice(fd, base, head["w"]), w)
        assert torch.equal(read_slice(fd, base, head["w"], 0, 2, 5), w[2:5])
        assert torch.equal(read_slice(fd, base, head["w"], 1, 3, 7), w[:, 3:7])
        out = torch.empty(4, 8)
        assert read_slice(fd, base, head["w"], 0, 1, 5, out=out) is out and torch.equal(out, w[1:5])
        into_other_dtype = torch.empty(6, 4, dtype=torch.float64)
        read_slice(fd, base, head["w"], 1, 4, 8, out=into_other_dtype)
        assert torch.equal(into_other_dtype, w[:, 4:].double())
        assert torch.equal(read_slice(fd, base, head["b"]), b)
    finally:
        os.close(fd)


def test_shard_offset_refuses_an_unknown_layout():
    from deployments.tp.shards import shard_offset

    with pytest.raises(ValueError, match="cannot tell which slice"):
        shard_offset(torch.nn.Linear(4, 4), 0, 8, 4)


def test_target_placement_replica_or_workers():
    """tp 1 on the CPU or on a GPU the replica itself holds: the model lives in the replica (the engine
    path measured on an H200); tensor parallel, or a GPU only workers get: Ray worker actors."""
    from deployments.tp.placement import target_placement

    assert target_placement(1, "cpu", 0) == "replica"
    assert target_placement(1, "cuda", 1) == "replica"
    assert target_placement(1, "cuda", 0) == "workers"
    assert target_placement(2, "cpu", 0) == "workers"
    assert target_placement(4, "cuda", 0) == "workers"


def test_placement_bundles_reserve_the_replica_with_rank_0():
    from deployments.config import ServeAppConfig
    from deployments.tp.placement import placement_bundles

    assert placement_bundles(2, 1, 0, 0, 0) == [{"CPU": 1}, {"CPU": 0.01}]
    assert placement_bundles(4, 1, 0, 2, 1) == [{"CPU": 3, "GPU": 1}] + [{"CPU": 2, "GPU": 1}] * 3
    cfg = ServeAppConfig(tensor_parallel_size=8, device="cuda", dtype="bfloat16", replica_num_cpus=1)
    opts = cfg.deployment_options()
    assert len(opts["placement_group_bundles"]) == 8 and opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["placement_group_bundles"][0] == {"CPU": 1, "GPU": 1.0}
    assert "placement_group_bundles" not in ServeAppConfig(device="cpu").deployment_options()
    # the hidden retrieval key comes back with the step's answer: a tensor-parallel replica keys on it too
    assert ServeAppConfig(tensor_parallel_size=2, retrieval={"key": "hidden"}).retrieval.key == "hidden"


@pytest.mark.serve
def test_unplaceable_workers_fail_within_the_timeout(ray_cluster):
    """Workers asking for a GPU the cluster lacks: a clear PlacementError within the timeout, both
    when the start makes its own placement group and inside a replica's group that cannot hold them."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from deployments.tp.placement import PlacementError, start_workers
    from deployments.tp.worker import TPWorker

    args = lambda r: ("/nonexistent", r, 2, "float32", "cuda")  # noqa: E731 -- never loaded
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match="GPU") as err:
        start_workers(TPWorker, args, 2, {"CPU": 0.0, "GPU": 1.0}, "STRICT_PACK", 3.0)
    assert time.monotonic() - t0 < 30 and "no room for 2 tensor-parallel workers" in str(err.value)

    # a replica's group whose bundles could hold the workers but are taken: they wait, then fail
    pg = placement_group([{"CPU": 0.01}, {"CPU": 0.01}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=30)

    @ray.remote(num_cpus=0.01)
    class Holder:
        def ping(self) -> int:
            return 0

    @ray.remote(num_cpus=0)
    def inside(resources: dict) -> str:
        try:
            start_workers(TPWorker, args, 2, resources, "STRICT_PACK", 3.0)
        except PlacementError as exc:
            return str(exc)
        return "started"

    holders = [
        Holder.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
        ).remote()
        for b in (0, 1)
    ]
    try:
        ray.get([h.ping.remote() for h in holders], timeout=60)
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        msg = ray.get(inside.options(scheduling_strategy=strategy).remote({"CPU": 0.01, "GPU": 0.0}), timeout=120)
        never = ray.get(inside.options(scheduling_strategy=strategy).remote({"CPU": 0.0, "GPU": 1.0}), timeout=120)
    finally:
        for h in holders:
            ray.kill(h)
        remove_placement_group(pg)
    assert "cannot run in this placement group" in never and "GPU" in never
    assert "rank(s) [0, 1] not placed within 3 s" in msg and "{'CPU': 0.01, 'GPU': 0.0}" in msg


def _requests(n: int) -> list:
    from serve_fixtures import chat_request

    return [
        chat_request(
            [{"role": "system", "content": "Shared."}, {"role": "user", "content": f"call {i} " * (i + 1)}],
            tools=TOOLS if i % 2 else [],
            tool_choice=("required" if i == 3 else "auto") if i % 2 else "none",
            max_tokens=24,
            temperature=0.7 if i == 2 else 0.0,
            seed=11 if i == 2 else None,
        )
        for i in range(n)
    ]


@needs_deepspeed
@pytest.mark.serve
@pytest.mark.timeout(900)
def test_tensor_parallel_2_equals_single_process(ray_cluster, tiny_model_dir):
    """DeepSpeed AutoTP over 2 Ray actors (gloo on CPU) vs the single-process engine: identical,
    requests alone and batched (greedy, sampled with a seed, tools on auto and required); every
    step through the step channel."""
    from deployments.config import ServeAppConfig
    from deployments.engine_host import EngineHost

    base = dict(
        model=tiny_model_dir,
        method="toolspec",
        cost_model="reference",
        retrieval={"enabled": False},
        kv_pool_tokens=8192,
    )
    single = EngineHost.build(ServeAppConfig(**base))
    tp = EngineHost.build(ServeAppConfig(**base, tensor_parallel_size=2))
    try:
        group = tp.target.group
        assert len(group.workers) == 2 and [r["rank"] for r in group.reports] == [0, 1]
        reqs = _requests(4)

        async def run(host):
            one_by_one = [await host.generate(r, "t") for r in reqs]
            together = await asyncio.gather(*(host.generate(r, "t") for r in reqs))
            return [r.text for r in one_by_one], [r.text for r in together]

        a_seq, a_par = asyncio.run(run(single))
        calls, before = group.transport.ray_calls, group.transport.steps
        b_seq, b_par = asyncio.run(run(tp))
        assert a_seq == b_seq and a_par == b_par
        assert a_seq[:2] + a_seq[3:] == a_par[:2] + a_par[3:]  # greedy: batching changes nothing
        steps = len(tp.engine.scheduler.steps)
        assert group.transport.ray_calls == calls  # the steps went through the step channel, no Ray call
        assert group.transport.steps - before == steps
        reports = group.worker_reports()
        assert reports[0]["steps"] == reports[1]["steps"] == group.transport.steps
    finally:
        tp.close()
        single.close()


def planned_digest(target) -> list[int]:
    """``target.step`` wrapped to chain :func:`~deployments.tp.codec.plan_digest` over the plans it
    is handed; the one-item list holds the chain."""
    from deployments.tp.codec import plan_digest

    chain, real = [0], target.step

    def step(plan, pool=None):
        chain[0] = plan_digest(plan, chain[0])
        return real(plan, pool)

    target.step = step
    return chain


def digests(target, prompts, want, n, limits, pool) -> int:
    """The chained plan digest of a batch on the single device, its walks where the argmax is."""
    chain = planned_digest(target)
    seqs = [Sequence(target, p, OracleDrafter(w), DecodeConfig(max_new_tokens=n)) for p, w in zip(prompts, want)]
    sched = Scheduler(target, None, limits, pool, device_walk=True)
    for s in seqs:
        sched.add(s)
    sched.run()
    del target.step
    assert [s.result.tokens for s in seqs] == want
    return chain[0]


@needs_deepspeed
@pytest.mark.serve
@pytest.mark.timeout(900)
def test_tp2_ragged_steps_equal_plain_greedy(ray_cluster, tiny_model_dir):
    """TP = 2 on gloo with the ranks' step runner on the ragged attention: B = 16 with draft trees
    (accepted rows off the tree's prefix: KV moves on the ranks), prefill chunks beside decoding
    rows and, in a second round, shared prefix blocks -- every output is single-stream plain
    greedy's; the walks ran on rank 0 and every step went through the step channel."""
    from deployments.tp.target import start_tp_target
    from toolspec_core.engine.loop import generate
    from toolspec_core.model.target import load_target

    ref = load_target(tiny_model_dir, tune_gemm=False)
    shared = [100 + (7 * j) % 50 for j in range(40)]  # two full 16-token blocks and more
    prompts = [shared + [200 + i] * (1 + i % 5) for i in range(12)] + [
        [300 + (5 * j + i) % 70 for j in range(5 + 9 * i)] for i in range(4)
    ]
    n = 10
    want = [generate(ref, p, None, DecodeConfig(max_new_tokens=n)).tokens for p in prompts]
    limits = BatchLimits(max_running=16, prefill_chunk=256, tree_rows=16)
    single = digests(ref, prompts, want, n, limits, ref.block_pool(4096, 16))  # the device walk, as the ranks'
    tp = start_tp_target(tiny_model_dir, 2, attention="ragged", timeout_s=600)
    try:
        pool = tp.block_pool(4096, 16)
        seqs = [Sequence(tp, p, OracleDrafter(w), DecodeConfig(max_new_tokens=n)) for p, w in zip(prompts, want)]
        sched = Scheduler(tp, None, limits, pool)
        sent = planned_digest(tp)
        for s in seqs:
            sched.add(s)
        sched.run()
        del tp.step
        assert [s.result.tokens for s in seqs] == want
        # the plan every rank ran is the one the scheduler made, and the single device's, step by step
        assert [r["plan_digest"] for r in tp.group.worker_reports()] == [sent[0], sent[0]] == [single, single]
        assert sum(sum(s.result.stats.accepted) for s in seqs) > 0
        assert max(r.sequences for r in sched.steps) >= 12  # decoding together (16 admitted at once)
        assert any(r.prefill_rows and r.sequences for r in sched.steps)  # a prefill chunk beside decoding rows
        again = [Sequence(tp, p, OracleDrafter(w), DecodeConfig(max_new_tokens=n)) for p, w in zip(prompts[:4], want)]
        got = run_batch(tp, again, None, limits, pool)
        assert [r.tokens for r in got] == want[:4]
        assert all(s.stats.cached_tokens >= 32 for s in again)  # the shared prefix blocks were reused
        reports = tp.group.worker_reports()
        steps = tp.group.transport.steps
        assert [r["steps"] for r in reports] == [steps, steps]
        assert all(r["paths"]["ragged"] == steps and r["paths"]["per_sequence"] == 0 for r in reports)
        assert all(r.handover_s > 0 for r in sched.steps)
    finally:
        tp.group.shutdown()


@needs_deepspeed
@pytest.mark.serve
@pytest.mark.timeout(900)
def test_tp_replica_places_its_workers_in_its_placement_group(ray_cluster, serve_port, tiny_model_dir):
    """A TP=2 replica deployed through Serve: a placement group of 2 bundles (replica + rank 0,
    rank 1), and both workers run inside it."""
    import httpx
    from ray import serve
    from ray.util import placement_group_table
    from serve_fixtures import deploy

    base = deploy(
        "tp2",
        {"model": tiny_model_dir, "tensor_parallel_size": 2, "retrieval": {"enabled": False}, "max_tokens_default": 8},
        serve_port,
    )
    try:
        info = None
        for _ in range(120):  # the replica serves /health with its engine's info once it is up
            try:
                r = httpx.get(base.removesuffix("/v1") + "/health", timeout=30)
                if r.status_code == 200:
                    info = r.json()["engine"]
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        assert info is not None, "the TP replica did not start"
        tp = info["tensor_parallel"]
        pg = tp["placement_group"]
        assert pg is not None and [w["placement_group"] for w in tp["workers"]] == [pg, pg]
        table = placement_group_table()[pg]
        assert len(table["bundles"]) == 2 and table["strategy"] == "STRICT_PACK"
    finally:
        serve.delete("tp2")


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.serve
@pytest.mark.timeout(1500)
def test_tp2_on_the_embedded_model_equals_single_process(ray_cluster, tmp_path):
    """Real weights, TP = 2 (gloo): dev prompts alone and batched give the single process's output;
    each rank holds about half the weights (the committed 30-item run: tests/deployments/tp_run.py)."""
    import json

    from tp_run import main

    from toolspec_core.model.embedded import embedded_model_dir

    out = tmp_path / "tp2.json"
    assert main(["--tp", "2", "--items", "3", "--max-tokens", "40", "--batch", "3", "--out", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]
    assert s["identical_alone"] == s["identical_batched"] == s["items"] == 3
    full = sum(f.stat().st_size for f in embedded_model_dir().glob("*.safetensors"))
    workers = json.loads(out.read_text())["workers"]
    assert all(w["weights_bytes"] < 0.55 * full for w in workers)  # its half of every matrix, no whole copy
    assert all(w["rss_after_load_bytes"] - w["rss_before_load_bytes"] < 0.7 * full for w in workers)
    assert s["ray_calls_per_step"] == 0.0  # steps go through the shared-memory channel
