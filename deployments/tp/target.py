"""The replica's side of a tensor-parallel target: block tables here, KV and weights on the ranks.

:class:`TPTarget` is a :class:`~toolspec_core.model.target.Target` the batched scheduler runs
like any other: its block pool (:class:`RemoteBlockPool`) does all the bookkeeping (tables,
prefix cache, reference counts) with no storage, and queues what the ranks' storage must replay
-- a sequence's table when the pool opens its cache, its end when it closes, a verify commit's
slot moves. :meth:`TPTarget.step` encodes the scheduler's :class:`~toolspec_core.model.step_plan.StepPlan`
as it is, with those KV operations (:mod:`deployments.tp.codec`), and hands it to every rank
through the step channel (:mod:`deployments.tp.channel`); rank 0 answers with the walked trees' accepted tokens
and the few rows the host reads (a completed prompt's last hidden state among them: the
``hidden`` retrieval key). The replica holds the tokenizer and the config, never weights, so it
has no local forward: the config admits a tensor-parallel target only on the batched engine,
whose block pool prefills and caches prefixes through ``step``.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolspec_core.model.batch_forward import FAMILIES
from toolspec_core.model.block_pool import BlockPool, PagedKV, kv_bytes_per_token, kv_shape
from toolspec_core.model.step_plan import StepPlan
from toolspec_core.model.step_runner import StepOutput
from toolspec_core.model.target import Target

from .channel import Bell, Mailbox, Stamps, channel_dir, remove_dir
from .codec import KVOps, decode_answer, encode_step, stop_message

WAIT_CHECK_S = 30.0  # how often a replica waiting for an answer checks that its ranks are alive


@dataclass
class Transport:
    """What crossed between the replica and its ranks: steps, bytes each way through the step
    channel, Ray calls (set-up and reports only), and the control path's time."""

    steps: int = 0
    ray_calls: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    worker_s: float = 0.0  # rank 0's own step time, summed
    handover_s: float = 0.0  # plans reaching every rank (build, encode, write, wake, decode), summed
    send_s: float = 0.0  # of which the replica's part: building, encoding, writing the plan, ringing
    answer_s: float = 0.0  # rank 0's answers reaching the replica (write, wake, decode), summed

    def as_dict(self) -> dict:
        per = max(self.steps, 1)
        return {
            "steps": self.steps,
            "ray_calls": self.ray_calls,
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
            "bytes_out_per_step": round(self.bytes_out / per),
            "bytes_in_per_step": round(self.bytes_in / per),
            "worker_s": round(self.worker_s, 3),
            "handover_ms_per_step": round(1e3 * self.handover_s / per, 4),
            "send_ms_per_step": round(1e3 * self.send_s / per, 4),
            "answer_ms_per_step": round(1e3 * self.answer_s / per, 4),
        }


class TPGroup:
    """The replica's handle on its ranks: queued KV operations and the step channel."""

    def __init__(self, workers: list, reports: list[dict], pg=None, own_pg: bool = False, local: bool = False):
        self.workers, self.reports, self.pg, self.own_pg = workers, reports, pg, own_pg
        self.local = local  # workers are plain objects in this process (one rank, no Ray)
        self.transport = Transport()
        self.tables: list[tuple[int, list[int], int]] = []  # KV operations queued for the next step (KVOps)
        self.frees: list[int] = []
        self.moves: tuple[list[int], list[int]] = ([], [])
        self._lock = threading.Lock()
        self._dir = channel_dir()
        world = len(workers)
        self.plans, self.answers, self.stamps = Mailbox(), Mailbox(), Stamps(world)
        bells = [Bell.make(self._dir, f"rank{r}") for r in range(world)]
        self.bells = [Bell(p) for p in bells]
        self.reply = Bell(Bell.make(self._dir, "replica"))
        self.names = {
            "plans": self.plans.name,
            "answers": self.answers.name,
            "stamps": self.stamps.name,
            "bells": bells,
            "replica_bell": self.reply.path,
        }
        self.connected = False

    def _call_all(self, method: str, *args) -> list:
        self.transport.ray_calls += 0 if self.local else len(self.workers)
        if self.local:
            return [getattr(w, method)(*args) for w in self.workers]
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def allocate(self, num_blocks: int, block_tokens: int) -> None:
        self._call_all("allocate", num_blocks, block_tokens)
        if not self.connected:
            self._call_all("connect", self.names)
            self.connected = True

    def ops(self) -> KVOps:
        """The KV operations queued since the last step, taken."""
        with self._lock:
            tables, frees, (src, dst) = self.tables, self.frees, self.moves
            self.tables, self.frees, self.moves = [], [], ([], [])
        return KVOps(tables, frees, (np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)))

    def step(self, message: list[np.ndarray], full_rows: list[int], sent: float) -> StepOutput:
        """Hand a step ``message`` (:func:`~deployments.tp.codec.encode_step`, begun at ``sent``)
        to every rank, wait for rank 0's answer."""
        t = self.transport
        self.stamps.values[:] = 0.0
        t.bytes_out += self.plans.send(message)
        for bell in self.bells:
            bell.ring()
        t.send_s += time.perf_counter() - sent
        while not self.reply.wait(WAIT_CHECK_S):
            self._check_alive()
        t_ans = time.perf_counter()
        arrays = self.answers.receive()
        t.bytes_in += sum(a.nbytes for a in arrays)
        out, worker_s = decode_answer(arrays, full_rows)
        done = time.perf_counter()
        out.handover_s = float(self.stamps.values.max()) - sent
        t.steps += 1
        t.worker_s += worker_s
        t.handover_s += out.handover_s
        t.answer_s += done - t_ans
        return out

    def _check_alive(self) -> None:
        """A step outlasting :data:`WAIT_CHECK_S`: raise if a rank is gone (its answer never comes)."""
        if self.local:
            if not any(w._loop is not None and w._loop.is_alive() for w in self.workers):
                raise RuntimeError("the tensor-parallel rank's step loop has stopped")
            return
        import ray

        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=WAIT_CHECK_S)
        except Exception as exc:
            raise RuntimeError(f"a tensor-parallel rank is gone: {exc}") from exc

    def worker_reports(self) -> list[dict]:
        return self._call_all("report")

    def shutdown(self) -> None:
        if self._dir is None:
            return
        if self.connected:
            self.plans.send(stop_message())
            for bell in self.bells:
                bell.ring()
        workers, self.workers = self.workers, []
        if self.local:
            for w in workers:
                if w._loop is not None:
                    w._loop.join(timeout=10)
        else:
            from .placement import stop_workers

            stop_workers(workers, self.pg if self.own_pg else None)
        for end in [*self.bells, self.reply, self.plans, self.answers, self.stamps]:
            end.close()
        remove_dir(self._dir)
        self._dir = None


class RemoteBlockPool(BlockPool):
    """The bookkeeping of a block pool whose storage is on the ranks: zero KV heads here (no
    memory); the tables it opens, the caches it closes and each slot move queued for them."""

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

    def open(self, table: list[int], shared: int = 0, keys: list[bytes] | None = None) -> PagedKV:
        cache = super().open(table, shared, keys)
        with self.group._lock:
            self.group.tables.append((cache.sid, list(cache.table), shared))
        return cache

    def close(self, cache: PagedKV) -> None:
        super().close(cache)
        with self.group._lock:
            self.group.frees.append(cache.sid)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        with self.group._lock:
            self.group.moves[0].extend(src.tolist())
            self.group.moves[1].extend(dst.tolist())


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

    @property
    def batched(self) -> bool:
        return getattr(self.model.config, "model_type", None) in FAMILIES

    @property
    def device_walk(self) -> bool:
        """Always: the greedy walks run on rank 0, which answers with accepted tokens, not every row's argmax."""
        return True

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

    def step(self, plan: StepPlan, pool=None) -> StepOutput:
        """The scheduler's plan to every rank as it is, with the KV operations queued since the
        last step; the replica's view of each cache grows by its rows (the ranks' follow)."""
        sent = time.perf_counter()
        message = encode_step(plan, self.group.ops(), sent)
        for s in plan.seqs:
            s.segment.cache.advance(s.n)
        return self.group.step(message, plan.logits.full, sent)


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
    attention: str = "auto",
    cuda_graphs: bool = False,
) -> TPTarget:
    """Start ``tp_size`` worker actors (needs a running Ray) in the replica's placement group (or a
    new one), shard the model on them, return the target. Raises PlacementError when the workers
    cannot be placed or loaded within ``timeout_s``."""
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
        TPWorker,
        lambda r: (str(path), r, tp_size, dtype, device, threads, attention, cuda_graphs),
        tp_size,
        resources,
        strategy,
        timeout_s,
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


def in_process_tp(target: Target, attention: str = "auto", cuda_graphs: bool = False) -> TPTarget:
    """``target``'s model as a one-rank :class:`TPTarget` in this process
    (:meth:`~deployments.tp.worker.TPWorker.in_process`): every step through the tensor-parallel
    path -- the plan, the step channel, the rank's step runner (``attention`` / ``cuda_graphs``)
    and the walk on the rank -- at TP = 1, what one device can compare with the single-device step."""
    from .worker import TPWorker

    worker = TPWorker.in_process(target.model, attention, cuda_graphs)
    return TPTarget(
        model=_Config(target.model.config, getattr(target.model, "generation_config", None), target.dtype),
        tokenizer=target.tokenizer,
        name=f"{target.name}-tp1",
        eos_ids=target.eos_ids,
        max_context=target.max_context,
        group=TPGroup([worker], [{}], local=True),
        tp_size=1,
    )


def local_tp_target(
    model: str | None, dtype: str = "float32", device: str = "cpu", attention: str = "auto", cuda_graphs: bool = False
) -> TPTarget:
    """A one-rank TP target whose worker runs in this process (no Ray): the DeepSpeed worker
    path, its sharded loader and its step protocol, on one device -- what a single GPU can check."""
    import os

    from transformers import AutoConfig

    from .worker import TPWorker

    path = resolve_model_path(model)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    worker = TPWorker(str(path), 0, 1, dtype, device, None, attention, cuda_graphs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = worker.setup("127.0.0.1", port)
    config = AutoConfig.from_pretrained(str(path))
    return target_of(path, config, dtype, device, TPGroup([worker], [report], local=True), 1)
