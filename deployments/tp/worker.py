"""A tensor-parallel rank: its shard of the model, its share of every sequence's KV, the step.

The replica owns drafting, scheduling and the KV block tables; the ranks own the weights and
the KV storage (each rank its KV heads' share of every block). A step is planned once on the
replica (:class:`StepPlan`: the KV operations since the last step, each sequence's new rows and
tree, which rows' logits are needed) and sent to rank 0 by one Ray call; rank 0 broadcasts it to
the other ranks over a gloo group, every rank runs :func:`run_step` (the decoder's collectives
are DeepSpeed's, NCCL on CUDA and gloo on CPU), and rank 0 answers with the argmax of every
logit row and only the few full rows the replica asked for (:class:`StepResult`).

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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from toolspec_core.model.batch_forward import Segment, batched_forward
from toolspec_core.model.block_pool import BlockPool, PagedKV, kv_shape

log = logging.getLogger("toolspec.tp")


@dataclass
class StepPlan:
    """One verify step as the ranks need it.

    ``ops``: KV operations since the last step, in order: ``("table", sid, table, shared)`` (a
    new sequence's block table), ``("free", sid)``, ``("move", src, dst)`` (slot lists of a
    verify commit). ``segs``: per sequence ``(sid, kv_length, ids [n], pos [n], visible)``,
    ``visible`` [n, n] bool (which of the new rows each row sees; None: causal). ``logit_rows``:
    rows whose argmax comes back; ``full_rows``: indices into ``logit_rows`` whose full logits
    come back; ``hidden_rows``: rows whose last hidden state comes back."""

    ops: list[tuple]
    segs: list[tuple]
    logit_rows: list[int]
    full_rows: list[int]
    hidden_rows: list[int]


@dataclass
class StepResult:
    """Rank 0's answer: ``choice`` (argmax per logit row), ``logits`` [K, V] fp32 of the full rows,
    ``hidden`` [len(hidden_rows), H] (CPU tensors), ``forward_s``: the ranks' step time."""

    choice: list[int]
    logits: torch.Tensor | None
    hidden: torch.Tensor | None
    forward_s: float


def tree_mask(visible: torch.Tensor, prefix: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, prefix + n] additive mask: every row sees the cached prefix, and the new rows
    ``visible`` [n, n] says (the tree's ancestors and the root chain)."""
    n = visible.shape[0]
    mask = torch.zeros(1, 1, n, prefix + n, dtype=dtype)
    mask[0, 0, :, prefix:] = torch.where(visible, 0.0, torch.finfo(dtype).min)
    return mask


def apply_ops(pool: BlockPool, views: dict[int, PagedKV], ops: list[tuple]) -> None:
    """Replay the replica's KV operations on this rank's storage."""
    for op in ops:
        kind = op[0]
        if kind == "table":
            _, sid, table, shared = op
            views[sid] = PagedKV(pool, table, shared)
        elif kind == "free":
            views.pop(op[1], None)
        elif kind == "move":
            dev = pool.k.device
            pool.move_slots(torch.tensor(op[1], device=dev), torch.tensor(op[2], device=dev))
        else:
            raise ValueError(f"unknown KV operation {kind!r}")


def run_step(model, pool: BlockPool, views: dict[int, PagedKV], plan: StepPlan, rank: int) -> StepResult | None:
    """One step on this rank (every rank runs it with the same plan); rank 0 returns the result."""
    from .shards import gather_rows, vocab_argmax

    t0 = time.perf_counter()
    with torch.inference_mode():
        apply_ops(pool, views, plan.ops)
        segments = []
        for sid, length, ids, pos, visible in plan.segs:
            view = views[sid]
            view.length = length
            mask = None if visible is None else tree_mask(visible, length, pool.k.dtype)
            segments.append(Segment(view, ids, pos, mask))
        hidden = batched_forward(model, segments)  # [N, H]
        head = model.lm_head
        local = head(hidden[plan.logit_rows])  # [M, V / TP] this rank's vocabulary columns
        choice = vocab_argmax(local, head.lo)  # [M]
        full = gather_rows(local[plan.full_rows]) if plan.full_rows else None  # [K, V]
        if rank != 0:
            return None
        out = StepResult(
            choice.tolist(),
            None if full is None else full.cpu(),
            hidden[plan.hidden_rows].float().cpu() if plan.hidden_rows else None,
            0.0,
        )
    out.forward_s = time.perf_counter() - t0
    return out


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
    :meth:`allocate`, then rank 0's :meth:`step` per step while the others follow the broadcast."""

    def __init__(self, model_path: str, rank: int, world: int, dtype: str, device: str, threads: int | None = None):
        self.path, self.rank, self.world, self.device = Path(model_path), rank, world, device
        self.dtype_name, self.threads = dtype, threads
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0" if device == "cuda" else str(rank),  # the one device Ray gave this process
            LOCAL_SIZE=str(world),
            TORCH_EXTENSIONS_DIR=extensions_dir(),
        )
        if device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.model = self.pool = self.control = None
        self.views: dict[int, PagedKV] = {}
        self.steps = 0
        self._loop: threading.Thread | None = None

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
        # steps arrive whenever requests do: the control group waits as long as the replica lives
        self.control = dist.new_group(backend="gloo", timeout=timedelta(days=365)) if self.world > 1 else None
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
        """This rank's KV storage for the replica's pool; the ranks >= 1 start following steps."""
        layers, _, head_dim = kv_shape(self.model.config)
        w = self.model.model.layers[0].self_attn.k_proj.weight
        self.pool = BlockPool(
            layers, self.kv_heads(), head_dim, num_blocks, block_tokens, w.dtype, w.device, prefix_caching=False
        )
        if self.rank > 0 and self._loop is None:
            self._loop = threading.Thread(target=self._follow, daemon=True, name=f"tp-rank-{self.rank}")
            self._loop.start()
        return self.pool.capacity_tokens

    def step(self, plan: StepPlan) -> StepResult:
        """Rank 0: broadcast the plan, run it, answer."""
        if self.world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list([plan], src=0, group=self.control)
        self.steps += 1
        return run_step(self.model, self.pool, self.views, plan, self.rank)

    def _follow(self) -> None:
        import torch.distributed as dist

        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            if box[0] is None:
                return
            self.steps += 1
            try:
                run_step(self.model, self.pool, self.views, box[0], self.rank)
            except Exception:  # rank 0 meets the same error and reports it; stay in step
                log.exception("rank %d: step failed", self.rank)

    def stop(self) -> None:
        """Rank 0: release the following ranks (they return from their loops)."""
        if self.world > 1 and self.control is not None:
            import torch.distributed as dist

            dist.broadcast_object_list([None], src=0, group=self.control)

    def report(self) -> dict:
        return {
            "rank": self.rank,
            "steps": self.steps,
            "sequences": len(self.views),
            "rss_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
        }
