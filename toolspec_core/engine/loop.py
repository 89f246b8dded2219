"""The decode loop: prefill once, then propose -> verify -> commit until a stop condition."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from toolspec_core.drafters.base import DraftContext, Drafter, NoDrafter
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.commit import clone_cache
from toolspec_core.engine.detokenize import Detokenizer
from toolspec_core.engine.sampling import SamplingParams, sample, target_probs
from toolspec_core.engine.stats import GenerationResult, GenerationStats, record_step
from toolspec_core.engine.tree import DraftTree, depths, select
from toolspec_core.engine.verify import verify_step
from toolspec_core.errors import ContextLengthError, InvalidRequestError
from toolspec_core.model.target import Target


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self):
        m = self.max_new_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
            raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {m!r}", "max_tokens")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", "stop")


@dataclass
class Prefilled:
    """A prompt whose KV is cached; ``logits`` [V] predict the first generated token."""

    prompt_ids: list[int]
    cache: object
    logits: torch.Tensor
    hidden: torch.Tensor  # [H] last-layer state of the final prompt token (retrieval key)
    seconds: float = 0.0


def check_prompt(target: Target, prompt_ids: list[int], max_new_tokens: int = 1) -> None:
    if not prompt_ids:
        raise InvalidRequestError("prompt is empty", "messages")
    if len(prompt_ids) + max_new_tokens > target.max_context:
        raise ContextLengthError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens {max_new_tokens} exceeds the context window "
            f"of {target.max_context} tokens",
            "messages",
        )


def prefill(target: Target, prompt_ids: list[int], prefix: Prefilled | None = None, chunk: int = 512) -> Prefilled:
    """Run the prompt (or its part past a cached ``prefix``) through the target."""

    check_prompt(target, prompt_ids)
    t0 = time.perf_counter()
    start, cache = 0, target.new_cache()
    if (
        prefix is not None
        and len(prefix.prompt_ids) < len(prompt_ids)
        and prompt_ids[: len(prefix.prompt_ids)] == prefix.prompt_ids
    ):
        start, cache = len(prefix.prompt_ids), clone_cache(prefix.cache)
    hidden = None
    for s in range(start, len(prompt_ids), chunk):
        ids = torch.tensor([prompt_ids[s : s + chunk]], dtype=torch.long)
        pos = torch.arange(s, s + ids.shape[1]).unsqueeze(0)
        hidden = target.hidden(ids, pos, None, cache)
    last = hidden[-1]
    # one row each, to the host: sampling (CPU generator), grammar masks and retrieval keys live there
    return Prefilled(list(prompt_ids), cache, target.logits(last[None])[0].cpu(), last.cpu(), time.perf_counter() - t0)


class _Stopper:
    """EOS / max_new_tokens / stop strings, checked after every emitted token.

    Emitted tokens go into the request's ``Detokenizer``; a stop string is looked for only in
    what a token added plus the longest stop string's length of lookback, so a check costs the
    same at any output length. The pending text (a token that ends inside a character) is
    searched too: a stop string counts at the token that writes it.
    """

    def __init__(self, detok: Detokenizer, eos_ids, cfg: DecodeConfig):
        self.detok, self.eos, self.cfg = detok, set(eos_ids), cfg
        self.back = max((len(s) for s in cfg.stop), default=1) - 1
        self.seen = 0  # committed text searched so far (the pending text is searched again)

    def done(self, generated: list[int]) -> str | None:
        if generated[-1] in self.eos:
            return "stop"
        self.detok.feed(generated[-1:])
        if self.cfg.stop:
            new = self.detok.tail(max(0, self.seen - self.back))
            self.seen = len(self.detok.text)
            if any(s in new for s in self.cfg.stop):
                return "stop"
        if len(generated) >= self.cfg.max_new_tokens:
            return "length"
        return None

    def text(self) -> str:
        """The output's text (EOS is not text), cut before the first stop string."""
        text = self.detok.final()
        cuts = [text.find(s) for s in self.cfg.stop if s in text]
        return text[: min(cuts)] if cuts else text


def choose(logits: torch.Tensor, params: SamplingParams, gen) -> int:
    return int(torch.argmax(logits)) if params.greedy else sample(target_probs(logits, params), gen)


def cap_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    if not tree.tokens or max_depth <= 0:
        return DraftTree()
    d = depths(tree.parents)
    if max(d) <= max_depth:
        return tree
    return select(tree, [i for i, x in enumerate(d) if x <= max_depth])


def _first_tokens(pre: Prefilled, params: SamplingParams, gen, constraint) -> list[int]:
    """The first generated token(s): forced by the grammar, or chosen from the prefill logits."""
    if constraint is not None:
        forced = constraint.forced()
        if forced:
            return forced
        logits = pre.logits.masked_fill(~constraint.mask(), float("-inf"))
        tok = choose(logits, params, gen)
        constraint.consume(tok)
        return [tok] + constraint.forced()
    return [choose(pre.logits, params, gen)]


def decode(
    target: Target,
    pre: Prefilled,
    drafter: Drafter | None = None,
    cfg: DecodeConfig = DecodeConfig(),
    cost: CostModel | None = None,
    own_cache: bool = False,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    constraint=None,
    detokenizer: Detokenizer | None = None,
) -> GenerationResult:
    """Decode after ``pre``. The prefix cache is cloned unless ``own_cache`` (then it is consumed).

    ``on_tokens(new_ids)`` is called after each commit with the newly emitted tokens (streaming);
    returning ``False`` cancels the request (finish_reason "cancelled"). ``constraint`` (see
    :mod:`toolspec_core.engine.grammar`) restricts the target to a grammar; tokens it forces are
    emitted without verification and enter the next forward as part of the root chain.

    The output is decoded once, incrementally, by one ``Detokenizer`` that stop strings, the
    drafter (``DraftContext.text``) and the final text share; a caller that reads the text while
    decoding (the server's streamer, from ``on_tokens``) passes a fresh one as ``detokenizer``.
    """

    check_prompt(target, pre.prompt_ids, cfg.max_new_tokens)
    drafter = drafter or NoDrafter()
    cache = pre.cache if own_cache else clone_cache(pre.cache)
    gen = cfg.sampling.generator()
    stats = GenerationStats(prompt_tokens=len(pre.prompt_ids), prefill_s=pre.seconds)
    detok = detokenizer if detokenizer is not None else Detokenizer(target.tokenizer, target.eos_ids)
    stopper = _Stopper(detok, target.eos_ids, cfg)
    tokens = list(pre.prompt_ids)
    generated: list[int] = []
    reason = _emit(_first_tokens(pre, cfg.sampling, gen, constraint), tokens, generated, stopper)
    roots = list(generated)
    if on_tokens is not None and on_tokens(list(generated)) is False:
        reason = reason or "cancelled"
    while reason is None:
        t0 = time.perf_counter()
        ctx = DraftContext(tokens, len(pre.prompt_ids), cfg.max_new_tokens - len(generated) - 1, detok.text, detok.read)
        tree = cap_depth(drafter.propose(ctx), ctx.max_depth)
        if cost is not None:
            tree = cost.prune(tree)
        t1, rows = time.perf_counter(), len(roots) + len(tree)
        result = verify_step(target, tree, roots, cache, cfg.sampling, gen, constraint)
        t2 = time.perf_counter()
        drafter.feedback(tree, result)
        record_step(stats, tree, result)
        emitted = len(generated)
        new = [tree.tokens[i] for i in result.path] + [result.token]
        forced = constraint.forced() if constraint is not None else []
        stats.forced += len(forced)
        reason = _emit(new + forced, tokens, generated, stopper)
        roots = [result.token] + forced
        if on_tokens is not None and on_tokens(generated[emitted:]) is False:
            reason = reason or "cancelled"
        t3 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.verify_step_s.append(t2 - t1)
        if cost is not None:
            cost.observe(rows, t2 - t1)
        stats.commit_s += t3 - t2
    stats.generated_tokens = len(generated)
    return GenerationResult(generated, stopper.text(), reason, stats)


def _emit(new: list[int], tokens: list[int], generated: list[int], stopper: _Stopper) -> str | None:
    """Append tokens one by one until a stop condition (never past EOS / stop / max tokens)."""
    for tok in new:
        tokens.append(tok)
        generated.append(tok)
        reason = stopper.done(generated)
        if reason:
            return reason
    return None


def generate(
    target: Target,
    prompt_ids: list[int],
    drafter: Drafter | None = None,
    cfg: DecodeConfig = DecodeConfig(),
    cost: CostModel | None = None,
) -> GenerationResult:
    check_prompt(target, list(prompt_ids), cfg.max_new_tokens)
    pre = prefill(target, list(prompt_ids))
    return decode(target, pre, drafter, cfg, cost, own_cache=True)
