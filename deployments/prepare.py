"""Request preparation in the replica: prompt, decode policy and the library search, before the engine.

No Ray here. :func:`prepare` renders the prompt and applies the server's policy (the output
length the replica's :class:`~toolspec_core.engine.limits.TokenLimits` allow, the
``tool_choice`` / ``response_format`` grammar, sampling, stop strings); it runs in a worker
thread (tokenising and grammar set-up are CPU work). :class:`Search` runs the request's call-library search on the event loop, keyed on
the request's text (started at once, so it runs while the engine prefills the prompt) or on the
prompt's hidden state (started from the engine thread once the engine has prefilled the prompt
in its pool, :meth:`Search.keyed_later`); :class:`LateDrafter` takes the drafter built (in a
worker thread) from whatever the search found by the sequence's first proposal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any

from toolspec_core.spec.proposer import DrafterBase

from .config import ServeAppConfig
from .protocol import EngineRequest


@dataclass
class Prepared:
    """A validated request: prompt ids, decode settings, optional grammar (``tool_choice``)."""

    prompt_ids: list[int]
    decode_cfg: Any
    constraint: Any = None
    key: Any = None  # retrieval key known before prefill (the request's text), else None
    timeline: bool = False  # the request asked for its timeline: its sequence keeps its early steps


def prepare(req: EngineRequest, cfg: ServeAppConfig, target, limits, text_key: bool) -> Prepared:
    """The request's prompt and decode settings under the server's policy; raises
    :class:`~toolspec_core.errors.InvalidRequestError` (a 400) for what the server will not run.
    ``limits``: the replica's :class:`~toolspec_core.engine.limits.TokenLimits` (window, KV pool,
    the server's caps and default), the one check of the job's token counts; ``text_key``: the
    search is keyed on the request's text (``Prepared.key``)."""
    from toolspec_core.engine.grammar import make_tool_constraint
    from toolspec_core.engine.limits import token_budget
    from toolspec_core.engine.loop import DecodeConfig
    from toolspec_core.engine.sampling import SamplingParams
    from toolspec_core.model.prompting import render_prompt

    tok = target.tokenizer
    tools = req.offered_tools
    prompt = render_prompt(tok, req.messages, tools or None)
    max_new = token_budget(len(prompt), req.max_tokens, limits)  # before the grammar: a refusal costs no set-up
    constraint = None
    parallel = req.parallel_tool_calls
    answer = req.response_schema
    if (tools and req.tool_choice not in ("auto", "none")) or answer is not None:
        vocab = getattr(target.model.config, "vocab_size", None)
        constraint = make_tool_constraint(tok, tools, req.tool_choice, vocab, parallel, answer)
    temperature = req.temperature if req.temperature is not None else cfg.default_temperature
    sampling = SamplingParams(temperature, req.top_p, req.top_k, req.seed)
    # no parallel calls: the output ends with the first call's closer (the grammar does that
    # for a forced tool_choice; fences and bare JSON hold one call in the drafted layouts)
    end_after = ("</tool_call>",) if tools and not parallel else ()
    decode_cfg = DecodeConfig(max_new, tuple(req.stop), sampling, end_after, req.logprobs)
    key = None
    if text_key and tools:
        from retrieval_service.embedding import query_text

        key = query_text(req.messages, tools)
    return Prepared(prompt, decode_cfg, constraint, key=key, timeline=req.timeline)


def search_wanted(retrieval, req: EngineRequest) -> bool:
    """Whether ``req`` searches the call library: there is one (``retrieval``, None when retrieval
    is off) and the request offers tools the model may call: the library holds tool calls only."""
    return retrieval is not None and bool(req.tools) and req.tool_choice != "none"


class Search:
    """One request's call-library search, made only where :func:`search_wanted` (``retrieval``: the
    replica's :class:`~deployments.retrieval.RetrievalClient`); keyed on ``key`` (the request's
    text) at once, or, with ``key`` None, on the prompt's hidden state passed to :meth:`start`
    after a prefill."""

    def __init__(self, retrieval, req: EngineRequest, key):
        self.retrieval, self.req = retrieval, req
        self.embedding = key
        self.task: asyncio.Future | None = None
        if key is not None:
            self.start(key)

    @property
    def needs_state(self) -> bool:
        """The key is the prompt's hidden state: the prompt must be prefilled before the search."""
        return self.embedding is None

    def keyed_later(self, loop: asyncio.AbstractEventLoop):
        """For a key known only once the engine has prefilled the prompt: (the found calls as a
        future the engine thread can poll, ``begin(key)`` -- any thread -- that starts the search on
        ``loop``). The calls future always ends (no calls when the search fails or times out)."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def go(embedding) -> None:
            try:
                self.start(embedding)
            except Exception:  # never leave the sequence waiting for a search that did not start
                out.set_result([])
                raise
            self._chain(out)

        def begin(embedding) -> None:
            loop.call_soon_threadsafe(go, embedding)

        return out, begin

    def start(self, embedding) -> None:
        self.embedding = embedding
        names = [t["function"]["name"] for t in self.req.tools]
        self.task = asyncio.ensure_future(self.retrieval.search(self.req.tenant, embedding, names))

    def late(self) -> concurrent.futures.Future:
        """The found calls of the search keyed on the text, as a future the engine thread can poll."""
        out: concurrent.futures.Future = concurrent.futures.Future()
        self._chain(out)
        return out

    def _chain(self, out: concurrent.futures.Future) -> None:
        def done(task: asyncio.Future) -> None:
            out.set_result([] if task.cancelled() or task.exception() is not None else task.result()[0])

        self.task.add_done_callback(done)

    async def result(self) -> tuple[list, dict]:
        """(the calls found, the search's report)."""
        return await self.task

    def wire_embedding(self):
        """The key as the drafter's ``RequestInfo`` holds it (text, or a list of floats)."""
        e = self.embedding
        return e if e is None or isinstance(e, str) else e.tolist()


class LateDrafter(DrafterBase):
    """A request's drafter whose library search may still be running when its sequence starts.

    Both drafters are built in the replica's worker threads, never on the engine thread:
    ``fallback`` (no retrieved calls, as on a search timeout) before the sequence starts, and the
    real one once the search ends (``built``, a future the host fills). The sequence's first
    proposal -- once the engine has prefilled the prompt -- takes the real drafter if it is ready
    by then, else the fallback. So the search runs while the prompt is prefilled instead of
    before it, and never holds the engine up."""

    def __init__(self, built: concurrent.futures.Future, fallback):
        self.built, self.fallback = built, fallback
        self.inner = None
        self.in_time = False

    def propose(self, ctx):
        if self.inner is None:
            self.in_time = self.built.done() and self.built.exception() is None
            self.inner = self.built.result() if self.in_time else self.fallback
            self.built.cancel()
        return self.inner.propose(ctx)

    def feedback(self, tree, result) -> None:
        if self.inner is not None:
            self.inner.feedback(tree, result)
