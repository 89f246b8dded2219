"""Ragged batched attention: one write and one attention call a layer for the rows of every
sequence, over the KV block pool.

The per-sequence loop of :func:`~toolspec_core.model.batch_forward.batched_forward` costs a cache
write, a mask copy and an SDPA call per sequence per layer -- at B = 64 about 1,800 small kernel
launches a step, which is what an accelerator's step time is made of at these sizes. Here a step
is described once, on the host (:func:`plan_step`: the new rows' pool slots, each sequence's block
table padded, its cached and new row counts and its tree; one host-to-device copy), the mask and
the KV read index are built from it once on the device (:func:`step_mask`, :func:`kv_index`), and
every layer does ONE ``index_copy_`` of all new K / V rows into the pool and ONE attention call
(a step with prefill chunks: one more per chunk of over :data:`GRID_ROWS` rows, so the decoding
sequences' query grid is not padded to a chunk's hundreds of rows).

The kernel is padded SDPA: queries are laid out as a grid [B, H_kv, g * n, D] (the ``g`` query
heads sharing a KV head stacked as in :func:`~toolspec_core.model.batch_forward.segment_attention`;
``n`` the most rows any sequence has), and each sequence's K / V are read through its block table
into [B, H_kv, S, D] (``S`` its most KV rows) with one ``index_select`` a layer. That read is a
copy of the step's KV -- the fallback the paged kernels (FlashInfer's paged prefill with a custom
mask, FlexAttention with a block mask made from the tables) avoid by reading the blocks in place;
it is what runs on every torch build and device, and it is exact: padded query rows are thrown
away and padded KV columns are masked (they read the pool's scratch block, whose rows are always
finite, so a masked column adds exactly zero).

Masks: a prefill chunk is causal, a single row sees its whole cache, a root chain with a draft
tree sees the cache and the ancestors its :class:`~toolspec_core.model.batch_forward.Segment`'s
``parents`` give (every tree of the step at once; no float mask is made on this path), or, for
a segment that brings a mask of its own, that mask's last ``n`` columns (every row sees the
whole cache).

Which path runs is decided by the step runner (:mod:`toolspec_core.model.step_runner`) from the
target's ``attention`` setting (:data:`ATTENTION`): "per_sequence" (the loop), "ragged", or
"auto" (ragged on CUDA, per_sequence elsewhere). The CPU keeps the loop: there
a launch costs nothing and the padded read is extra work -- one padded SDPA call took 1.6-9x the
loop's time at B = 4-16 (``benchmarks/results/measurements/batch-attention-cpu-epyc-0f934ae.json``,
with its command; the study's code is in git at ``5afc378``), and FlexAttention, uncompiled on the CPU, 15-83x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolspec_core.model.batch_forward import Segment, decoder_layers, parents_visible
from toolspec_core.model.block_pool import BlockPool

ATTENTION = ("auto", "per_sequence", "ragged")


def resolve_attention(name: str, device) -> str:
    """The attention path a target named ``name`` runs on ``device``: "per_sequence" or "ragged"."""
    if name not in ATTENTION:
        raise ValueError(f"unknown attention {name!r}; choose one of: {', '.join(ATTENTION)}")
    if name == "auto":
        return "ragged" if torch.device(device).type == "cuda" else "per_sequence"
    return name


GRID_ROWS = 64  # a segment with more rows (a prefill chunk) gets an attention call of its own


@dataclass
class Group:
    """The sequences of one attention call, on the device: ``B`` of them, each with at most ``n``
    new rows and ``S`` KV rows (cached + new).

    ``tables`` [B, T] block tables (T * block_tokens >= S), padded with the scratch block;
    ``prefix`` / ``new`` [B] cached and new rows per sequence; ``tree`` [B] 1 where the new rows
    see each other as ``vis`` [B, t, t] says (1: row i sees row j), 0 where they are causal;
    ``rows`` [B * n] the input row of each grid row, or None when the input rows are the grid (a
    captured step, :mod:`toolspec_core.model.graphs`); ``out`` [m] the grid row of each of the
    group's real rows, ``inputs`` [m] their input rows (None: all input rows, in order)."""

    tables: torch.Tensor
    prefix: torch.Tensor
    new: torch.Tensor
    tree: torch.Tensor
    vis: torch.Tensor
    rows: torch.Tensor | None
    out: torch.Tensor
    inputs: torch.Tensor | None
    B: int
    n: int
    S: int


@dataclass
class RaggedPlan:
    """One step on the device: ``ids`` / ``pos`` / ``slots`` [N] each input row's token, position and
    the pool slot its K / V go to, and the attention calls (``groups``) that cover the rows."""

    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    groups: list[Group]


GROUP_TENSORS = ("tables", "prefix", "new", "tree", "vis", "rows", "out", "inputs")


def plan_step(segments: list[Segment], pool: BlockPool, grid: tuple[int, int, int] | None = None) -> RaggedPlan:
    """One step's :class:`RaggedPlan`, built on the host (CPU tensors; :func:`to_device` moves it).

    Segments of at most :data:`GRID_ROWS` rows share one call; a longer one (a prefill chunk)
    has its own, so the others' query grid is not padded to its rows. ``grid`` (B, n, S) asks
    for the input rows to be one call's [B, n] grid itself, at that fixed shape (a captured
    decode step; each at least what the segments need): a padded row reads token 0 at
    position 0 and writes the scratch slot, a padded sequence has no rows (every column is
    masked), and the tables are ``S / block_tokens`` wide."""
    lens = [len(s) for s in segments]
    ids = torch.cat([s.ids for s in segments])  # [N]
    pos = torch.cat([s.pos for s in segments])  # [N]
    slots = torch.cat([s.cache.host_slots[s.cache.length : s.cache.length + k] for s, k in zip(segments, lens)])
    starts = torch.tensor([0] + lens[:-1], dtype=torch.long).cumsum(0).tolist()
    if grid is not None:
        group = _group(segments, starts, pool, grid)
        group.inputs = None  # the input rows are the grid
        gi = torch.zeros(grid[0] * grid[1], dtype=torch.long)
        gp = torch.zeros_like(gi)
        gs = torch.full_like(gi, pool.scratch_slot)
        gi[group.out], gp[group.out], gs[group.out] = ids, pos, slots
        return RaggedPlan(gi, gp, gs, [group])
    small = [i for i, k in enumerate(lens) if k <= GRID_ROWS]
    parts = ([small] if small else []) + [[i] for i, k in enumerate(lens) if k > GRID_ROWS]
    groups = [_group([segments[i] for i in part], [starts[i] for i in part], pool) for part in parts]
    if len(groups) == 1:
        groups[0].inputs = None  # one call covers every row, in order
    return RaggedPlan(ids, pos, slots, groups)


def _group(segments: list[Segment], starts: list[int], pool: BlockPool, grid: tuple | None = None) -> Group:
    """The host tensors of one call over ``segments``, whose rows start at input rows ``starts``."""
    bt = pool.block_tokens
    lens = [len(s) for s in segments]
    b = len(segments)
    prefix = torch.tensor([s.cache.length for s in segments], dtype=torch.long)  # [b]
    new = torch.tensor(lens, dtype=torch.long)  # [b]
    B, n, S = grid if grid is not None else (b, max(lens), int((prefix + new).max()))
    tables = torch.full((B, -(-S // bt)), pool.scratch_block, dtype=torch.long)
    for i, s in enumerate(segments):
        used = -(-(s.cache.length + lens[i]) // bt)
        tables[i, :used] = s.cache.host_table[:used]
    trees = [i for i, s in enumerate(segments) if s.tree]
    t = n if grid is not None else max([lens[i] for i in trees], default=1)  # a captured shape is fixed
    vis = torch.zeros((B, t, t), dtype=torch.long)
    tree = torch.zeros(B, dtype=torch.long)
    tree[trees] = 1
    if trees:  # every tree's visibility from its parents, all at once
        flat: list[int] = []
        for i in trees:
            flat += segments[i].parents
        seen = torch.from_numpy(parents_visible(flat, [lens[i] for i in trees]))  # [D, m, m]
        m = seen.shape[1]
        vis[trees, :m, :m] = seen.long()
    j = torch.arange(n)
    real = j[None] < new[:, None]  # [b, n]
    out = (torch.arange(b)[:, None] * n + j[None])[real]  # [m] grid row of each real row
    first = torch.tensor(starts, dtype=torch.long)[:, None] + j[None]  # [b, n] input row of each grid row
    inputs = first[real]  # [m]
    rows = None if grid is not None else torch.where(real, first, 0).reshape(-1)  # [B*n]
    if B > b:
        pad = torch.zeros(B - b, dtype=torch.long)
        prefix, new = torch.cat([prefix, pad]), torch.cat([new, pad])
    return Group(tables, prefix, new, tree, vis, rows, out, inputs, B, n, S)


def to_device(plan: RaggedPlan, device) -> RaggedPlan:
    """``plan`` (host tensors) on ``device``: one packed copy, then views of it."""
    parts = [plan.ids, plan.pos, plan.slots] + [
        getattr(g, f) for g in plan.groups for f in GROUP_TENSORS if getattr(g, f) is not None
    ]
    flat = torch.cat([p.reshape(-1) for p in parts]).to(device, non_blocking=True)
    o = 0

    def take(p: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal o
        if p is None:
            return None
        v = flat[o : o + p.numel()].view(p.shape)
        o += p.numel()
        return v

    ids, pos, slots = take(plan.ids), take(plan.pos), take(plan.slots)
    groups = [Group(*(take(getattr(g, f)) for f in GROUP_TENSORS), g.B, g.n, g.S) for g in plan.groups]
    return RaggedPlan(ids, pos, slots, groups)


def step_mask(group: Group, g: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, g * n, S] additive mask of a call's query grid (built once a step): each real row
    sees its sequence's cached rows and, among the new ones, its causal predecessors or its
    tree's ancestors; columns past a sequence's rows are masked, and so is all of a padded row."""
    dev = group.prefix.device
    col = torch.arange(group.S, device=dev)[None, None, :]  # [1, 1, S]
    row = torch.arange(group.n, device=dev)[None, :, None]  # [1, n, 1]
    rel = col - group.prefix[:, None, None]  # [B, 1, S] the column's place among the new rows (< 0: cached)
    real = row < group.new[:, None, None]  # [B, n, 1]
    causal = (rel <= row) & real  # [B, n, S]
    t = group.vis.shape[-1]
    ancestors = group.vis[:, row[0, :, 0].clamp(max=t - 1)]  # [B, n, t]
    ancestors = torch.gather(ancestors, 2, rel.clamp(0, t - 1).expand(-1, group.n, -1)).bool()  # [B, n, S]
    tree = ((rel < 0) | (ancestors & (rel >= 0) & (rel < t))) & real
    seen = torch.where(group.tree[:, None, None].bool(), tree, causal)  # [B, n, S]
    mask = torch.where(seen, 0.0, torch.finfo(dtype).min).to(dtype)
    return mask[:, None].expand(-1, g, -1, -1).reshape(group.B, 1, g * group.n, group.S)


def kv_index(group: Group, pool: BlockPool) -> torch.Tensor:
    """[B * S] the pool slot of each sequence's KV rows 0 .. S - 1 through its block table; rows past
    the sequence's own read the scratch slot (masked, and finite)."""
    bt = pool.block_tokens
    col = torch.arange(group.S, device=group.tables.device)  # [S]
    slots = group.tables[:, col // bt] * bt + col % bt  # [B, S]
    inside = col[None] < (group.prefix + group.new)[:, None]
    return torch.where(inside, slots, pool.scratch_slot).reshape(-1)


def grid_attention(q, keys, values, index, mask, group: Group, scale: float) -> torch.Tensor:
    """One call's attention: q [1, H, N, D] (all input rows), ``keys`` / ``values`` [H_kv, slots, D]
    (a pool layer, this step's rows written), ``index`` [B * S] (:func:`kv_index`), ``mask``
    (:func:`step_mask`) -> [B * n, H * D], the grid's rows."""
    h, d = q.shape[1], q.shape[3]
    hkv = keys.shape[0]
    g, B, n, S = h // hkv, group.B, group.n, group.S
    kk = keys.index_select(1, index).view(hkv, B, S, d).transpose(0, 1)  # [B, H_kv, S, D]
    vv = values.index_select(1, index).view(hkv, B, S, d).transpose(0, 1)
    qg = q[0] if group.rows is None else q[0].index_select(1, group.rows)  # [H, B*n, D]
    qg = qg.view(h, B, n, d).transpose(0, 1).reshape(B, hkv, g * n, d)  # [B, H_kv, g*n, D]
    o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=mask, scale=scale)  # [B, H_kv, g*n, D]
    return o.reshape(B, h, n, d).transpose(1, 2).reshape(B * n, h * d)


def ragged_hidden(model: torch.nn.Module, pool: BlockPool, plan: RaggedPlan) -> torch.Tensor:
    """Last-layer hidden states of the plan's input rows, [N, H] (a grid plan: [B * n, H], the padded
    rows' included). Writes the rows' K / V into the pool; moves no cache's length."""
    cfg = model.config
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    masks = [step_mask(gr, g, pool.k.dtype) for gr in plan.groups]  # [B, 1, g*n, S] each
    index = [kv_index(gr, pool) for gr in plan.groups]  # [B*S] each

    def attend(li: int, q, k, v, scale: float) -> torch.Tensor:
        keys, values = pool.k[li], pool.v[li]  # [H_kv, slots, D]
        keys.index_copy_(1, plan.slots, k[0])  # every new row of every sequence, one write
        values.index_copy_(1, plan.slots, v[0])
        if len(plan.groups) == 1:
            gr = plan.groups[0]
            o = grid_attention(q, keys, values, index[0], masks[0], gr, scale)
            return (o if gr.rows is None else o.index_select(0, gr.out))[None]  # [1, N, H*D]
        o = q.new_empty(q.shape[2], q.shape[1] * q.shape[3])  # [N, H*D]
        for gr, ix, m in zip(plan.groups, index, masks):
            o.index_copy_(0, gr.inputs, grid_attention(q, keys, values, ix, m, gr, scale).index_select(0, gr.out))
        return o[None]

    return decoder_layers(model, plan.ids, plan.pos, attend)


def ragged_forward(model: torch.nn.Module, segments: list[Segment], pool: BlockPool) -> torch.Tensor:
    """:func:`~toolspec_core.model.batch_forward.batched_forward` with one write and (but for
    prefill chunks, see :func:`plan_step`) one attention call a layer: hidden states [N, H] of the
    segments' rows, in order; every cache grows by its rows."""
    check_room(segments)
    out = ragged_hidden(model, pool, to_device(plan_step(segments, pool), pool.k.device))
    for s in segments:
        s.cache.advance(len(s))
    return out


def check_room(segments: list[Segment]) -> None:
    """Raise where a segment's rows would run past its block table (what ``PagedKV.write`` checks)."""
    for s in segments:
        if s.cache.length + len(s) > s.cache.capacity:
            raise RuntimeError(
                f"sequence KV of {s.cache.length + len(s)} rows exceeds its {s.cache.capacity} reserved rows"
            )
