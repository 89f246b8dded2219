"""One rank's shard of an HF checkpoint, and nothing more, in the rank's memory.

The model is built on the meta device (no memory), its vocabulary ends are swapped for
vocabulary-parallel ones (each rank holds ``V / TP`` rows of the embedding and of the output head),
DeepSpeed AutoTP shards the decoder's linears (column-parallel q / k / v / gate / up, row-parallel
o / down with an all-reduce), ``init_inference`` turns the meta tensors into empty ones on the
rank's device, and every parameter is then filled from the safetensors files with
``safe_open(...).get_slice``: a rank reads exactly its slice of each tensor, so its peak memory is
its shard plus one tensor, never the whole checkpoint.

Why the vocabulary ends are ours and not AutoTP's: AutoTP keeps the embedding whole on every rank
and splits the head along the hidden size, which all-reduces full ``[rows, V]`` logits every
step. Split along the vocabulary, the head's logits stay on their rank: the argmax of a row is
reduced from one (value, index) pair per rank, and only the few rows a sampled or constrained
sequence reads are gathered in full (:func:`vocab_argmax`, :func:`gather_rows`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a ``vocab``-row table that ``rank`` holds (near-equal, in rank order)."""
    per = -(-vocab // world)
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


class VocabParallelEmbedding(torch.nn.Module):
    """The rows ``[lo, hi)`` of the embedding: ids outside them look up zeros, and the ranks'
    partial embeddings are summed (each id has exactly one owner, so the sum is exact)."""

    def __init__(self, lo: int, hi: int, hidden: int, dtype: torch.dtype, group=None):
        super().__init__()
        self.lo, self.hi, self.group = lo, hi, group
        self.weight = torch.nn.Parameter(torch.empty(hi - lo, hidden, dtype=dtype, device="meta"), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)  # [B, N]
        out = F.embedding(torch.where(mine, ids - self.lo, 0), self.weight)  # [B, N, H]
        out = out * mine[..., None].to(out.dtype)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(torch.nn.Module):
    """The rows ``[lo, hi)`` of the output head: ``forward`` gives this rank's logits [n, hi - lo]."""

    def __init__(self, lo: int, hi: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.lo, self.hi = lo, hi
        self.weight = torch.nn.Parameter(torch.empty(hi - lo, hidden, dtype=dtype, device="meta"), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()


def vocab_argmax(local: torch.Tensor, lo: int, group=None) -> torch.Tensor:
    """Global argmax [n] (long) of rows whose logits are split by vocabulary: local [n, V_r] holds
    columns ``lo ..``. Each rank offers its best (value, index); the highest value wins, ties going
    to the lower index -- what ``torch.argmax`` over the whole row returns."""
    val, idx = local.max(-1)  # [n] each; max returns the first maximal index
    idx = idx + lo
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return idx
    pair = torch.stack([val, idx.to(val.dtype)])  # [2, n]; float32 holds indices < 2**24 exactly
    pairs = [torch.empty_like(pair) for _ in range(world)]
    dist.all_gather(pairs, pair, group=group)
    vals = torch.stack([p[0] for p in pairs])  # [world, n]
    ids = torch.stack([p[1] for p in pairs]).long()  # [world, n]
    best = vals.max(0).values  # [n]
    # lowest index among the ranks that reach the best value
    cand = torch.where(vals == best, ids, torch.iinfo(torch.long).max)
    return cand.min(0).values


def gather_rows(local: torch.Tensor, group=None) -> torch.Tensor:
    """Full logits [k, V] of rows split by vocabulary (local [k, V_r]), on every rank."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return local
    sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([local.shape[1]], device=local.device), group=group)
    width = int(max(s.item() for s in sizes))
    padded = F.pad(local, (0, width - local.shape[1]))
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:, : int(s.item())] for p, s in zip(parts, sizes)], 1)


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_header(f: Path) -> tuple[int, dict]:
    """(offset of the data, {name: {"dtype", "shape", "data_offsets"}}) of one safetensors file."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        head = json.loads(fh.read(n))
    head.pop("__metadata__", None)
    return 8 + n, head


def tensor_files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    out: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: f for k in safetensors_header(f)[1]})
    if not out:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    return out


def read_slice(
    fd: int, base: int, meta: dict, dim: int | None = None, lo: int = 0, hi: int = 0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A tensor of a safetensors file, or its rows ``[lo, hi)`` along ``dim``, read with ``pread``;
    straight into ``out`` when that is a CPU tensor of the same dtype and the rows are contiguous.

    Read, not memory-mapped: pages of a mapped checkpoint count in the process's resident memory
    while mapped, so a rank that maps the whole file looks (and, under memory pressure, is) as
    big as the checkpoint. A slice along dim 0 is one contiguous read; along another dim the
    tensor is read whole and narrowed (one tensor at a time: the "plus one layer" of the peak)."""
    dtype = SAFETENSORS_DTYPES[meta["dtype"]]
    shape = list(meta["shape"])
    begin = base + meta["data_offsets"][0]
    item = torch.empty((), dtype=dtype).element_size()
    inner = 1
    for s in shape[1:]:
        inner *= s
    if dim == 0:
        begin += lo * inner * item
        shape[0] = hi - lo
    direct = (
        out is not None
        and dim in (None, 0)
        and out.device.type == "cpu"
        and out.dtype == dtype
        and out.is_contiguous()
        and list(out.shape) == shape
    )
    t = out if direct else torch.empty(shape, dtype=dtype)
    view = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], begin + got)
        if n <= 0:
            raise OSError(f"short read of a checkpoint tensor ({got} of {len(view)} bytes)")
        got += n
    if dim not in (None, 0):
        t = t.narrow(dim, lo, hi - lo)
    if out is not None and not direct:
        with torch.no_grad():
            out.copy_(t.to(out.dtype))
    return t


def shard_offset(module: torch.nn.Module, dim: int, full: int, local: int) -> int:
    """Where a parameter's slice along ``dim`` starts in the full tensor: a vocabulary-parallel
    module's own range, or a DeepSpeed TP layer's partition sizes and index."""
    if isinstance(module, (VocabParallelEmbedding, VocabParallelHead)):
        return module.lo
    sizes = getattr(module, "_partition_sizes", None)
    index = getattr(module, "tp_index", None)
    if sizes is None or index is None or sum(sizes) != full or sizes[index] != local:
        raise ValueError(f"{type(module).__name__}: cannot tell which slice of a {full}-wide dim {dim} it holds")
    return int(sum(sizes[:index]))


def load_slices(model: torch.nn.Module, path: Path, aliases: dict[str, str] | None = None) -> int:
    """Fill every parameter of ``model`` (already sharded, on its device) with its slice of the
    checkpoint at ``path``; returns the bytes read. A parameter whose shape differs from the
    checkpoint's in one dimension is a shard (:func:`shard_offset` says which); ``aliases`` maps a
    parameter name to the checkpoint's (a tied output head reads the embedding)."""
    files = tensor_files(path)
    modules = dict(model.named_modules())
    wanted: dict[Path, list[tuple[str, str]]] = {}
    for name, _ in model.named_parameters():
        src = name if name in files else (aliases or {}).get(name, name)
        if src not in files:
            raise KeyError(f"{name} is not in the checkpoint at {path}")
        wanted.setdefault(files[src], []).append((name, src))
    params = dict(model.named_parameters())
    read = 0
    for f, names in wanted.items():
        base, head = safetensors_header(f)
        fd = os.open(f, os.O_RDONLY)
        try:
            for name, src in names:
                p = params[name]
                meta = head[src]
                full = tuple(meta["shape"])
                if full == tuple(p.shape):
                    t = read_slice(fd, base, meta, out=p.data)
                else:
                    dims = [d for d in range(len(full)) if full[d] != p.shape[d]]
                    if len(full) != p.dim() or len(dims) != 1:
                        raise ValueError(f"{name}: shard shape {tuple(p.shape)} vs checkpoint {full}")
                    d = dims[0]
                    o = shard_offset(modules[name.rsplit(".", 1)[0]], d, full[d], p.shape[d])
                    t = read_slice(fd, base, meta, d, o, o + p.shape[d], out=p.data)
                read += t.numel() * t.element_size()
                del t
        finally:
            os.close(fd)
    return read


def load_shard(path: Path, rank: int, world: int, dtype: torch.dtype, device: str, group=None) -> torch.nn.Module:
    """This rank's shard of the HF causal LM at ``path`` on ``device`` (see the module docstring).
    Needs torch.distributed initialised (any world size) and DeepSpeed."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    core = model.model
    vocab, hidden = core.embed_tokens.weight.shape
    lo, hi = vocab_range(vocab, rank, world)
    core.embed_tokens = VocabParallelEmbedding(lo, hi, hidden, dtype, group)
    model.lm_head = VocabParallelHead(lo, hi, hidden, dtype)
    # AutoTP shards the decoder's linears; init_inference makes the meta tensors empty ones on the device
    core = deepspeed.init_inference(
        core, tensor_parallel={"tp_size": world}, dtype=dtype, replace_with_kernel_inject=False
    ).module
    model.model = core
    dev = torch.device("cpu") if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    model.lm_head.to_empty(device=dev)
    for m in (core, model.lm_head):  # whatever init_inference left on meta (it should leave nothing)
        if any(p.is_meta for p in m.parameters()):
            m.to_empty(device=dev)
    # non-persistent buffers (the rotary frequencies) are not in the checkpoint: compute them again
    with torch.device(dev):
        core.rotary_emb = type(core.rotary_emb)(config=config)
    load_slices(model, path, {"lm_head.weight": "model.embed_tokens.weight"})  # a tied head reads the embedding
    release_free_heap()
    return model


def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc keeps freed mid-size blocks -- the
    loader's temporary tensors -- resident otherwise)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
