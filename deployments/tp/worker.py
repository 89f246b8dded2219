"""A tensor-parallel rank: its shard of the model, its share of every sequence's KV, the step.

The replica owns drafting, scheduling and the KV block tables; the ranks own the weights and
the KV storage (each rank its KV heads' share of every block). A step is planned once on the
replica (:class:`StepPlan`: the KV operations since the last step, each sequence's new rows and
tree, which rows' logits are needed, the greedy trees to walk) and reaches every rank through
the step channel (:mod:`deployments.tp.channel`: shared memory and a doorbell per rank, a fixed
layout of arrays -- no Ray call, no pickling). Every rank runs :func:`run_step` -- the step runner
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
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from toolspec_core.model.batch_forward import Segment
from toolspec_core.model.block_pool import BlockPool, PagedKV, kv_shape
from toolspec_core.model.step_runner import StepOutput, StepRequest, StepRunner

log = logging.getLogger("toolspec.tp")

STEP, STOP = 1, 0


@dataclass
class StepPlan:
    """One verify step as the ranks need it.

    ``tables``: new sequences' block tables ``(sid, table, shared)``; ``frees``: sids whose
    sequence ended; ``moves``: slot moves of verify commits ``(src, dst)``, each [n] -- the KV
    operations since the last step, applied in that order. ``segs`` [S, 4]: per sequence
    ``(sid, kv_length, rows, has_tree)``; ``ids`` / ``pos`` [N] the rows; ``parents``: each tree
    sequence's rows' parent rows [n] (:func:`~toolspec_core.engine.verify.row_parents`: a row sees
    itself and its ancestors among its sequence's new rows), concatenated in order.
    ``logit_rows`` / ``full_rows`` / ``hidden_rows`` / ``need`` / ``walk`` / ``argmax``: as in
    :class:`~toolspec_core.model.step_runner.StepRequest`. ``sent``: the replica's clock when
    it began handing the plan over."""

    tables: list[tuple[int, list[int], int]] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)
    moves: tuple[np.ndarray, np.ndarray] | None = None
    segs: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), dtype=np.int64))
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    parents: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    logit_rows: list[int] = field(default_factory=list)
    full_rows: list[int] = field(default_factory=list)
    hidden_rows: list[int] = field(default_factory=list)
    need: list[int] = field(default_factory=list)
    walk: np.ndarray | None = None
    argmax: bool = True
    sent: float = 0.0


def _ints(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


def encode_plan(plan: StepPlan) -> list[np.ndarray]:
    """The plan as the channel carries it: fixed-layout arrays (see :func:`decode_plan`)."""
    tables = [np.concatenate([_ints([sid, shared, len(t)]), _ints(t)]) for sid, t, shared in plan.tables]
    src, dst = plan.moves if plan.moves is not None else (_ints([]), _ints([]))
    walk = plan.walk if plan.walk is not None else np.zeros((0, 0), dtype=np.int64)
    meta = _ints([STEP, int(plan.argmax), len(plan.tables)])
    return [
        meta,
        np.array([plan.sent], dtype=np.float64),
        np.concatenate(tables) if tables else _ints([]),
        _ints(plan.frees),
        np.stack([_ints(src), _ints(dst)]),
        plan.segs.astype(np.int64, copy=False).reshape(-1, 4),
        _ints(plan.ids),
        _ints(plan.pos),
        _ints(plan.parents),
        _ints(plan.logit_rows),
        _ints(plan.full_rows),
        _ints(plan.hidden_rows),
        _ints(plan.need),
        walk.astype(np.int64, copy=False),
    ]


def stop_message() -> list[np.ndarray]:
    return [_ints([STOP, 0, 0])]


def decode_plan(arrays: list[np.ndarray]) -> StepPlan | None:
    """:func:`encode_plan`'s arrays as a :class:`StepPlan` (None: the stop message)."""
    meta = arrays[0]
    if int(meta[0]) == STOP:
        return None
    flat, tables, o = arrays[2].tolist(), [], 0
    for _ in range(int(meta[2])):
        sid, shared, n = flat[o : o + 3]
        tables.append((sid, flat[o + 3 : o + 3 + n], shared))
        o += 3 + n
    segs = arrays[5]
    walk = arrays[13]
    return StepPlan(
        tables,
        arrays[3].tolist(),
        (arrays[4][0], arrays[4][1]),
        segs,
        arrays[6],
        arrays[7],
        arrays[8],
        arrays[9].tolist(),
        arrays[10].tolist(),
        arrays[11].tolist(),
        arrays[12].tolist(),
        walk if walk.size else None,
        bool(meta[1]),
        float(arrays[1][0]),
    )


def encode_answer(out: StepOutput, forward_s: float) -> list[np.ndarray]:
    """Rank 0's answer: the argmax the host reads, the walks, full rows and hidden states."""
    need = [j for j, c in enumerate(out.choice or []) if c is not None]
    picked = [out.choice[j] for j in need]
    walks = np.asarray(out.walks, dtype=np.int64) if out.walks else np.zeros((0, 0), dtype=np.int64)  # [B, 2 + T]
    full = out.logits.float().cpu().numpy() if out.logits is not None else np.zeros((0, 0), np.float32)
    hidden = out.hidden.float().cpu().numpy() if out.hidden is not None else np.zeros((0, 0), np.float32)
    has = [int(out.choice is not None), int(out.logits is not None), int(out.hidden is not None)]
    return [
        _ints([0, len(out.choice or [])] + has),
        _ints(need),
        _ints(picked),
        walks,
        full,
        hidden,
        np.array([forward_s], dtype=np.float64),
    ]


def error_answer(exc: BaseException) -> list[np.ndarray]:
    return [_ints([1]), np.frombuffer(f"{type(exc).__name__}: {exc}".encode()[:4000], dtype=np.uint8)]


def decode_answer(arrays: list[np.ndarray], full_rows: list[int]) -> tuple[StepOutput, float]:
    """(the step's :class:`StepOutput`, rank 0's step seconds); RuntimeError for a rank's error."""
    meta = arrays[0]
    if int(meta[0]) != 0:
        raise RuntimeError(f"tensor-parallel step failed on rank 0: {arrays[1].tobytes().decode(errors='replace')}")
    m, has_choice, has_full, has_hidden = (int(x) for x in meta[1:5])
    choice = None
    if has_choice:
        choice = [None] * m
        for j, c in zip(arrays[1].tolist(), arrays[2].tolist()):
            choice[j] = c
    full = torch.from_numpy(arrays[4]) if has_full else None
    hidden = torch.from_numpy(arrays[5]) if has_hidden else None
    index = {j: i for i, j in enumerate(full_rows)}
    return StepOutput(choice, arrays[3].tolist(), full, index, hidden), float(arrays[6][0])


def apply_ops(pool: BlockPool, views: dict[int, PagedKV], plan: StepPlan) -> None:
    """Replay the replica's KV operations on this rank's storage: new tables, ended sequences, moves."""
    for sid, table, shared in plan.tables:
        views[sid] = pool.open(table, shared, sid=sid)
    for sid in plan.frees:
        views.pop(sid, None)
    if plan.moves is not None and len(plan.moves[0]):
        dev = pool.k.device
        pool.move_slots(torch.from_numpy(plan.moves[0]).to(dev), torch.from_numpy(plan.moves[1]).to(dev))


def request_of(plan: StepPlan, views: dict[int, PagedKV]) -> StepRequest:
    """The step runner's request over this rank's views: each sequence's length set from the plan
    and each tree's rows' parents (the ragged plan reads them; the per-sequence loop builds its
    masks from them, :func:`~toolspec_core.model.batch_forward.tree_masks`)."""
    ids, pos = torch.from_numpy(plan.ids), torch.from_numpy(plan.pos)
    parents = plan.parents.tolist()
    segments, o, p = [], 0, 0
    for sid, length, n, tree in plan.segs.tolist():
        view = views[sid]
        view.length = length
        if tree:
            segments.append(Segment(view, ids[o : o + n], pos[o : o + n], parents[p : p + n]))
            p += n
        else:
            segments.append(Segment(view, ids[o : o + n], pos[o : o + n]))
        o += n
    walk = None if plan.walk is None else torch.from_numpy(plan.walk)
    return StepRequest(segments, plan.logit_rows, plan.full_rows, plan.hidden_rows, walk, plan.need, argmax=plan.argmax)


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


def run_step(runner: StepRunner, views: dict[int, PagedKV], plan: StepPlan, rank: int) -> StepOutput | None:
    """One step on this rank (every rank runs it with the same plan); rank 0 returns the answer."""
    with torch.inference_mode():
        apply_ops(runner.pool, views, plan)
        req = request_of(plan, views)
        return runner.run(req, reply=rank == 0)


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
        self._loop: threading.Thread | None = None

    @classmethod
    def in_process(cls, model, attention: str = "auto", cuda_graphs: bool = False) -> "TPWorker":
        """Rank 0 of 1 over an already-built ``model`` in this process: the rank's step path (the
        channel, its step runner, the walk there) without a process group, DeepSpeed or Ray."""
        w = cls.__new__(cls)
        w.rank, w.world, w.device = 0, 1, str(next(model.parameters()).device)
        w.attention, w.cuda_graphs, w.model = attention, cuda_graphs, model
        w.pool = w.runner = w._loop = None
        w.views, w.steps, w.decode_s = {}, 0, 0.0
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
        self._loop = threading.Thread(target=self._serve, daemon=True, name=f"tp-rank-{self.rank}")
        self._loop.start()
        return self.rank

    def _serve(self) -> None:
        """Every step that arrives: decode the plan, stamp it, run it; rank 0 answers. A rank >= 1
        that fails logs it and stays in step (rank 0 meets the same error and reports it)."""
        while True:
            self.bell.wait()
            arrays = self.plans.receive()
            t = time.perf_counter()
            try:
                plan = decode_plan(arrays)
            except Exception as exc:  # a malformed message: answer it, never hang the replica
                log.exception("rank %d: bad step message", self.rank)
                plan, err = False, exc
            self.decode_s += time.perf_counter() - t
            if plan is None:
                return
            self.stamps.values[self.rank] = time.perf_counter()
            self.steps += 1
            t0 = time.perf_counter()
            try:
                if plan is False:
                    raise err
                out = run_step(self.runner, self.views, plan, self.rank)
                msg = encode_answer(out, time.perf_counter() - t0) if self.rank == 0 else None
            except Exception as exc:
                log.exception("rank %d: step failed", self.rank)
                msg = error_answer(exc) if self.rank == 0 else None
            if self.rank == 0:
                self.answers.send(msg)
                self.replica_bell.ring()

    def report(self) -> dict:
        return {
            "rank": self.rank,
            "steps": self.steps,
            "sequences": len(self.views),
            "decode_s": round(self.decode_s, 4),
            "paths": dict(self.runner.steps) if self.runner is not None else {},
            "rss_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
        }
