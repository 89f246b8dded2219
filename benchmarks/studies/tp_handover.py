"""The tensor-parallel control path: how long a step's plan takes to reach every rank, TP = 1 vs 2.

A tiny random Qwen2 (so the forward does not hide the control path) sharded by DeepSpeed AutoTP
over Ray actors on the CPU (gloo); B sequences decode with a small draft tree each step
(:class:`RandomTrees`). Per decode step the scheduler's record carries ``handover_s``: from the
replica starting to encode the plan to the last rank having it decoded (encode, write into
shared memory, doorbell, wake-up, KV operations replayed, decode; ``replica_send_ms``: the
replica's part of it, every step's mean, prefill steps included; ``plan_build_ms``: of that,
encoding the scheduler's plan and the KV operations; ``replica_send_ms_median`` the replica's part and ``rank_wake_decode_ms``
the rest -- the last rank woken and its plan decoded -- over decode steps); the answer's way
back (rank 0 writes, the replica wakes and decodes) is the transport's ``answer_s``;
``codec_ms``: the hand-over's own work (write, read, decode) for a decode step's message in
one process, without a wake-up. A Ray call's round trip to a rank (``ping``, no payload) is
measured beside them: the floor of a step handed over by a Ray call.

    flock /tmp/toolspec-cpu.lock python -m benchmarks.studies.tp_handover --out benchmarks/results/measurements/NAME.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from toolspec_core.spec.proposer import DrafterBase
from toolspec_core.spec.tree import DraftTree


class RandomTrees(DrafterBase):
    """A draft tree of two short random branches every step (accepted or not, the plan's shape is
    a decoding step's)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def propose(self, ctx) -> DraftTree:
        tree = DraftTree()
        for _ in range(2):
            tree.add_path([self.rng.randrange(100, 1000) for _ in range(3)], 0.5, "x")
        return tree

    def feedback(self, tree, result) -> None:
        return None


def tiny_model_dir(out: Path) -> str:
    from transformers import AutoTokenizer

    from deployments.scripted import tiny_qwen2
    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    tiny_qwen2(tok, context=4096).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_level(target, pool, b: int, new_tokens: int) -> dict:
    from toolspec_core.engine.scheduler import BatchLimits, Scheduler
    from toolspec_core.engine.sequence import DecodeConfig, Sequence

    rng = random.Random(b)
    sched = Scheduler(target, None, BatchLimits(max_running=b, prefill_chunk=4096, tree_rows=16), pool)
    for i in range(b):
        prompt = [rng.randrange(100, 1000) for _ in range(32)]
        sched.add(Sequence(target, prompt, RandomTrees(i), DecodeConfig(max_new_tokens=new_tokens)))
    t = target.group.transport
    ans0, steps0, send0 = t.answer_s, t.steps, t.send_s
    bytes0 = t.bytes_out
    plans, built, sends, hands = [], [], [], []
    real = target.group.step

    def step(message, full, sent):
        built.append(time.perf_counter() - sent)  # the scheduler's plan and the KV operations encoded
        plans.append(message)
        s0 = t.send_s
        out = real(message, full, sent)
        sends.append(t.send_s - s0)  # built, encoded, written, rung
        hands.append(out.handover_s)
        return out

    target.group.step = step
    try:
        sched.run()
    finally:
        del target.group.step
    idx = [i for i, r in enumerate(sched.steps) if r.prefill_rows == 0 and r.sequences == b]  # one plan a step
    dec = [sched.steps[i] for i in idx]
    hand = [1e3 * r.handover_s for r in dec]
    wake = [1e3 * (hands[i] - sends[i]) for i in idx]
    n = t.steps - steps0
    return {
        "batch": b,
        "decode_steps": len(dec),
        "rows_per_step_median": statistics.median(r.rows for r in dec),
        "handover_ms_median": round(statistics.median(hand), 4),
        "handover_ms_p90": round(pct(hand, 0.9), 4),
        "handover_ms_mean": round(statistics.fmean(hand), 4),
        "replica_send_ms_mean": round(1e3 * (t.send_s - send0) / max(n, 1), 4),
        "plan_build_ms_median": round(1e3 * statistics.median(built[i] for i in idx), 4),
        "replica_send_ms_median": round(1e3 * statistics.median(sends[i] for i in idx), 4),
        "rank_wake_decode_ms_median": round(statistics.median(wake), 4),
        "rank_wake_decode_ms_p90": round(pct(wake, 0.9), 4),
        "answer_ms_mean": round(1e3 * (t.answer_s - ans0) / max(n, 1), 4),
        "plan_bytes_per_step": round((t.bytes_out - bytes0) / max(n, 1)),
        "forward_ms_median": round(1e3 * statistics.median(r.forward_s for r in dec), 3),
        "codec_ms": codec_ms(plans[len(plans) // 2]),
    }


def codec_ms(message, n: int = 200) -> float:
    """The hand-over's own work for one decode step's message, in one process (no wake-up): write
    into a shared-memory slot, read, decode -- ms, median of ``n``."""
    from deployments.tp.channel import Mailbox
    from deployments.tp.codec import decode_ops, decode_plan

    box = Mailbox()
    reader = Mailbox(box.name)
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            box.send(message)
            arrays = reader.receive()
            decode_ops(arrays)
            decode_plan(arrays, {})
            times.append(1e3 * (time.perf_counter() - t0))
    finally:
        reader.close()
        box.close()
    return round(statistics.median(times), 4)


def ray_ping_ms(workers, n: int = 30) -> float:
    import ray

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(workers[0].ping.remote())
        times.append(1e3 * (time.perf_counter() - t0))
    return round(statistics.median(times), 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from deployments.tp.target import start_tp_target

    batches = [int(x) for x in args.batch.split(",")]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    out: dict = {
        "what": __doc__.split("\n\n")[0],
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "config": vars(args),
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as d:
        path = tiny_model_dir(Path(d))
        for tp in [int(x) for x in args.tp.split(",")]:
            target = start_tp_target(path, tp, attention="ragged", timeout_s=900)
            try:
                pool = target.block_pool(max(batches) * (32 + args.new_tokens + 16 + 16), 16, prefix_caching=False)
                run_level(target, pool, 1, 8)  # warm-up
                ping = ray_ping_ms(target.group.workers)
                for b in batches:
                    rec = {"tp": tp, "ray_ping_ms": ping, **run_level(target, pool, b, args.new_tokens)}
                    out["runs"].append(rec)
                    print(json.dumps(rec), flush=True)
                out.setdefault("worker_reports", {})[str(tp)] = target.group.worker_reports()
            finally:
                target.group.shutdown()
    ray.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
