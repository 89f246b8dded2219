"""The single-request API: prefill a prompt, decode after it -- a batch of one on the step scheduler."""

from __future__ import annotations

import time
from typing import Callable

import torch

from toolspec_core.drafters.base import Drafter
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.detokenize import Detokenizer
from toolspec_core.engine.limits import check_prompt
from toolspec_core.engine.scheduler import BatchLimits, run_batch
from toolspec_core.engine.sequence import DecodeConfig, Prefilled, Sequence
from toolspec_core.engine.stats import GenerationResult
from toolspec_core.model.kv import copy_rows
from toolspec_core.model.target import Target

__all__ = ["DecodeConfig", "Prefilled", "check_prompt", "decode", "generate", "prefill"]


def prefill(
    target: Target, prompt_ids: list[int], prefix: Prefilled | None = None, chunk: int = 512, states: bool = False
) -> Prefilled:
    """Run the prompt (or its part past a cached ``prefix``) through the target, ``chunk`` rows a forward.

    ``states``: keep every prompt token's last-layer state (``Prefilled.states`` [T, H]; a
    retrieval key pooled over the prompt needs them)."""

    check_prompt(target, prompt_ids)
    t0 = time.perf_counter()
    start, cache = 0, target.new_cache()
    if (
        prefix is not None
        and len(prefix.prompt_ids) < len(prompt_ids)
        and prompt_ids[: len(prefix.prompt_ids)] == prefix.prompt_ids
    ):
        start, cache = len(prefix.prompt_ids), copy_rows(prefix.cache, target.new_cache())
    hidden, kept = None, []
    for s in range(start, len(prompt_ids), chunk):
        ids = torch.tensor([prompt_ids[s : s + chunk]], dtype=torch.long)
        pos = torch.arange(s, s + ids.shape[1]).unsqueeze(0)
        hidden = target.hidden(ids, pos, None, cache)
        if states:
            kept.append(hidden.float().cpu())
    last = hidden[-1]
    # one row each, to the host: sampling (CPU generator), grammar masks and retrieval keys live there
    logits = target.logits(last[None])[0].cpu()
    return Prefilled(
        list(prompt_ids), cache, logits, last.cpu(), time.perf_counter() - t0, torch.cat(kept) if states else None
    )


def decode(
    target: Target,
    pre: Prefilled,
    drafter: Drafter | None = None,
    cfg: DecodeConfig = DecodeConfig(),
    cost: CostModel | None = None,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    constraint=None,
    detokenizer: Detokenizer | None = None,
) -> GenerationResult:
    """Decode after ``pre`` as a batch of one (:class:`~toolspec_core.engine.sequence.Sequence` says
    what each argument does); ``pre`` is left as it was (its rows are copied in at admission).
    Raises :class:`~toolspec_core.errors.InvalidRequestError` for a job over the target's limits."""
    check_prompt(target, pre.prompt_ids, cfg.max_new_tokens)
    seq = Sequence(target, pre.prompt_ids, drafter, cfg, constraint, on_tokens, detokenizer, pre)
    return run_batch(target, [seq], cost, BatchLimits(max_running=1))[0]


def generate(
    target: Target,
    prompt_ids: list[int],
    drafter: Drafter | None = None,
    cfg: DecodeConfig = DecodeConfig(),
    cost: CostModel | None = None,
) -> GenerationResult:
    """Prefill and decode one prompt (the scheduler prefills it in chunks). Raises
    :class:`~toolspec_core.errors.InvalidRequestError` for a job over the target's limits."""
    check_prompt(target, prompt_ids, cfg.max_new_tokens)
    seq = Sequence(target, list(prompt_ids), drafter, cfg)
    return run_batch(target, [seq], cost, BatchLimits(max_running=1))[0]
