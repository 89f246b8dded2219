"""The step runner: the one place that decides how a verify step runs, for every target.

A step is one :class:`~toolspec_core.model.step_plan.StepPlan` (the scheduler's segments, which
rows' argmax / logits / hidden states it needs, and the greedy trees to walk where the argmax is)
and one :class:`StepOutput`. Three parts, each in one place:

- :meth:`StepRunner.hidden` -- the forward. Which path runs is fixed when the runner is made,
  from the model, the pool and the target's settings, never from the kinds of caches a step
  brings: a captured CUDA graph where the step's shape has a bucket (:mod:`~toolspec_core.model.graphs`),
  else the eager ragged attention over the block pool (:mod:`~toolspec_core.model.ragged`), or,
  where it measures faster (the CPU), the per-sequence loop (:mod:`~toolspec_core.model.batch_forward`);
  a family the batched forward does not cover runs HF's own forward per sequence, and a runner
  without a pool (sequences with caches of their own: a scheduler made without one) the
  per-sequence loop.
- the head (``head``): logits of the logit rows, their argmax and the full rows asked for. The
  default is the model's ``lm_head``; a tensor-parallel rank passes its vocabulary-parallel head
  (argmax and rows gathered over the ranks).
- :func:`answer` -- the greedy walks of the asked-for trees on the device that holds the argmax
  (:mod:`~toolspec_core.model.device_walk`) and the argmax of the rows the host reads, in one copy
  back. Targets without a forward (scripted, replay) call it with their own argmax.

The single-device target (:class:`~toolspec_core.model.target.Target`) and each tensor-parallel
rank (``deployments/tp/worker.py``) run the same :class:`StepRunner`; the scripted and replay
targets produce an argmax and call :func:`answer`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from toolspec_core.model import device_walk
from toolspec_core.model.batch_forward import Segment, batched_forward, supports_batched, widen
from toolspec_core.model.ragged import ragged_forward, resolve_attention
from toolspec_core.model.step_plan import StepPlan


@dataclass
class StepOutput:
    """What one verify forward gives back.

    ``choice``: the argmax of each logit index the host reads (``StepPlan.logits.need``), None at
    the others; None when none was asked for. ``walks``: per walked tree, ``[L, token, path...]``
    (:func:`~toolspec_core.model.device_walk.device_walk`'s row; read with
    :func:`~toolspec_core.model.device_walk.read_walks`). ``logits`` [K, V] fp32: the full rows,
    logit row ``j`` at ``index[j]``. ``hidden`` [len(hidden_rows), H]. ``handover_s``: the time
    the step's plan took to reach every rank (a tensor-parallel target; 0 elsewhere)."""

    choice: list[int | None] | None
    walks: list[list[int]]
    logits: torch.Tensor | None
    index: dict[int, int]
    hidden: torch.Tensor | None
    handover_s: float = 0.0

    def rows(self, start: int, n: int) -> torch.Tensor | None:
        """Logits [n, V] of logit rows ``start .. start + n``, or None where they were not kept."""
        if self.logits is None:
            return None
        at = self.index.get(start)
        if at is None:
            return None
        return self.logits[at : at + n]  # a sequence's rows are asked for together, in order


Head = Callable[[torch.Tensor, list[int], bool], tuple[torch.Tensor | None, torch.Tensor | None]]


def logits_head(logits: Callable[[torch.Tensor], torch.Tensor]) -> Head:
    """A head from a function hidden [M, H] -> logits [M, V] fp32 (a target's ``logits``, so the
    rows a step scores and any other caller's go through the same one) -> (argmax [M] long
    or None, full rows [K, V] fp32)."""

    def head(picked: torch.Tensor, full_rows: list[int], argmax: bool):
        with torch.inference_mode():
            out = logits(picked)  # [M, V]
        choice = torch.argmax(out, -1) if argmax and out.shape[0] else None
        return choice, (out[full_rows] if full_rows else None)

    return head


def lm_head(model: torch.nn.Module) -> Head:
    """The default head: ``model.lm_head`` over the logit rows."""
    return logits_head(lambda h: model.lm_head(h).float())


PATHS = ("hf", "per_sequence", "ragged")


def choose_path(model: torch.nn.Module, pool, attention: str) -> str:
    """The forward a runner over ``model`` and ``pool`` runs (see the module docstring)."""
    if not supports_batched(model):
        return "hf"
    if pool is None:
        return "per_sequence"
    return resolve_attention(attention, next(model.parameters()).device)


class StepRunner:
    """Runs the steps of one model over one block pool (None: caches of their own).

    ``attention`` / ``cuda_graphs``: see :class:`~toolspec_core.model.target.Target`; ``head``:
    see :func:`lm_head` (the default). ``path``: what :meth:`hidden` runs, one of :data:`PATHS`."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool=None,
        attention: str = "auto",
        cuda_graphs: bool = False,
        head: Head | None = None,
        capture: bool = True,
    ):
        self.model, self.pool = model, pool
        self.path = choose_path(model, pool, attention)
        self.head = head or lm_head(model)
        self.graphs = None
        if cuda_graphs and self.path == "ragged":
            from toolspec_core.model.graphs import StepGraphs

            self.graphs = StepGraphs(model, pool, capture=capture)
        self.steps = {"graph": 0, "ragged": 0, "per_sequence": 0, "hf": 0}  # steps run by each path

    def hidden(self, segments: list[Segment]) -> torch.Tensor:
        """Last-layer hidden states [N, H] of every segment's rows, in order; every cache grows by its rows."""
        if self.path == "hf":
            self.steps["hf"] += 1
            dtype = next(self.model.parameters()).dtype
            outs = [hf_hidden(self.model, s.ids[None], s.pos[None], s.attn_mask(dtype), s.cache.hf) for s in segments]
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        if self.path == "per_sequence":
            self.steps["per_sequence"] += 1
            return batched_forward(self.model, segments)
        check_pool(segments, self.pool)
        if self.graphs is not None:
            out = self.graphs.run(segments)
            if out is not None:
                self.steps["graph"] += 1
                return out
        self.steps["ragged"] += 1
        return ragged_forward(self.model, segments, self.pool)

    def run(self, plan: StepPlan, reply: bool = True) -> StepOutput | None:
        """One step: forward, head, walks (``reply`` False: a rank that does not answer -- its
        share of the forward and the head's collectives only)."""
        hidden = self.hidden(plan.segments)  # [N, H]
        rows = plan.logits.rows
        picked = hidden if len(rows) == hidden.shape[0] else hidden[rows]  # [M, H]
        choice, full = self.head(picked, plan.logits.full, plan.wants_argmax)
        if not reply:
            return None
        return answer(plan, choice, full, hidden[plan.hidden_rows] if plan.hidden_rows else None)


def check_pool(segments: list[Segment], pool) -> None:
    """Every segment's cache is a block table of ``pool`` (the pool owns every KV row of a step)."""
    for s in segments:
        if getattr(s.cache, "pool", None) is not pool:
            raise RuntimeError("a sequence's KV is not in the step's block pool: caches are opened by the pool")


def answer(plan: StepPlan, choice: torch.Tensor | None, full: torch.Tensor | None, hidden) -> StepOutput:
    """The step's answer from its argmax ``choice`` [M] (long, wherever the head left it): the
    asked-for greedy walks run there and the argmax of ``plan.logits.need`` comes back with them,
    in one copy; ``full`` [K, V] (the full rows) and ``hidden`` are passed through."""
    index = {j: i for i, j in enumerate(plan.logits.full)}
    if choice is None or not plan.wants_argmax:
        return StepOutput(None, [], full, index, hidden)
    walks, picked = device_walk.accept_rows(choice, plan.walk, plan.logits.need)
    out: list[int | None] = [None] * len(plan.logits.rows)
    for j, c in zip(plan.logits.need, picked):
        out[j] = c
    return StepOutput(out, walks, full, index, hidden)


def hf_hidden(model: torch.nn.Module, input_ids, position_ids, mask, hf_cache) -> torch.Tensor:
    """One sequence through HF's own forward over HF's own cache (the reference the batched
    forward is tested against, and the path of the families it does not cover):
    input_ids/position_ids [1, T]; mask [1, 1, T, S] additive or None (causal). Returns hidden
    states [T, H] on the model's device; the cache grows by T rows."""
    dev = next(model.parameters()).device
    if mask is not None:
        mask = widen(mask, hf_cache.get_seq_length())  # HF's forward takes the cached prefix's columns too
    if dev.type != "cpu":
        input_ids, position_ids = input_ids.to(dev, non_blocking=True), position_ids.to(dev, non_blocking=True)
        mask = None if mask is None else mask.to(dev, non_blocking=True)
    with torch.inference_mode():
        out = model.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            **{cache_kwarg(model.model): hf_cache},
        )
    return out.last_hidden_state[0]


def cache_kwarg(core: torch.nn.Module) -> str:
    """Name of the KV-cache argument of an HF decoder's ``forward``: ``cache`` from transformers 5.20
    (which still accepts the old name until 5.40), ``past_key_values`` before, as on images we do
    not pin (a GPU machine's). Passing the wrong one silently runs without a cache."""
    return _cache_kwarg_of(type(core))


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
