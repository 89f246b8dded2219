"""A job's call-library search and the drafter that takes what it found, late.

No Ray here. :class:`Search` runs one job's search on the request's event loop, started from any
thread with :meth:`Search.begin`: keyed on the request's text (begun by the worker thread that
built the job, so it runs while the engine prefills the prompt) or on the prompt's hidden state
(begun from the engine thread once the engine has prefilled the prompt in its pool).
:class:`LateDrafter` takes the drafter built (in a worker thread) from whatever the search found
by the sequence's first proposal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from toolspec_core.spec.proposer import DrafterBase

from .job import EngineJob


class Search:
    """One job's search of the replica's call library (``retrieval``: its
    :class:`~deployments.retrieval.RetrievalClient`), run on ``loop``. ``calls``: the calls found,
    as a future any thread can poll; it always ends (no calls when the search fails or times out)."""

    def __init__(self, retrieval, job: EngineJob, loop: asyncio.AbstractEventLoop):
        self.retrieval, self.job, self.loop = retrieval, job, loop
        self.embedding = None  # the key, once begun
        self.task: asyncio.Future | None = None
        self.calls: concurrent.futures.Future = concurrent.futures.Future()

    def begin(self, key) -> None:
        """Start the search keyed on ``key`` (the request's text, or the prompt's hidden state as a
        vector); any thread."""
        self.loop.call_soon_threadsafe(self._go, key)

    def _go(self, key) -> None:
        try:
            self.embedding = key
            self.task = asyncio.ensure_future(self.retrieval.search(self.job.tenant, key, self.job.tool_names))
        except Exception:  # never leave the sequence waiting for a search that did not start
            self.calls.set_result([])
            raise
        self.task.add_done_callback(self._found)

    def _found(self, task: asyncio.Future) -> None:
        self.calls.set_result([] if task.cancelled() or task.exception() is not None else task.result()[0])

    async def report(self) -> dict:
        """The search's report (``status``, ``hits``, ...); a search never begun says so."""
        if self.task is None:
            return {"status": "not_started"}
        return dict((await self.task)[1])

    def wire_embedding(self):
        """The key as the method's ``RequestInfo`` holds it (text, or a list of floats)."""
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
