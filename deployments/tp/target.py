"""The replica's side of a tensor-parallel target: block tables here, KV and weights on the ranks.

:class:`TPTarget` is a :class:`~toolspec_core.model.target.Target` the batched scheduler runs
like any other: its block pool (:class:`RemoteBlockPool`) does all the bookkeeping (tables,
prefix cache, reference counts) with no storage, and queues the one storage write outside a
forward -- a verify commit's slot moves -- for the ranks. :meth:`TPTarget.step` turns the
scheduler's segments into one :class:`~deployments.tp.worker.StepPlan` and makes one Ray call
(rank 0 broadcasts it). The replica holds the tokenizer and the config, never weights, so it
has no local forward (``hidden`` / ``logits``): the config admits a tensor-parallel target only on
the batched engine, whose block pool prefills and caches prefixes through ``step``, and refuses
the ``hidden`` retrieval key, the one path that prefills in the replica.
"""

from __future__ import annotations

import itertools
import pickle
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolspec_core.model.batch_forward import FAMILIES, Segment
from toolspec_core.model.block_pool import BlockPool, kv_bytes_per_token, kv_shape
from toolspec_core.model.target import StepOutput, Target

from .worker import StepPlan, StepResult


@dataclass
class Transport:
    """What crossed between the replica and rank 0: Ray calls, pickled bytes each way, steps."""

    calls: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    worker_s: float = 0.0  # rank 0's own step time, summed

    def as_dict(self) -> dict:
        per = max(self.calls, 1)
        return {
            "calls": self.calls,
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
            "bytes_out_per_step": round(self.bytes_out / per),
            "bytes_in_per_step": round(self.bytes_in / per),
            "worker_s": round(self.worker_s, 3),
        }


class TPGroup:
    """The replica's handle on its ranks: queued KV operations, the one call per step."""

    def __init__(self, workers: list, reports: list[dict], pg=None, own_pg: bool = False, local: bool = False):
        self.workers, self.reports, self.pg, self.own_pg = workers, reports, pg, own_pg
        self.local = local  # workers are plain objects in this process (tests of the protocol)
        self.transport = Transport()
        self._ops: list[tuple] = []
        self._lock = threading.Lock()

    def queue(self, op: tuple) -> None:
        with self._lock:
            self._ops.append(op)

    def drain(self) -> list[tuple]:
        with self._lock:
            ops, self._ops = self._ops, []
        return ops

    def _call_all(self, method: str, *args) -> list:
        if self.local:
            return [getattr(w, method)(*args) for w in self.workers]
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def allocate(self, num_blocks: int, block_tokens: int) -> None:
        self._call_all("allocate", num_blocks, block_tokens)

    def step(self, plan: StepPlan) -> StepResult:
        t = self.transport
        t.calls += 1
        t.bytes_out += len(pickle.dumps(plan, protocol=5))
        if self.local:
            res = self.workers[0].step(plan)
        else:
            import ray

            res = ray.get(self.workers[0].step.remote(plan))
        t.bytes_in += len(pickle.dumps(res, protocol=5))
        t.worker_s += res.forward_s
        return res

    def worker_reports(self) -> list[dict]:
        return self._call_all("report")

    def shutdown(self) -> None:
        if not self.workers:
            return
        if self.local:
            self.workers = []
            return
        import ray

        from .placement import stop_workers

        try:
            ray.get(self.workers[0].stop.remote(), timeout=10)
        except Exception:
            pass
        stop_workers(self.workers, self.pg if self.own_pg else None)
        self.workers = []


class RemoteBlockPool(BlockPool):
    """The bookkeeping of a block pool whose storage is on the ranks: zero KV heads here (no
    memory), and each slot move queued for them."""

    def __init__(
        self,
        group: TPGroup,
        n_layers: int,
        head_dim: int,
        num_blocks: int,
        block_tokens: int,
        dtype: torch.dtype,
        prefix_caching: bool = True,
    ):
        super().__init__(n_layers, 0, head_dim, num_blocks, block_tokens, dtype, "cpu", prefix_caching)
        self.group = group

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.group.queue(("move", src.tolist(), dst.tolist()))


class _Config(torch.nn.Module):
    """Config and generation config of the checkpoint, and one parameter of its dtype (what
    ``Target.dtype`` reads): the replica's whole 'model'."""

    def __init__(self, config, generation_config, dtype: torch.dtype):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)


@dataclass
class TPTarget(Target):
    """A Target whose forward runs on a TP group (see the module docstring)."""

    group: TPGroup | None = None
    tp_size: int = 1
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _live: dict = field(default_factory=dict)  # sid -> the replica's PagedKV of a sequence the ranks hold

    @property
    def batched(self) -> bool:
        return getattr(self.model.config, "model_type", None) in FAMILIES

    def new_cache(self):
        """None: a sequence of a tensor-parallel target gets its KV from the block pool when the
        scheduler admits it (its rows live on the ranks); there is no per-sequence cache."""
        return None

    def block_pool(self, tokens: int, block_tokens: int = 16, prefix_caching: bool = True) -> RemoteBlockPool:
        layers, _, head_dim = kv_shape(self.model.config)
        blocks = -(-tokens // block_tokens)
        self.group.allocate(blocks, block_tokens)
        return RemoteBlockPool(self.group, layers, head_dim, blocks, block_tokens, self.dtype, prefix_caching)

    def kv_budget_tokens(self, fraction: float) -> int | None:
        """KV tokens that fit in ``fraction`` of the least free accelerator memory of any rank
        after its weights (None: the ranks are on the CPU)."""
        free = [r["free_bytes"] for r in self.group.reports if "free_bytes" in r]
        if not free:
            return None
        per_rank = kv_bytes_per_token(self.model.config, self.dtype) // self.tp_size
        return int(min(free) * fraction) // per_rank

    def step(self, segments: list[Segment], logit_rows, full_rows, hidden_rows, argmax: bool = True) -> StepOutput:
        ops = self.group.drain()
        for sid, cache in list(self._live.items()):
            if cache.released:
                ops.append(("free", sid))
                del self._live[sid]
        segs = []
        for s in segments:
            cache = s.cache
            sid = getattr(cache, "tp_sid", None)
            if sid is None:
                sid = cache.tp_sid = next(self._ids)
                self._live[sid] = cache
                ops.append(("table", sid, list(cache.table), cache.shared))
            n = len(s)
            visible = None if s.mask is None else (s.mask[0, 0, :, -n:] == 0)  # [n, n] the rows among themselves
            segs.append((sid, cache.get_seq_length(), s.ids, s.pos, visible))
        for s in segments:
            s.cache.advance(len(s))  # the ranks' views grew by these rows; the replica's length follows
        res = self.group.step(StepPlan(ops, segs, list(logit_rows), list(full_rows), list(hidden_rows)))
        index = {j: i for i, j in enumerate(full_rows)}
        return StepOutput(res.choice, res.logits, index, res.hidden)


def resolve_model_path(model: str | None) -> Path:
    from toolspec_core.model.embedded import embedded_model_dir

    return embedded_model_dir() if model in (None, "", "embedded") else Path(model)


def target_of(path: Path, config, dtype: str, device: str, group: TPGroup, tp_size: int) -> TPTarget:
    """The replica's TPTarget over ``group``: the checkpoint's tokenizer and configs, no weights."""
    from transformers import AutoTokenizer, GenerationConfig

    from toolspec_core.model.prompting import eos_ids_of
    from toolspec_core.model.target import resolve_dtype

    try:
        gen = GenerationConfig.from_pretrained(str(path))
    except OSError:
        gen = None
    head = _Config(config, gen, resolve_dtype(dtype, device))
    tok = AutoTokenizer.from_pretrained(str(path))
    return TPTarget(
        model=head,
        tokenizer=tok,
        name=path.name,
        eos_ids=eos_ids_of(head, tok),
        max_context=getattr(config, "max_position_embeddings", None) or 32768,
        group=group,
        tp_size=tp_size,
    )


def start_tp_target(
    model: str | None,
    tp_size: int,
    dtype: str = "float32",
    device: str = "cpu",
    worker_num_cpus: float = 0,
    worker_num_gpus: float = 0,
    threads: int | None = None,
    strategy: str = "STRICT_PACK",
    timeout_s: float = 600.0,
) -> TPTarget:
    """Start ``tp_size`` worker actors (needs a running Ray) in the replica's placement group (or a
    new one), shard the model on them, return the target. Raises PlacementError when the workers
    cannot be placed or loaded within ``timeout_s``."""
    import time

    import ray
    from transformers import AutoConfig

    from .placement import PlacementError, start_workers, stop_workers, worker_resources
    from .worker import TPWorker

    path = resolve_model_path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an HF model directory (no config.json)")
    config = AutoConfig.from_pretrained(str(path))
    _, kv_heads, _ = kv_shape(config)
    if config.num_attention_heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's {config.num_attention_heads} attention "
            f"heads and {kv_heads} KV heads"
        )
    t0 = time.monotonic()
    resources = worker_resources(worker_num_cpus, worker_num_gpus)
    workers, pg, own = start_workers(
        TPWorker, lambda r: (str(path), r, tp_size, dtype, device, threads), tp_size, resources, strategy, timeout_s
    )
    try:
        addr, port = ray.get(workers[0].address.remote(), timeout=timeout_s)
        left = max(1.0, timeout_s - (time.monotonic() - t0))
        reports = ray.get([w.setup.remote(addr, port) for w in workers], timeout=left)
    except ray.exceptions.GetTimeoutError:
        stop_workers(workers, pg if own else None)
        raise PlacementError(
            f"{tp_size} tensor-parallel workers did not load {path} within {timeout_s:.0f} s"
        ) from None
    except Exception:
        stop_workers(workers, pg if own else None)
        raise
    return target_of(path, config, dtype, device, TPGroup(workers, reports, pg, own), tp_size)


def local_tp_target(model: str | None, dtype: str = "float32", device: str = "cpu") -> TPTarget:
    """A one-rank TP target whose worker runs in this process (no Ray): the DeepSpeed worker
    path, its sharded loader and its step protocol, on one device -- what a single GPU can check."""
    import os

    from transformers import AutoConfig

    from .worker import TPWorker

    path = resolve_model_path(model)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    worker = TPWorker(str(path), 0, 1, dtype, device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = worker.setup("127.0.0.1", port)
    config = AutoConfig.from_pretrained(str(path))
    return target_of(path, config, dtype, device, TPGroup([worker], [report], local=True), 1)
