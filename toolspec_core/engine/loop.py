"""The single-request API: a prompt run through the block pool, a request decoded -- a batch of one
on the step scheduler, the same step every served request takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.detokenize import Detokenizer
from toolspec_core.engine.limits import check_prompt
from toolspec_core.engine.scheduler import BatchLimits, run_batch
from toolspec_core.engine.sequence import DecodeConfig, Sequence
from toolspec_core.engine.stats import GenerationResult
from toolspec_core.model.target import Target
from toolspec_core.spec.proposer import Drafter

__all__ = ["DecodeConfig", "Prompt", "check_prompt", "generate", "prefill"]


@dataclass
class Prompt:
    """What running a prompt through the target gives (:func:`prefill`); its KV stays in the pool."""

    prompt_ids: list[int]
    hidden: torch.Tensor  # [H] float32 last-layer state of the final prompt token (a retrieval key)
    seconds: float  # the prefill's forwards
    cached_tokens: int = 0  # prompt tokens found in the pool's prefix cache (not prefilled)
    states: torch.Tensor | None = None  # [T - cached_tokens, H] float32 every prefilled token's state, when asked for


def prefill(target: Target, prompt_ids: list[int], pool=None, chunk: int = 512, states: bool = False) -> Prompt:
    """Run a prompt through ``target`` on the step scheduler, ``chunk`` rows a forward, its KV in
    ``pool``, a block pool of the target's (None: one of its own, dropped after).

    The prompt's full blocks are registered in the pool's prefix cache, so a later sequence of
    the same pool that begins with this prompt prefills only its last partial block (a
    benchmark prefills each prompt once, untimed, this way). ``states``: every prefilled
    token's last-layer state too (``Prompt.states``; a key pooled over the prompt). On the
    caller's thread, never beside another thread stepping the same target (the target keeps the
    step runner of the pool its last step ran in). Raises
    :class:`~toolspec_core.errors.InvalidRequestError` for a prompt over the target's limits."""
    check_prompt(target, prompt_ids)
    limits = BatchLimits(max_running=1, prefill_chunk=chunk)
    seq = Sequence(target, list(prompt_ids), None, DecodeConfig(max_new_tokens=1), prompt_states=states)
    if pool is None:
        pool = target.block_pool(limits.rows_for(len(seq.prompt_ids), 1))
    run_batch(target, [seq], None, limits, pool)
    return Prompt(  # keys in float32 whatever the model's dtype: numpy, the library's arithmetic, has no bfloat16
        seq.prompt_ids,
        seq.hidden.float(),
        seq.stats.prefill_s,
        seq.stats.cached_tokens,
        torch.cat(seq.states).float() if states else None,
    )


def generate(
    target: Target,
    prompt_ids: list[int],
    drafter: Drafter | None = None,
    cfg: DecodeConfig = DecodeConfig(),
    cost: CostModel | None = None,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    constraint=None,
    detokenizer: Detokenizer | None = None,
    pool=None,
) -> GenerationResult:
    """Prefill and decode one prompt (:class:`~toolspec_core.engine.sequence.Sequence` says what
    each argument does): the scheduler prefills it in chunks, in ``pool`` when given (its cached
    prefix blocks first), else in a cache of the sequence's own. Raises
    :class:`~toolspec_core.errors.InvalidRequestError` for a job over the target's limits."""
    check_prompt(target, prompt_ids, cfg.max_new_tokens)
    seq = Sequence(target, list(prompt_ids), drafter, cfg, constraint, on_tokens, detokenizer)
    return run_batch(target, [seq], cost, BatchLimits(max_running=1), pool)[0]
