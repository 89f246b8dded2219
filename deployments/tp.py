"""Tensor-parallel target: N Ray actors run DeepSpeed AutoTP shards; the replica drives them.

Design (why it is shaped like this):

* The TP workers own the real KV caches (each rank holds its heads' shard). The replica keeps a
  :class:`ShadowCache` per request that the engine manipulates exactly like a ``DynamicCache``
  (``get_seq_length``, ``crop``, gather via ``layers[0].keys``, ``copy.deepcopy``). Its single
  layer holds, for each logical row, the index of that row in the workers' cache. Whatever the
  engine does to it (commit gather, crop, clone) is therefore recorded for free, and before the
  next forward the replica sends one ``commit`` op (keep a prefix, gather the tail rows, crop:
  the engine's own KV commit, replayed on every rank's shard). Clones become ``fork`` ops and garbage-collected shadows ``free`` ops, queued in order.
* Every rank must enter the same collectives in the same order, so one lock serialises the
  forwards of all requests on a TP group (the forward is the bottleneck anyway).
* The replica holds only the tokenizer and ``lm_head`` (read straight from the checkpoint; on
  GPUs rank 0 applies it instead), so a 72B target never has a full copy in the replica.

GPU deployment of Qwen2.5-72B-Instruct (bf16, ~145 GB of weights)::

    model: /models/Qwen2.5-72B-Instruct
    dtype: bfloat16
    device: cuda
    tensor_parallel_size: 4        # 4x H100/H200 80-141 GB; use 8 on A100-80GB or for long contexts
    tp_worker_num_gpus: 1          # one GPU per TP actor; the replica itself needs none
    replica_num_cpus: 1

On CPU, DeepSpeed's AutoTP runs with the gloo backend only when ``LOCAL_SIZE`` equals the world
size (set here); its first use compiles an op (~80 s), cached in ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/toolspec/torch_extensions``).
"""

from __future__ import annotations

import copy
import itertools
import os
import socket
import threading
from pathlib import Path

import torch

from toolspec_core.engine.commit import commit_kv
from toolspec_core.model.target import Target, cache_kwarg, load_hf_model, resolve_dtype


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def extensions_dir() -> str:
    from toolspec_core.model.embedded import cache_root

    return os.environ.get("TORCH_EXTENSIONS_DIR", str(cache_root() / "torch_extensions"))


class TPWorker:
    """One tensor-parallel rank (a Ray actor). Holds a model shard and the KV caches by id."""

    def __init__(self, model_path: str, rank: int, world: int, addr: str, port: int, dtype: str, device: str = "cpu"):
        self.model_path, self.rank, self.world, self.dtype, self.device = model_path, rank, world, dtype, device
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_SIZE=str(world),
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            TORCH_EXTENSIONS_DIR=extensions_dir(),
        )
        if device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.model = None
        self.head = None
        self.caches: dict[int, object] = {}

    def setup(self, threads: int | None = None) -> str:
        """Join the process group and shard the model (all ranks must call this concurrently)."""
        if self.world > 1:
            import deepspeed
        if threads:
            torch.set_num_threads(threads)
        dtype = resolve_dtype(self.dtype, self.device)
        model = load_hf_model(
            self.model_path, dtype
        )  # grouped attention set before sharding: each rank groups its own heads
        if self.world == 1:  # one accelerator, no sharding: the same remote-worker path, no DeepSpeed
            self.model = model.to(self.device)
        else:
            deepspeed.init_distributed(dist_backend="gloo" if self.device == "cpu" else "nccl")
            engine = deepspeed.init_inference(
                model, tensor_parallel={"tp_size": self.world}, dtype=dtype, replace_with_kernel_inject=False
            )
            self.model = engine.module
        if self.rank == 0 and self.device != "cpu":
            # logits on rank 0's accelerator: the replica (no GPU) never runs the vocab matmul
            dev = next(self.model.parameters()).device
            self.head = load_lm_head(Path(self.model_path), dtype).to(dev)
        return f"rank {self.rank}/{self.world} ready"

    def logits(self, hidden):
        """hidden [T, H] -> fp32 logits [T, V] with the full (unsharded) lm_head on rank 0."""
        with torch.inference_mode():
            h = hidden.to(self.head.device, self.head.dtype)
            return (h @ self.head.T).float().cpu()

    def _apply(self, ops: list[tuple]) -> None:
        with torch.inference_mode():  # the caches hold inference tensors
            self._apply_ops(ops)

    def _apply_ops(self, ops: list[tuple]) -> None:
        for op in ops:
            kind = op[0]
            if kind == "fork":
                _, src, dst = op
                if src in self.caches:
                    self.caches[dst] = copy.deepcopy(self.caches[src])
            elif kind == "free":
                self.caches.pop(op[1], None)
            elif kind == "commit":
                # keep rows [0, keep) as they are, then ``rows`` (old row indices minus ``keep``):
                # the engine's own KV commit, replayed on this rank's shard
                _, cid, keep, rows = op
                commit_kv(self.caches[cid], keep, rows)

    def forward(self, ops: list[tuple], cid: int, ids, pos, mask):
        """Apply queued cache ops, then one forward on cache ``cid``; rank 0 returns hidden [T, H]."""
        from transformers import DynamicCache

        self._apply(ops)
        cache = self.caches.get(cid)
        if cache is None:
            cache = self.caches[cid] = DynamicCache(config=self.model.config)
        dev = next(self.model.parameters()).device
        with torch.inference_mode():
            out = self.model.model(
                input_ids=ids.to(dev),
                position_ids=pos.to(dev),
                attention_mask=None if mask is None else mask.to(dev, resolve_dtype(self.dtype, dev.type)),
                use_cache=True,
                **{cache_kwarg(self.model.model): cache},
            )
        return out.last_hidden_state[0].cpu() if self.rank == 0 else None

    def sync(self, ops: list[tuple]) -> int:
        """Apply ops without a forward (frees on shutdown); returns the number of live caches."""
        self._apply(ops)
        return len(self.caches)


class _Rows:
    """The one 'layer' of a ShadowCache: keys/values are [1, 1, S, 1] worker row indices."""

    def __init__(self, rows: torch.Tensor):
        self.keys = rows
        self.values = rows.clone()


class ShadowCache:
    """Replica-side stand-in for a worker KV cache (see the module docstring)."""

    def __init__(self, group: "TPGroup", length: int = 0):
        self.group = group
        self.cid = group.new_id()
        self.synced = length  # rows the workers hold for this id
        self.layers = [_Rows(torch.arange(length, dtype=torch.float64).view(1, 1, -1, 1))]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.layers[0].keys.shape[2])

    def crop(self, n: int) -> None:
        if n > 0:
            raise ValueError("crop takes a negative count")
        if n:
            layer = self.layers[0]
            layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]

    def rows(self) -> list[int]:
        return [int(x) for x in self.layers[0].keys.view(-1).tolist()]

    def __deepcopy__(self, memo):
        clone = ShadowCache.__new__(ShadowCache)
        clone.group, clone.cid, clone.synced = self.group, self.group.new_id(), self.synced
        clone.layers = [_Rows(self.layers[0].keys.clone())]
        self.group.queue(("fork", self.cid, clone.cid))
        return clone

    def __del__(self):
        try:
            self.group.queue(("free", self.cid))
        except Exception:  # interpreter shutdown
            pass


class TPGroup:
    """The replica's handle on N TP worker actors."""

    def __init__(self, workers: list, local: bool = False):
        self.workers = workers
        self.local = local  # workers are plain objects in this process (tests of the cache protocol)
        self._ids = itertools.count(1)
        self._pending: list[tuple] = []
        self._queue_lock = threading.Lock()
        self._forward_lock = threading.Lock()

    def new_id(self) -> int:
        return next(self._ids)

    def queue(self, op: tuple) -> None:
        with self._queue_lock:
            self._pending.append(op)

    def _drain(self) -> list[tuple]:
        with self._queue_lock:
            ops, self._pending = self._pending, []
        return ops

    def forward(self, input_ids, position_ids, mask, cache: ShadowCache) -> torch.Tensor:
        if not isinstance(cache, ShadowCache):
            raise TypeError("a tensor-parallel target needs caches from its own new_cache()")
        with self._forward_lock:
            rows = cache.rows()
            if rows != list(range(cache.synced)):
                keep = 0
                while keep < len(rows) and rows[keep] == keep:
                    keep += 1
                self.queue(("commit", cache.cid, keep, [r - keep for r in rows[keep:]]))
            ops = self._drain()
            if self.local:
                outs = [w.forward(ops, cache.cid, input_ids, position_ids, mask) for w in self.workers]
            else:
                import ray

                outs = ray.get([w.forward.remote(ops, cache.cid, input_ids, position_ids, mask) for w in self.workers])
        total = len(rows) + input_ids.shape[1]
        cache.synced = total
        fresh = torch.arange(total, dtype=torch.float64).view(1, 1, -1, 1)
        cache.layers[0].keys, cache.layers[0].values = fresh, fresh.clone()
        return outs[0]

    def live_caches(self) -> list[int]:
        """Number of KV caches each rank holds after applying queued frees (leak checks)."""
        ops = self._drain()
        if self.local:
            return [w.sync(ops) for w in self.workers]
        import ray

        return ray.get([w.sync.remote(ops) for w in self.workers])

    def shutdown(self) -> None:
        if self.local:
            self.workers = []
            return
        import ray

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        self.workers = []


class TPTarget(Target):
    """A Target whose forward runs on a TP group and whose caches are shadows."""

    group: TPGroup | None = None
    remote_head: bool = False  # logits computed on rank 0's accelerator

    def new_cache(self):
        return ShadowCache(self.group)

    def hidden(self, input_ids, position_ids, mask, cache) -> torch.Tensor:
        return self.group.forward(input_ids, position_ids, mask, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.remote_head:
            import ray

            return ray.get(self.group.workers[0].logits.remote(hidden))
        return super().logits(hidden)


class _HeadOnly(torch.nn.Module):
    """Config + lm_head of a checkpoint: what the replica needs to turn hidden states into logits."""

    def __init__(self, config, generation_config, weight: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        if weight is None:  # logits run remotely; keep one parameter so Target.dtype works
            self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)
            return
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)
        self.lm_head.requires_grad_(False)


def load_lm_head(path: Path, dtype: torch.dtype) -> torch.Tensor:
    """Read ``lm_head.weight`` (or the tied embedding) from a safetensors checkpoint, alone."""
    import json

    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    files = (
        sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.is_file()
        else sorted(path.glob("*.safetensors"))
    )
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                if name in st.keys():
                    return st.get_tensor(name).to(dtype)
    raise FileNotFoundError(f"no lm_head / embed_tokens weight in {path}")


def resolve_model_path(model: str | None) -> Path:
    from toolspec_core.model.embedded import embedded_model_dir

    return embedded_model_dir() if model in (None, "", "embedded") else Path(model)


def start_tp_target(
    model: str | None,
    tp_size: int,
    dtype: str = "float32",
    device: str = "cpu",
    worker_num_cpus: float = 0,
    worker_num_gpus: float = 0,
    threads: int | None = None,
) -> TPTarget:
    """Start ``tp_size`` worker actors (needs a running Ray), shard the model, return the target."""
    import ray
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from toolspec_core.model.target import _eos_ids

    path = resolve_model_path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an HF model directory (no config.json)")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # all ranks on this node: gloo/nccl rendezvous on loopback, and LOCAL_SIZE == world size
    addr, port = "127.0.0.1", _free_port()
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=worker_num_cpus, num_gpus=worker_num_gpus, scheduling_strategy=here)(TPWorker)
    workers = [actor.remote(str(path), r, tp_size, addr, port, dtype, device) for r in range(tp_size)]
    ray.get([w.setup.remote(threads) for w in workers])
    config = AutoConfig.from_pretrained(str(path))
    try:
        gen = GenerationConfig.from_pretrained(str(path))
    except OSError:
        gen = None
    remote_head = device != "cpu"
    torch_dtype = resolve_dtype(dtype, device)
    head = _HeadOnly(config, gen, None if remote_head else load_lm_head(path, torch_dtype), torch_dtype)
    tok = AutoTokenizer.from_pretrained(str(path))
    target = TPTarget(
        model=head,
        tokenizer=tok,
        name=path.name,
        eos_ids=_eos_ids(head, tok),
        max_context=getattr(config, "max_position_embeddings", None) or 32768,
    )
    target.group = TPGroup(workers)
    target.remote_head = remote_head
    return target
