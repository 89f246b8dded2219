"""Tensor parallelism: the replica's shadow-cache protocol, and DeepSpeed AutoTP (2 ranks, gloo,
CPU) giving exactly the single-process engine's output."""

from __future__ import annotations

import asyncio
import gc
import importlib.util

import pytest
from serve_fixtures import TOOLS

from toolspec_core.engine.loop import DecodeConfig, decode, generate, prefill
from toolspec_core.engine.tree import DraftTree

CODE = "def f(x):\n    return x + 1\n\nprint(f(1))\n\ndef g(x):\n    return"


class OracleDrafter:
    """Drafts a wrong branch first, then the reference continuation (sometimes corrupted after one
    token): accepted rows are not a prefix of the tree, so every step gathers + crops the KV."""

    def __init__(self, ref: list[int]):
        self.ref = ref

    def propose(self, ctx) -> DraftTree:
        n = len(ctx.generated)
        tree = DraftTree()
        tree.add_path([(x + 7) % 1000 for x in self.ref[n : n + 2]], 0.5, "junk")
        good = self.ref[n : n + 3]
        if n % 3 == 1 and len(good) > 1:
            good = good[:1] + [(good[1] + 3) % 1000]
        tree.add_path(good[: ctx.max_depth], 0.9, "oracle")
        return tree

    def feedback(self, tree, result) -> None:
        return None


def _local_tp_target(ref):
    """A TPTarget whose single 'rank' is an in-process TPWorker over the full model."""
    from deployments.tp import TPGroup, TPTarget, TPWorker

    w = TPWorker.__new__(TPWorker)
    w.rank, w.world, w.dtype, w.model, w.head, w.caches = 0, 1, "float32", ref.model, None, {}
    tp = TPTarget(
        model=ref.model, tokenizer=ref.tokenizer, name="local", eos_ids=ref.eos_ids, max_context=ref.max_context
    )
    tp.group = TPGroup([w], local=True)
    return tp


def _check_equal(ref, tp, n: int = 30):
    ids = ref.tokenizer(CODE, add_special_tokens=False)["input_ids"]
    cfg = DecodeConfig(max_new_tokens=n)
    want = generate(ref, ids, None, cfg).tokens
    for target in (ref, tp):
        prefix = prefill(target, ids[:6])
        pre = prefill(target, ids, prefix)  # clone of a shared prefix (a fork on the ranks)
        for _ in range(2):  # decode twice from the same prefilled prompt: clones stay independent
            out = decode(target, pre, OracleDrafter(want), cfg)
            assert out.tokens == want
            assert sum(out.stats.accepted) > 0 and out.stats.forwards < n - 1
    return ids, want


def test_shadow_cache_replays_the_engine_kv_commits(tiny_model_dir):
    from toolspec_core.model.target import load_target

    ref = load_target(tiny_model_dir)
    tp = _local_tp_target(ref)
    _check_equal(ref, tp)
    gc.collect()
    assert tp.group.live_caches() == [0]  # every clone was freed on the rank


needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed (pip install -e '.[tp]')"
)


@needs_deepspeed
@pytest.mark.serve
@pytest.mark.timeout(900)
def test_tensor_parallel_2_equals_single_process(ray_cluster, tiny_model_dir):
    """DeepSpeed AutoTP over 2 Ray actors (gloo on CPU) vs the single-process engine: identical."""
    from deployments.config import ServeAppConfig
    from deployments.engine_host import EngineHost

    base = dict(
        model=tiny_model_dir,
        method="toolspec",
        cost_model="reference",
        retrieval={"enabled": False},
        max_tokens_default=24,
    )
    single = EngineHost.build(ServeAppConfig(**base))
    tp = EngineHost.build(ServeAppConfig(**base, tensor_parallel_size=2))
    try:
        assert tp.target.group is not None and len(tp.target.group.workers) == 2
        _check_equal(single.target, tp.target, n=24)

        reqs = [
            {
                "messages": [
                    {"role": "system", "content": "Shared."},
                    {"role": "user", "content": f"call {i} " * (i + 1)},
                ],
                "tools": TOOLS if i % 2 else [],
                "tool_choice": "auto" if i % 2 else "none",
                "max_tokens": 24,
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 0,
                "seed": None,
                "stop": [],
                "tenant": "t",
                "remember": True,
            }
            for i in range(4)
        ]

        async def run(host):
            one_by_one = [await host.generate(r) for r in reqs]
            together = await asyncio.gather(*(host.generate(r) for r in reqs))
            return [r["text"] for r in one_by_one], [r["text"] for r in together]

        a_seq, a_par = asyncio.run(run(single))
        b_seq, b_par = asyncio.run(run(tp))
        assert a_seq == a_par == b_seq == b_par
        gc.collect()
        live = tp.target.group.live_caches()
        assert live[0] == live[1] <= tp.cfg.prefix_cache_entries  # only cached prefixes remain
    finally:
        tp.close()
        single.close()


@pytest.mark.serve
def test_single_remote_worker_equals_in_process(ray_cluster, tiny_model_dir):
    """tp_size 1 through a worker actor (the accelerator path, no DeepSpeed) changes nothing."""
    from deployments.tp import start_tp_target
    from toolspec_core.model.target import load_target

    remote = start_tp_target(tiny_model_dir, 1)
    try:
        _check_equal(load_target(tiny_model_dir), remote, n=20)
    finally:
        remote.group.shutdown()
