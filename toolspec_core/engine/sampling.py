"""Sampling parameters and the target's (processed) next-token distribution."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from toolspec_core.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 means no top-k cut."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or t > 100:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {t!r}", "temperature")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}", "top_p")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {k!r}", "top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed() % (2**63))
        return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed distribution p(x) of the target for one position. logits: [V] -> probs [V] (fp32).

    The same function serves plain sampling and speculative verification, which is what makes
    the two distributions identical.
    """
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = (cum - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        probs = probs / probs.sum()
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


# (token, logprob, [(alternative, logprob), ...]) for one emitted token
TokenLogprob = tuple[int, float, list[tuple[int, float]]]

MAX_TOP_LOGPROBS = 20


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The target's log-probabilities of ``tokens``, each from the logits row [K, V] that chose it,
    with the ``top`` most likely alternatives. The raw model distribution (no temperature, top-p or
    grammar mask), as OpenAI and vLLM report it; one device sync for all rows."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), -1)  # [K, V]
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if top > 0:
        vals, ids = lp.topk(top, -1)  # [K, top]
        alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        alts = [[] for _ in tokens]
    return [(t, c, a) for t, c, a in zip(tokens, chosen, alts)]


def forced_logprobs(tokens: list[int], top: int) -> list[TokenLogprob]:
    """Tokens a grammar forced (no forward chose them): certain under the constrained distribution."""
    return [(t, 0.0, [(t, 0.0)] if top > 0 else []) for t in tokens]
