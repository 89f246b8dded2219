"""The bench's prompts in one prefix-caching block pool: each prefilled once, untimed, and every
method's decode of it started from the cached blocks.

The harness times the decode phase only (docs and benchmarks/README.md: "What is timed"). A
prompt is run through the pool once (:meth:`PromptPool.warm`, :func:`~toolspec_core.engine.loop.prefill`)
and its full blocks stay pinned (referenced by the harness, so no later allocation evicts them)
until the benchmark is done. A timed decode then goes in two phases on one scheduler
(:meth:`PromptPool.start`): untimed, admission finds each sequence's cached blocks and the steps
prefill the rest of its prompt -- its last partial block, 1 to ``block_tokens`` rows, whose
last row's logits give the first token --, each sequence held at its first token (its
``on_prompt`` future) so none decodes while another still prefills; timed
(:meth:`Started.run`), the decode: the drafters' set-up, then every verify step. Nothing but the
pool holds the prompt's KV, and every method's sequence reads the same cached rows.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import Prompt, prefill
from toolspec_core.engine.scheduler import BatchLimits, Scheduler
from toolspec_core.engine.sequence import DecodeConfig, Sequence
from toolspec_core.engine.stats import GenerationResult

BLOCK_TOKENS = 16


@dataclass
class Started:
    """A scheduler whose sequences have their prompts in the pool and their first token, held
    (:meth:`PromptPool.start`); :meth:`run` is the decode phase."""

    sched: Scheduler
    gate: Future
    cost: CostModel | None

    def run(self) -> None:
        """Release the sequences' first drafts and step to the end (the budget's curve back)."""
        self.sched.cost = self.cost
        self.gate.set_result(None)
        self.sched.run()


class PromptPool:
    """One block pool for a bench run's prompts (``tokens`` rows: every prompt of a benchmark plus
    the largest group's sequences); a target without a pool (a family the batched forward does
    not cover) prefills each prompt again in the untimed phase of every decode. ``overlap``: the
    schedulers' (:class:`~toolspec_core.engine.scheduler.Scheduler`; None: the target's default)."""

    def __init__(self, target, tokens: int, overlap: bool | None = None):
        self.target, self.overlap = target, overlap
        self.pool = target.block_pool(tokens, BLOCK_TOKENS, prefix_caching=True)
        self.prompts: dict[str, Prompt] = {}
        self._pinned: dict[str, list[int]] = {}

    def warm(self, key: str, prompt_ids: list[int]) -> Prompt:
        """``prompt_ids`` run through the pool once (untimed) and its full blocks pinned; its
        :class:`~toolspec_core.engine.loop.Prompt` (last state, prefill seconds). Raises
        :class:`~toolspec_core.errors.ToolSpecError` for a prompt over the target's limits."""
        if key not in self.prompts:
            self.prompts[key] = prefill(self.target, prompt_ids, self.pool)
            if self.pool is not None:
                self._pinned[key] = self.pool.match(list(prompt_ids), len(prompt_ids))[0]
        return self.prompts[key]

    def clear(self) -> None:
        """Unpin every prompt (a benchmark's runs are done): their blocks become evictable."""
        for blocks in self._pinned.values():
            self.pool.release(blocks)
        self._pinned.clear()
        self.prompts.clear()

    def start(self, seqs: list[Sequence], cost: CostModel | None, limits: BatchLimits) -> Started:
        """The untimed phase: ``seqs`` (made without drafters; set them before :meth:`Started.run`)
        admitted into the pool, the rest of each prompt past its cached blocks prefilled, each
        sequence held at its first token. The prefill steps do not calibrate the budget."""
        gate: Future = Future()
        for s in seqs:
            s.on_prompt = lambda _hidden: gate
        sched = Scheduler(self.target, cost, limits, self.pool, overlap=self.overlap)
        sched.cost = None
        for s in seqs:
            sched.add(s)
        for _ in range(len(seqs) * (1 + max(len(s.prompt_ids) for s in seqs) // limits.prefill_chunk) + 2):
            if all(s.generated or s.reason is not None for s in seqs):
                return Started(sched, gate, cost)
            sched.step()
        raise RuntimeError("the group's prompts did not all start: the pool has no room for the group")

    def decode(
        self,
        prompt_ids: list[int],
        make_drafter: Callable[[], object] | None,
        cfg: DecodeConfig,
        cost: CostModel | None = None,
        constraint=None,
    ) -> tuple[GenerationResult, float]:
        """One request decoded after its prompt (warm it first, or the untimed phase prefills it
        all): its result and the decode phase's wall seconds (``make_drafter()`` included)."""
        seq = Sequence(self.target, list(prompt_ids), None, cfg, constraint)
        started = self.start([seq], cost, BatchLimits(max_running=1))
        t0 = time.perf_counter()
        if make_drafter is not None:
            seq.drafter = make_drafter()
        started.run()
        return seq.result, time.perf_counter() - t0
