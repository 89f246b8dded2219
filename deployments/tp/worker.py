"""A tensor-parallel rank: its shard of the model, its share of every sequence's KV, the step.

The replica owns drafting, scheduling and the KV block tables; the ranks own the weights and
the KV storage (each rank its KV heads' share of every block). A step is planned once, by the
replica's scheduler (:class:`~toolspec_core.model.step_plan.StepPlan`: each sequence's new rows and
tree, which rows' logits are needed, the greedy trees to walk), and reaches every rank with the
KV operations since the last step through the step channel (:mod:`deployments.tp.channel`:
shared memory and a doorbell per rank; :mod:`deployments.tp.codec`: a fixed layout of arrays --
no Ray call, no pickling). A rank replays the KV operations, rebuilds the same plan over its
views (:func:`receive_step`) and runs :func:`run_step` -- the step runner
(:mod:`toolspec_core.model.step_runner`) over its shard and its share of the pool, the same
ragged attention, CUDA graphs and device-side greedy walk as a single device; the decoder's
collectives are DeepSpeed's, NCCL on CUDA and gloo on CPU -- and rank 0 answers with the
accepted tokens of the walked trees, the argmax of the few rows the host reads, and the full
rows and hidden states asked for.

Each worker is a Ray actor with one accelerator of its own: on CUDA it sees that device as
``cuda:0`` whatever its rank, so ``LOCAL_RANK`` is 0 there (DeepSpeed picks the device from it).
On CPU, DeepSpeed's gloo path needs ``LOCAL_SIZE`` equal to the world size; its first use
compiles an op (~80 s), cached in ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/toolspec/torch_extensions``).
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from toolspec_core.model.block_pool import BlockPool, PagedKV, kv_shape
from toolspec_core.model.step_plan import StepPlan
from toolspec_core.model.step_runner import StepOutput, StepRunner

from .codec import KVOps, decode_ops, decode_plan, encode_answer, error_answer, plan_digest

log = logging.getLogger("toolspec.tp")

REPORT_WAIT_S = 10.0  # the longest a report waits for the step in flight on this rank


def apply_ops(pool: BlockPool, views: dict[int, PagedKV], ops: KVOps) -> None:
    """Replay the replica's KV operations on this rank's storage: new tables, ended sequences, moves."""
    for sid, table, shared in ops.tables:
        views[sid] = pool.open(table, shared, sid=sid)
    for sid in ops.frees:
        views.pop(sid, None)
    if len(ops.moves[0]):
        dev = pool.k.device
        pool.move_slots(torch.from_numpy(ops.moves[0]).to(dev), torch.from_numpy(ops.moves[1]).to(dev))


def receive_step(pool: BlockPool, views: dict[int, PagedKV], arrays: list[np.ndarray]) -> StepPlan | None:
    """A step message on this rank: its KV operations replayed on the storage, then the
    scheduler's plan over this rank's views (None: the stop message)."""
    got = decode_ops(arrays)
    if got is None:
        return None
    with torch.inference_mode():
        apply_ops(pool, views, got[0])
    return decode_plan(arrays, views)


def shard_head(model) -> callable:
    """The step runner's head on a rank: the vocabulary-parallel ``lm_head``'s logits of this
    rank's columns, the global argmax and the full rows gathered over the ranks (collectives:
    every rank runs it with the same plan)."""
    from .shards import gather_rows, vocab_argmax

    head = model.lm_head

    lo = getattr(head, "lo", 0)  # a whole-vocabulary head (one rank in process) starts at 0

    def run(picked: torch.Tensor, full_rows: list[int], argmax: bool):
        with torch.inference_mode():
            local = head(picked).float()  # [M, V / TP]
            choice = vocab_argmax(local, lo) if argmax else None  # [M]
            full = gather_rows(local[full_rows]) if full_rows else None  # [K, V]
        return choice, full

    return run


def run_step(runner: StepRunner, plan: StepPlan, rank: int) -> StepOutput | None:
    """One step on this rank (every rank runs it with the same plan): each sequence's view set to
    the plan's KV length, then the step runner; rank 0 returns the answer."""
    with torch.inference_mode():
        for s in plan.seqs:
            s.segment.cache.length = s.kv_len
        return runner.run(plan, reply=rank == 0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def placement() -> dict:
    """The placement group this process runs in (None outside Ray)."""
    try:
        import ray

        if not ray.is_initialized():
            return {"placement_group": None}
        return {"placement_group": ray.get_runtime_context().get_placement_group_id()}
    except ImportError:  # a local rank on a machine without Ray
        return {"placement_group": None}


def extensions_dir() -> str:
    from toolspec_core.model.embedded import cache_root

    return os.environ.get("TORCH_EXTENSIONS_DIR", str(cache_root() / "torch_extensions"))


class TPWorker:
    """One rank (a Ray actor): :meth:`address` (rank 0), :meth:`setup` on every rank at once,
    :meth:`allocate`, :meth:`connect` (the step channel); then every rank serves the steps that
    arrive there, rank 0 answering them."""

    def __init__(
        self,
        model_path: str,
        rank: int,
        world: int,
        dtype: str,
        device: str,
        threads: int | None = None,
        attention: str = "auto",
        cuda_graphs: bool = False,
    ):
        self.path, self.rank, self.world, self.device = Path(model_path), rank, world, device
        self.dtype_name, self.threads = dtype, threads
        self.attention, self.cuda_graphs = attention, cuda_graphs
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0" if device == "cuda" else str(rank),  # the one device Ray gave this process
            LOCAL_SIZE=str(world),
            TORCH_EXTENSIONS_DIR=extensions_dir(),
        )
        if device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.model = self.pool = self.runner = None
        self.views: dict[int, PagedKV] = {}
        self.steps = 0
        self.decode_s = 0.0  # plan decoding, summed
        self.digest = 0  # plan_digest of every plan run here, chained
        self.done = 0  # steps whose run and digest are over
        self._ran = threading.Condition()
        self._loop: threading.Thread | None = None

    @classmethod
    def in_process(cls, model, attention: str = "auto", cuda_graphs: bool = False) -> "TPWorker":
        """Rank 0 of 1 over an already-built ``model`` in this process: the rank's step path (the
        channel, its step runner, the walk there) without a process group, DeepSpeed or Ray."""
        w = cls.__new__(cls)
        w.rank, w.world, w.device = 0, 1, str(next(model.parameters()).device)
        w.attention, w.cuda_graphs, w.model = attention, cuda_graphs, model
        w.pool = w.runner = w._loop = None
        w.views, w.steps, w.decode_s, w.digest, w.done, w._ran = {}, 0, 0.0, 0, 0, threading.Condition()
        return w

    def ping(self) -> int:
        return self.rank

    def address(self) -> tuple[str, int]:
        """This process's node address and a free port: the rendezvous of the process group."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, addr: str, port: int) -> dict:
        """Join the process group (every rank concurrently), load this rank's shard; report what it took."""
        import torch.distributed as dist

        from toolspec_core.model.target import resolve_dtype

        from .shards import load_shard

        if self.threads:
            torch.set_num_threads(self.threads)
        if self.device == "cuda":
            torch.cuda.set_device(0)
        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(minutes=30),
        )
        rss0, t0 = rss_bytes(), time.perf_counter()
        self.model = load_shard(
            self.path, self.rank, self.world, resolve_dtype(self.dtype_name, self.device), self.device
        )
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        report = {
            "rank": self.rank,
            "device": str(next(self.model.parameters()).device),
            "load_s": round(time.perf_counter() - t0, 2),
            "weights_bytes": weights,
            "rss_before_load_bytes": rss0,
            "rss_after_load_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
        }
        if self.device == "cuda":
            report["free_bytes"] = torch.cuda.mem_get_info()[0]
        report.update(placement())
        return report

    def kv_heads(self) -> int:
        """KV heads this rank holds (its share of the model's)."""
        attn = self.model.model.layers[0].self_attn
        return attn.k_proj.weight.shape[0] // attn.head_dim

    def allocate(self, num_blocks: int, block_tokens: int) -> int:
        """This rank's KV storage for the replica's pool, and the step runner over it."""
        layers, _, head_dim = kv_shape(self.model.config)
        w = self.model.model.layers[0].self_attn.k_proj.weight
        self.pool = BlockPool(
            layers, self.kv_heads(), head_dim, num_blocks, block_tokens, w.dtype, w.device, prefix_caching=False
        )
        self.runner = StepRunner(self.model, self.pool, self.attention, self.cuda_graphs, head=shard_head(self.model))
        self.views = {}  # tables of the previous pool, if any, are gone with its storage
        return self.pool.capacity_tokens

    def connect(self, names: dict) -> int:
        """Attach the replica's step channel (:mod:`deployments.tp.channel`) and start serving its
        steps on a thread of this process. Raises where the channel is not reachable (a rank on
        another node than its replica)."""
        from .channel import Bell, Mailbox, Stamps

        try:
            self.plans = Mailbox(names["plans"])
            self.bell = Bell(names["bells"][self.rank])
            self.stamps = Stamps(self.world, names["stamps"])
            if self.rank == 0:
                self.answers = Mailbox(names["answers"])
                self.replica_bell = Bell(names["replica_bell"])
        except FileNotFoundError as exc:
            raise RuntimeError(
                f"rank {self.rank} cannot reach its replica's step channel ({exc}): the ranks must run on "
                "the replica's node (placement strategy STRICT_PACK)"
            ) from None
        from toolspec_core.model.openmp import release_team

        release_team()  # the loading thread's OpenMP workers: the stepping thread's team is the only one
        self._loop = threading.Thread(target=self._serve, daemon=True, name=f"tp-rank-{self.rank}")
        self._loop.start()
        return self.rank

    def _serve(self) -> None:
        """Every step that arrives: replay its KV operations and decode its plan, stamp it, run it;
        rank 0 answers. A rank >= 1 that fails logs it and stays in step (rank 0 meets the same
        error and reports it)."""
        while True:
            self.bell.wait()
            arrays = self.plans.receive()
            t = time.perf_counter()
            try:
                plan = receive_step(self.pool, self.views, arrays)
            except Exception as exc:  # a malformed message: answer it, never hang the replica
                log.exception("rank %d: bad step message", self.rank)
                plan = exc
            self.decode_s += time.perf_counter() - t
            if plan is None:
                return
            self.stamps.values[self.rank] = time.perf_counter()
            self.steps += 1
            msg = self._run(plan)
            if self.rank == 0:
                self.answers.send(msg)
                self.replica_bell.ring()
            with self._ran:
                if not isinstance(plan, Exception):  # after the answer: off the step's path
                    self.digest = plan_digest(plan, self.digest)
                self.done += 1
                self._ran.notify_all()

    def _run(self, plan: StepPlan | Exception) -> list[np.ndarray] | None:
        """One step's answer (rank 0; None on the others), an error answer for a failed step."""
        t0 = time.perf_counter()
        try:
            if isinstance(plan, Exception):
                raise plan
            out = run_step(self.runner, plan, self.rank)
            return encode_answer(out, time.perf_counter() - t0) if self.rank == 0 else None
        except Exception as exc:
            log.exception("rank %d: step failed", self.rank)
            return error_answer(exc) if self.rank == 0 else None

    def report(self) -> dict:
        """What this rank ran, once the steps that reached it are over (a rank >= 1 may still be
        finishing the last one when rank 0 has answered it)."""
        with self._ran:
            self._ran.wait_for(lambda: self.done >= self.steps, timeout=REPORT_WAIT_S)
        return {
            "rank": self.rank,
            "steps": self.steps,
            "sequences": len(self.views),
            "decode_s": round(self.decode_s, 4),
            "plan_digest": self.digest,
            "paths": dict(self.runner.steps) if self.runner is not None else {},
            "rss_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
        }
