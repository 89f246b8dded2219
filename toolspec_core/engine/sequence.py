"""One sequence's decoding state and the per-sequence rules the step scheduler applies to it.

A :class:`Sequence` owns what is really its own -- KV cache, drafter, sampler seed, grammar,
detokenizer, stop rules, output -- so any batch it runs in leaves its output what it is alone.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from toolspec_core.engine.detokenize import Detokenizer
from toolspec_core.engine.limits import TokenLimits
from toolspec_core.engine.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingParams,
    TokenLogprob,
    forced_logprobs,
    sample,
    target_probs,
    token_logprobs,
)
from toolspec_core.engine.stats import GenerationResult, GenerationStats
from toolspec_core.errors import InvalidRequestError
from toolspec_core.spec.proposer import DraftContext, Drafter, conform
from toolspec_core.spec.tree import DraftTree, depths, select


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # end the output, cut from it
    sampling: SamplingParams = SamplingParams()
    end_after: tuple[str, ...] = ()  # end the output, kept in it (a call's closer: no parallel calls)
    logprobs: int | None = None  # None: none; k: each token's logprob and its k top alternatives

    def __post_init__(self):
        m = self.max_new_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m <= 0:  # an invariant: limits.token_budget resolved it
            raise ValueError(f"max_new_tokens must be a positive integer, got {m!r}")
        for name in ("stop", "end_after"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
            if any(not isinstance(s, str) or not s for s in getattr(self, name)):
                raise InvalidRequestError(f"{name} must be non-empty strings", "stop")
        k = self.logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k!r}", "top_logprobs")


class Stopper:
    """EOS / max_new_tokens / stop strings (and ``end_after`` strings), checked after every emitted token.

    Emitted tokens go into the request's ``Detokenizer``; a stop string is looked for only in
    what a token added plus the longest stop string's length of lookback, so a check costs the
    same at any output length. The pending text (a token that ends inside a character) is
    searched too: a stop string counts at the token that writes it.
    """

    def __init__(self, detok: Detokenizer, eos_ids, cfg: DecodeConfig):
        self.detok, self.eos, self.cfg = detok, set(eos_ids), cfg
        self.ends = cfg.stop + cfg.end_after
        self.back = max((len(s) for s in self.ends), default=1) - 1
        self.seen = 0  # committed text searched so far (the pending text is searched again)

    def done(self, generated: list[int]) -> str | None:
        if generated[-1] in self.eos:
            return "stop"
        self.detok.feed(generated[-1:])
        if self.ends:
            new = self.detok.tail(max(0, self.seen - self.back))
            self.seen = len(self.detok.text)
            if any(s in new for s in self.ends):
                return "stop"
        if len(generated) >= self.cfg.max_new_tokens:
            return "length"
        return None

    def take(self, n_generated: int, new: list[int]) -> tuple[int, str | None]:
        """Without stop strings, what :meth:`done` token by token decides for ``new`` following
        ``n_generated`` output tokens, decided at once: how many of ``new`` are kept (up to the first
        EOS, at most ``max_new_tokens`` in all) and the reason the output ends (None: it goes on).
        The kept tokens' text is decoded in one window (the ``Detokenizer``'s pieces add up to
        the same text whichever way its tokens come)."""
        room = self.cfg.max_new_tokens - n_generated
        n, reason = min(len(new), room), None
        for k in range(n):
            if new[k] in self.eos:
                n, reason = k + 1, "stop"
                break
        self.detok.feed(new[:n])
        if reason is None and n_generated + n >= self.cfg.max_new_tokens:
            reason = "length"
        return n, reason

    def text(self) -> str:
        """The output's text (EOS is not text), cut before the first stop string or after the first
        ``end_after`` string."""
        return end_text(self.detok.final(), self.cfg.stop, self.cfg.end_after)


def end_text(text: str, stop: tuple[str, ...], end_after: tuple[str, ...] = ()) -> str:
    """``text`` cut where the first stop string starts or the first ``end_after`` string ends."""
    cuts = [text.find(s) for s in stop if s in text] + [text.find(s) + len(s) for s in end_after if s in text]
    return text[: min(cuts)] if cuts else text


def choose(logits: torch.Tensor, params: SamplingParams, gen) -> int:
    return int(torch.argmax(logits)) if params.greedy else sample(target_probs(logits, params), gen)


def cap_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """``tree`` without the nodes deeper than ``max_depth`` (the tokens the sequence has left)."""
    if not tree.tokens or max_depth <= 0:
        return DraftTree()
    if len(tree.tokens) <= max_depth:  # no node is deeper than the tree has nodes
        return tree
    d = depths(tree.parents)
    if max(d) <= max_depth:
        return tree
    return select(tree, [i for i, x in enumerate(d) if x <= max_depth])


def first_tokens(
    logits: torch.Tensor | None, params: SamplingParams, gen, constraint, choice: int | None = None
) -> tuple[list[int], int]:
    """The first generated token(s): forced by the grammar, or chosen from the prompt's last logits
    [V] (then any the grammar forces after it); and how many were chosen (0 or 1, the first).
    ``choice``: the logits' argmax when the caller has it (all a free greedy start reads)."""
    if constraint is None and params.greedy and choice is not None:
        return [int(choice)], 1
    if constraint is not None:
        forced = constraint.forced()
        if forced:
            return forced, 0
        logits = logits.masked_fill(~constraint.mask(), float("-inf"))
        tok = choose(logits, params, gen)
        constraint.consume(tok)
        return [tok] + constraint.forced(), 1
    return [choose(logits, params, gen)], 1


_ids = itertools.count()


class Sequence:
    """One request being decoded.

    The scheduler prefills the prompt in chunks (after the cached prefix blocks of its pool) into
    the KV cache it opens for the sequence at admission, the one place a cache is set
    (:meth:`~toolspec_core.engine.scheduler.Scheduler._place`, :meth:`place_cache`).
    ``on_prompt(hidden)``: called on the engine thread once the scheduler has prefilled the
    prompt, with its last token's last-layer state [H] (a retrieval key); a future it returns
    holds the sequence's first draft until it is done -- the search keyed on that state and the
    drafter built from what it found (the deployment's ``retrieval.key: hidden``) -- while the
    other sequences step on. ``decode_held``: held, the sequence still decodes, a token a step
    without a draft (a server's search: under load a step lasts longer than the search, and a
    sequence left out of steps would start its output a step or more late); else it sits out the
    steps until the future is done (a gate: the bench holds every sequence at its first token).
    ``prompt_states``: keep every prompt token's last-layer state too (``states``: one [n, H]
    tensor a prefill chunk; a key pooled over the whole prompt).
    ``on_tokens(new_ids)`` is called after each commit with the newly emitted tokens
    (streaming); returning ``False`` cancels the sequence (finish_reason "cancelled").
    ``constraint`` (:mod:`toolspec_core.engine.grammar`) restricts the target to a grammar;
    tokens it forces are emitted without verification and enter the next forward as part of the
    root chain. One ``Detokenizer`` decodes the output once, incrementally, for stop strings, the
    drafter (``DraftContext.text``) and the final text; a caller that reads the text
    while decoding passes its own as ``detokenizer``. ``early_steps``: its stats keep what its
    first steps carried (``GenerationStats.early_steps``), for a request that asked for them.
    """

    def __init__(
        self,
        target,
        prompt_ids: list[int],
        drafter: Drafter | None = None,
        cfg: DecodeConfig = DecodeConfig(),
        constraint=None,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
        detokenizer: Detokenizer | None = None,
        on_prompt: Callable[[torch.Tensor], Future | None] | None = None,
        decode_held: bool = False,
        prompt_states: bool = False,
        early_steps: bool = False,
    ):
        self.prompt_ids = list(prompt_ids)
        if not TokenLimits(target.max_context).holds(len(self.prompt_ids), cfg.max_new_tokens):
            raise ValueError(  # an invariant, not a user's error: the job's limits are checked before it is made
                f"a prompt of {len(self.prompt_ids)} tokens + {cfg.max_new_tokens} new tokens does not fit the "
                f"context window of {target.max_context}; check it with toolspec_core.engine.limits first"
            )
        self.id = next(_ids)
        self.drafter = conform(drafter)  # a DrafterBase: its flags are typed attributes
        self.cfg, self.constraint, self.on_tokens = cfg, constraint, on_tokens
        self.gen = cfg.sampling.generator()
        self.detok = detokenizer if detokenizer is not None else Detokenizer(target.tokenizer, target.eos_ids)
        self.stopper = Stopper(self.detok, target.eos_ids, cfg)
        self.tokens = list(self.prompt_ids)  # prompt + emitted
        self.generated: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if cfg.logprobs is not None else None
        self.roots: list[int] = []  # emitted tokens whose KV is not cached yet (the next forward's chain)
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids), early_steps=[] if early_steps else None)
        self.reason: str | None = None
        self.result: GenerationResult | None = None
        self.cancelled = False
        self.prepared = False  # its drafter's prompt-side work done beside a forward (Scheduler._beside_forward)
        self.error: BaseException | None = None  # why the sequence ended with finish_reason "error"
        self.hidden: torch.Tensor | None = None  # [H] the prompt's last state, once prefilled
        self.states: list[torch.Tensor] | None = [] if prompt_states else None  # [n, H] a prefill chunk's states
        self.on_prompt = on_prompt
        self.decode_held = decode_held
        self.hold: Future | None = None  # the first draft waits for it (on_prompt's future)
        self._cache = None  # set once, at admission (place_cache)
        self.filled = 0  # prompt rows whose KV is in the cache

    @property
    def cache(self):
        """The sequence's KV cache (None before admission and after it finished)."""
        return self._cache

    def place_cache(self, cache, filled: int) -> None:
        """Admission: the cache the scheduler opened for this sequence, holding its first ``filled``
        prompt rows. Only :meth:`~toolspec_core.engine.scheduler.Scheduler._place` calls it."""
        if self._cache is not None or self.result is not None:
            raise RuntimeError(f"sequence {self.id} already has its KV cache")
        self._cache, self.filled = cache, filled

    @property
    def reserved_tokens(self) -> int:
        """KV rows this sequence may come to hold (what admission counts)."""
        return len(self.prompt_ids) + self.cfg.max_new_tokens

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.prompt_ids)

    @property
    def decoding(self) -> bool:
        """Its output has begun and not ended, and it has rows in the next step: not held, or held
        with ``decode_held`` (then without a draft)."""
        return bool(self.roots) and self.reason is None and (self.decode_held or not self.held)

    @property
    def held(self) -> bool:
        """Prefilled, its first draft waiting for ``on_prompt``'s future. A pure read: the
        scheduler drops a done future once at the top of a step (:meth:`release_hold`), so every
        read within a step sees the same answer."""
        return self.hold is not None

    def release_hold(self) -> None:
        """Drop ``hold`` once its future is done (the first draft may go ahead)."""
        if self.hold is not None and self.hold.done():
            self.hold = None

    def prompt_done(self, hidden: torch.Tensor) -> None:
        """The scheduler has the prompt in the cache: its last state [H] is kept and handed to
        ``on_prompt``, whose future (if any) holds the first draft."""
        self.hidden = hidden
        if self.on_prompt is not None:
            self.hold = self.on_prompt(hidden)

    def start(self, logits: torch.Tensor | None, choice: int | None = None) -> None:
        """The prompt is cached: emit the first token(s) from its last logits [V] (or their argmax
        ``choice`` alone, for a greedy sequence that reads nothing else)."""
        new, chosen = first_tokens(logits, self.cfg.sampling, self.gen, self.constraint, choice)
        self.emit(new, None if logits is None else self.token_logprobs(logits[None], new[:chosen], new[chosen:]))
        self.roots = list(self.generated)

    def context(self) -> DraftContext:
        remaining = self.cfg.max_new_tokens - len(self.generated) - 1
        return DraftContext(self.tokens, len(self.prompt_ids), remaining, self.detok.text, self.detok.read)

    def token_logprobs(self, rows: torch.Tensor, chosen: list[int], forced: list[int]) -> list[TokenLogprob] | None:
        """Logprobs of tokens about to be emitted, when the request asks for them: ``chosen`` from
        the logits ``rows`` [len(chosen), V] that chose them, then ``forced`` ones (grammar)."""
        if self.logprobs is None:
            return None
        top = self.cfg.logprobs
        return token_logprobs(rows, chosen, top) + forced_logprobs(forced, top)

    def emit(self, new: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append tokens until a stop condition (never past EOS / stop / max tokens), then stream
        them; ``logprobs``: one entry per token of ``new`` (kept for those appended). With stop
        strings each token's text is searched as it comes (a stop string ends the output at the
        token that writes it); without, the step's tokens go in at once (``Stopper.take``)."""
        before = len(self.generated)
        keep = logprobs is not None and self.logprobs is not None
        if self.stopper.ends:  # stop strings: each token's text searched as it comes
            for k, tok in enumerate(new):
                self.tokens.append(tok)
                self.generated.append(tok)
                if keep:
                    self.logprobs.append(logprobs[k])
                self.reason = self.stopper.done(self.generated)
                if self.reason:
                    break
        elif new:  # no text to search: the stop decided for all of them at once
            n, self.reason = self.stopper.take(before, new)
            self.tokens += new[:n]
            self.generated += new[:n]
            if keep:
                self.logprobs += logprobs[:n]
        if self.on_tokens is not None and self.on_tokens(self.generated[before:]) is False:
            self.reason = self.reason or "cancelled"

    def finish(self) -> GenerationResult:
        self.stats.generated_tokens = len(self.generated)
        self.result = GenerationResult(self.generated, self.stopper.text(), self.reason, self.stats, self.logprobs)
        self._cache = None  # the KV goes with the sequence
        return self.result
