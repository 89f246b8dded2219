"""CUDA graphs for decode steps: a step's kernels launched as one replay instead of one by one.

A decode step (no prefill chunk: every sequence brings its root chain, with or without a draft
tree) of a few rows per sequence is launch-bound on an accelerator -- the 0.5B model's step costs
about what the 7B one's does. A graph is captured per bucketed shape (:data:`BATCH_BUCKETS`
running sequences x :data:`ROW_BUCKETS` rows a sequence x a power-of-two KV length, at least
:data:`MIN_KV_BUCKET`) over static input buffers: the step is laid out as the ragged attention's
[B, n] grid itself (:func:`~toolspec_core.model.ragged.plan_step` with ``grid``), copied into the
buffers with one host-to-device copy, and the graph replays
:func:`~toolspec_core.model.ragged.ragged_hidden` over them. Padded rows write the pool's scratch
slot and padded sequences see nothing, so padding never changes a real row. Steps that fit no
bucket, and steps with a prefill chunk, run eager.

Graphs are captured at a shape's first use, or at start-up with :meth:`StepGraphs.warm`. With
``capture=False`` the same static-buffer step runs without a graph (any device): what a CPU test
compares with the eager ragged step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolspec_core.model.batch_forward import Segment
from toolspec_core.model.block_pool import BlockPool
from toolspec_core.model.ragged import Group, RaggedPlan, check_room, plan_step, ragged_hidden

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KV_BUCKET = 256


def bucket(x: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``x``, or None."""
    return next((b for b in buckets if b >= x), None)


def kv_bucket(rows: int, pool: BlockPool) -> int | None:
    """A power of two of at least ``rows`` and :data:`MIN_KV_BUCKET` rows, whole blocks, capped at
    the pool's capacity (no table is longer, so a pool smaller than the next power of two still
    replays its steps); None past the capacity."""
    if rows > pool.capacity_tokens:
        return None
    s = max(MIN_KV_BUCKET, 1 << max(0, rows - 1).bit_length())
    return min(-(-s // pool.block_tokens) * pool.block_tokens, pool.capacity_tokens)


def grid_of(segments: list[Segment], pool: BlockPool) -> tuple[int, int, int] | None:
    """The bucketed (B, n, S) a decode step is replayed at, or None (a prefill chunk, or no bucket)."""
    if any(not s.tree and len(s) > 1 for s in segments):
        return None
    B = bucket(len(segments), BATCH_BUCKETS)
    n = bucket(max(len(s) for s in segments), ROW_BUCKETS)
    S = kv_bucket(max(s.cache.length + len(s) for s in segments), pool)
    return None if B is None or n is None or S is None else (B, n, S)


def _layout(B: int, n: int, S: int, bt: int) -> list[tuple[str, tuple[int, ...]]]:
    """The static buffer's fields and shapes, in order (``out`` last: only its first N are read)."""
    return [
        ("ids", (B * n,)),
        ("pos", (B * n,)),
        ("slots", (B * n,)),
        ("tables", (B, S // bt)),
        ("prefix", (B,)),
        ("new", (B,)),
        ("tree", (B,)),
        ("vis", (B, n, n)),
        ("out", (B * n,)),
    ]


@dataclass
class _Entry:
    flat: torch.Tensor  # [L] long: the static inputs
    plan: RaggedPlan  # views of ``flat``
    out: torch.Tensor | None = None  # [B*n, H] the step's last hidden states (static under a graph)
    graph: object = None


class StepGraphs:
    """The decode steps of ``model`` over ``pool``: static buffers and a graph per grid shape."""

    def __init__(self, model: torch.nn.Module, pool: BlockPool, capture: bool = True):
        self.model, self.pool, self.capture = model, pool, capture
        self.entries: dict[tuple[int, int, int], _Entry] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None  # shared: steps replay one at a time
        self.replays = 0

    def run(self, segments: list[Segment]) -> torch.Tensor | None:
        """Hidden states [N, H] of a decode step's rows, in order (every cache grows by its rows), or
        None where the step has no graph shape (the caller runs it eager). Every cache is a block
        table of ``pool`` (the step runner checks)."""
        grid = grid_of(segments, self.pool)
        if grid is None:
            return None
        check_room(segments)
        host = plan_step(segments, self.pool, grid)
        entry = self.entries.get(grid)
        if entry is None:
            entry = self._entry(grid)
        entry.flat.copy_(self._pack(host, grid), non_blocking=True)
        if entry.graph is None:
            if self.capture:
                self._capture(entry)  # its warm-up ran the step; the replay below runs it again, the same
            else:
                entry.out = ragged_hidden(self.model, self.pool, entry.plan)
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
        m = host.groups[0].out.shape[0]  # N: the real rows
        out = entry.out.index_select(0, entry.plan.groups[0].out[:m])  # [N, H]
        for s in segments:
            s.cache.advance(len(s))
        return out

    def warm(self, grids: list[tuple[int, int, int]]) -> None:
        """Capture these (B, n, S) shapes now (start-up), over padding alone: only the scratch slot is written."""
        for grid in grids:
            if grid not in self.entries:
                entry = self._entry(grid)
                entry.flat.copy_(self._blank(grid))
                if self.capture:
                    self._capture(entry)

    def _entry(self, grid: tuple[int, int, int]) -> _Entry:
        B, n, S = grid
        layout = _layout(B, n, S, self.pool.block_tokens)
        flat = torch.zeros(sum(_numel(shape) for _, shape in layout), dtype=torch.long, device=self.pool.k.device)
        views, o = {}, 0
        for name, shape in layout:
            views[name] = flat[o : o + _numel(shape)].view(shape)
            o += _numel(shape)
        group = Group(
            views["tables"],
            views["prefix"],
            views["new"],
            views["tree"],
            views["vis"],
            None,
            views["out"],
            None,
            B,
            n,
            S,
        )
        entry = _Entry(flat, RaggedPlan(views["ids"], views["pos"], views["slots"], [group]))
        self.entries[grid] = entry
        return entry

    def _pack(self, host: RaggedPlan, grid: tuple[int, int, int]) -> torch.Tensor:
        """A grid plan's host tensors as one flat long tensor in :func:`_layout`'s order."""
        B, n, _ = grid
        g = host.groups[0]
        out = torch.zeros(B * n, dtype=torch.long)
        out[: g.out.shape[0]] = g.out
        parts = [host.ids, host.pos, host.slots, g.tables, g.prefix, g.new, g.tree, g.vis, out]
        return torch.cat([p.reshape(-1) for p in parts])

    def _blank(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """A step of padding alone: every row writes the scratch slot, every table is the scratch block."""
        B, n, S = grid
        bt = self.pool.block_tokens
        parts = [
            torch.zeros(2 * B * n, dtype=torch.long),
            torch.full((B * n,), self.pool.scratch_slot, dtype=torch.long),
            torch.full((B * (S // bt),), self.pool.scratch_block, dtype=torch.long),
            torch.zeros(3 * B + B * n * n + B * n, dtype=torch.long),
        ]
        return torch.cat(parts)

    def _capture(self, entry: _Entry) -> None:
        """Run the step once on a side stream (lazy kernel set-up), then capture it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ragged_hidden(self.model, self.pool, entry.plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            entry.out = ragged_hidden(self.model, self.pool, entry.plan)
        entry.graph = graph


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
