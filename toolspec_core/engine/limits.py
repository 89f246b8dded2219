"""Every limit a request's token counts are held to, checked in one place.

A request becomes a job whose numbers are already valid before the engine sees it: the
engine's :class:`~toolspec_core.engine.sequence.Sequence` and
:class:`~toolspec_core.engine.scheduler.Scheduler` only assert (:meth:`TokenLimits.holds`) what
this module has checked, and never answer a user. Two calls cover a request:

* :func:`requested_tokens` -- what the client asked for (``max_tokens`` /
  ``max_completion_tokens``) against the server's cap, before the prompt is known, so a bad
  number is refused before any work (the HTTP request's parse);
* :func:`token_budget` -- the job's ``max_new_tokens`` once the prompt is tokenized: the prompt
  against the server's prompt limit, prompt + output against the context window and against the
  KV pool's capacity (less one draft tree), the server's default when none was asked for.

Each failure is an :class:`~toolspec_core.errors.InvalidRequestError` (code ``invalid_value``) or
:class:`~toolspec_core.errors.ContextLengthError` (code ``context_length_exceeded``) carrying the
request parameter it is about; the server turns it into an OpenAI-style 400 as it is. The
single-request API (:mod:`toolspec_core.engine.loop`) calls :func:`check_prompt` the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolspec_core.errors import ContextLengthError, InvalidRequestError


@dataclass(frozen=True)
class TokenLimits:
    """What one engine will run, resolved once (a replica builds it at start-up).

    ``context``: the target's window (prompt + output); ``pool_tokens``: the KV pool's capacity
    (None: no pool), of which a sequence keeps ``tree_rows`` for one draft tree beyond its tokens;
    ``max_tokens``: the most a request may ask for (None: no cap but the window and the pool);
    ``default``: the output length of a request that asks for none (cut to what fits);
    ``prompt_tokens``: the longest prompt taken (None: the window decides)."""

    context: int
    pool_tokens: int | None = None
    tree_rows: int = 0
    max_tokens: int | None = None
    default: int = 256
    prompt_tokens: int | None = None

    def pool_room(self, prompt_tokens: int) -> int | None:
        """The most tokens a prompt of this length may ask for from the pool (None: no pool)."""
        if self.pool_tokens is None:
            return None
        return self.pool_tokens - prompt_tokens - self.tree_rows

    def holds(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Whether a job of this prompt and output length is one :func:`token_budget` lets through
        (the engine's invariant: it asserts this, it does not answer a user)."""
        room = self.pool_room(prompt_tokens)
        return (
            prompt_tokens >= 1
            and max_new_tokens >= 1
            and prompt_tokens + max_new_tokens <= self.context
            and (room is None or max_new_tokens <= room)
        )


def requested_tokens(max_tokens: int | None, max_completion_tokens: int | None, most: int | None) -> int | None:
    """The output length a request asks for (None: it leaves it to the server), each of the two
    fields in [1, ``most``] and, when both are given, equal."""
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise InvalidRequestError(
            "Set either max_tokens or max_completion_tokens, not both with different values", "max_tokens"
        )
    for field, v in (("max_tokens", max_tokens), ("max_completion_tokens", max_completion_tokens)):
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (most is not None and v > most):
            span = f"between 1 and {most}" if most is not None else "a positive integer"
            raise InvalidRequestError(f"Invalid '{field}': must be {span}, got {v!r}", field)
    return max_completion_tokens if max_completion_tokens is not None else max_tokens


def token_budget(prompt_tokens: int, requested: int | None, limits: TokenLimits) -> int:
    """The job's ``max_new_tokens`` for a prompt of ``prompt_tokens`` tokens: ``requested`` (from
    :func:`requested_tokens`) if prompt and output fit, else a 400; with none requested, the
    server's default cut to the window and the pool."""
    if prompt_tokens < 1:
        raise InvalidRequestError("prompt is empty", "messages")
    most = limits.prompt_tokens
    if most is not None and prompt_tokens > most:
        raise InvalidRequestError(
            f"the prompt has {prompt_tokens} tokens; this server takes at most {most} (limits.prompt_tokens)",
            "messages",
        )
    room = limits.pool_room(prompt_tokens)
    if requested is None:
        cut = [limits.default, limits.context - prompt_tokens]
        if room is not None:
            cut.append(room)
        new = max(1, min(cut))  # 1 when nothing fits: the checks below say why
    else:
        requested_tokens(requested, None, limits.max_tokens)
        new = requested
    if prompt_tokens + new > limits.context:
        raise ContextLengthError(
            f"prompt of {prompt_tokens} tokens + max_tokens {new} exceeds the context window "
            f"of {limits.context} tokens",
            "messages",
        )
    if room is not None and new > room:
        raise ContextLengthError(
            f"prompt of {prompt_tokens} tokens + max_tokens {new} exceeds the replica's KV pool of "
            f"{limits.pool_tokens} tokens ({limits.tree_rows} kept for a draft tree); ask for at most "
            f"{max(0, room)} tokens or shorten the prompt",
            "messages",
        )
    return new


def target_limits(target, scheduler=None) -> TokenLimits:
    """The limits a target (and a scheduler's KV pool, if it has one) set on every job."""
    pool = getattr(scheduler, "pool", None)
    if pool is None:
        return TokenLimits(context=target.max_context)
    return TokenLimits(
        context=target.max_context, pool_tokens=pool.capacity_tokens, tree_rows=scheduler.limits.tree_rows
    )


def check_prompt(target, prompt_ids: list[int], max_new_tokens: int = 1) -> int:
    """:func:`token_budget` for a caller of the single-request API: ``prompt_ids`` and
    ``max_new_tokens`` against the target's window."""
    return token_budget(len(prompt_ids), max_new_tokens, target_limits(target))
