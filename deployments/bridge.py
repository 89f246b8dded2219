"""The engine's asyncio bridge: one engine thread per replica, each request's progress handed to its event loop.

No Ray here. :class:`EngineBridge` owns the replica's decode thread, which steps one
:class:`~toolspec_core.engine.scheduler.Scheduler` over every running request and sleeps when
there is none. A request hands its :class:`~toolspec_core.engine.sequence.Sequence` over with
:meth:`EngineBridge.submit` and gets a :class:`SequenceStream`: after each commit, and once when
the sequence ends, the engine thread posts to the request's own event loop
(one ``loop.call_soon_threadsafe`` per loop per step, for all its sequences), so no thread waits for a request and the event loop only
accepts, enqueues and streams. A request whose client went away cancels its sequence: the
scheduler drops it at its next step and its KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from .gc_clock import gc_clock

log = logging.getLogger("toolspec.serve")

_END = object()  # posted once the sequence has finished (its result or error is set)


@dataclass(frozen=True, slots=True)
class Progress:
    """A sequence's output so far, as the engine thread hands it to the event loop: ``text`` a
    ``str`` snapshot of the sequence's detokenizer (so the loop never reads it half-written),
    ``logprobs`` how many logprob entries the sequence has."""

    text: str
    logprobs: int


class EngineError(RuntimeError):
    """The engine failed the sequence (a step raised); the request gets a server error."""


class SequenceStream:
    """The event loop's side of one sequence in the engine.

    The engine thread calls :meth:`_on_tokens` after each commit and puts the end in the
    step's :class:`Outbox` when the sequence has finished; the outbox hands a step's news to
    each event loop in one call. :meth:`updates` yields ``(text,
    n_logprobs)`` -- the output's text so far (a ``str`` snapshot of the sequence's detokenizer,
    so the loop never reads it half-written) and how many logprob entries it has --, only the
    newest when several commits arrived together, until the sequence ends."""

    def __init__(self, seq, loop: asyncio.AbstractEventLoop, outbox: "Outbox | None" = None):
        self.seq, self.loop = seq, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ended = False
        self.outbox = outbox or Outbox()
        seq.on_tokens = self._on_tokens

    # ------------------------------------------------------------------ engine thread
    def _on_tokens(self, ids: list[int]) -> bool:
        seq = self.seq
        self.outbox.put(self, Progress(seq.detok.text, len(seq.logprobs) if seq.logprobs is not None else 0))
        return not seq.cancelled

    # ------------------------------------------------------------------ event loop
    async def updates(self) -> AsyncIterator[Progress]:
        while not self.ended:
            item = await self.queue.get()
            while item is not _END and not self.queue.empty():
                item = self.queue.get_nowait()  # the text and counts only grow: the newest says it all
            if item is _END:
                self.ended = True
                return
            yield item

    async def result(self):
        """The sequence's ``GenerationResult`` once it has ended; :class:`EngineError` if it failed."""
        async for _ in self.updates():
            pass
        seq = self.seq
        if seq.error is not None:
            raise EngineError(f"decoding failed: {type(seq.error).__name__}: {seq.error}") from seq.error
        return seq.result

    def cancel(self) -> None:
        """Stop the sequence at the engine's next step (finish_reason "cancelled"), waiting or running."""
        self.seq.cancelled = True


class Outbox:
    """What one engine step has for the event loops, handed over in one ``call_soon_threadsafe``
    per loop per step (one wake-up of the loop, not one per sequence)."""

    def __init__(self):
        self._items: dict[asyncio.AbstractEventLoop, list] = {}

    def put(self, stream: SequenceStream, item) -> None:
        self._items.setdefault(stream.loop, []).append((stream, item))

    def flush(self) -> None:
        items, self._items = self._items, {}
        for loop, batch in items.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop is closed: nobody reads these sequences any more
                for stream, _ in batch:
                    stream.seq.cancelled = True


def _deliver(batch) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)


class EngineBridge:
    """The replica's decode thread over one scheduler. A step that raises ends the sequences it
    held with finish_reason "error" (their requests get a server error) and the thread goes on."""

    def __init__(self, target, cost, limits, pool=None):
        from toolspec_core.engine.scheduler import Scheduler

        self.scheduler = Scheduler(target, cost, limits, pool)
        self.gc = gc_clock()  # the process's collections: they stop this engine's thread too
        self._cv = threading.Condition()
        self._incoming: list = []
        self._streams: dict[int, SequenceStream] = {}
        self._closed = False
        self._outbox = Outbox()  # filled and flushed by the engine thread only
        self.total_steps = 0  # steps whose records were dropped (the records are kept bounded)
        self._thread = threading.Thread(target=self._run, name="toolspec-engine", daemon=True)
        self._thread.start()

    def submit(self, seq, loop: asyncio.AbstractEventLoop | None = None) -> SequenceStream:
        """Queue ``seq`` (its ``on_tokens`` becomes the stream's); its progress goes to ``loop``, the
        request's event loop (None: the running one -- any thread may submit when it names it)."""
        stream = SequenceStream(seq, loop or asyncio.get_running_loop(), self._outbox)
        with self._cv:
            if self._closed:
                raise EngineError("the engine is shut down")
            self._streams[seq.id] = stream
            self._incoming.append(seq)
            self._cv.notify()
        return stream

    def load(self) -> dict:
        """What /health and /metrics report: sequences, the last steps' shape and time, the
        process's garbage collections (``gc_clock``), the pool.
        Read without the engine's lock (counts may be a step apart)."""
        s = self.scheduler
        recent = s.steps[-64:]
        n = len(recent) or 1
        out = {
            "mode": "batched",
            "running": len(s.running),
            "waiting": len(s.waiting) + len(self._incoming),
            "steps": self.total_steps + len(s.steps),
            "step_rows": sum(r.rows for r in recent) / n,
            "step_sequences": sum(r.sequences for r in recent) / n,
            "step_s": sum(r.forward_s + r.host_s for r in recent) / n,
            "gc": self.gc.snapshot(),
        }
        if s.pool is not None:
            st = s.pool.stats()
            out["kv_pool"] = {
                "blocks": st.blocks,
                "block_tokens": st.block_tokens,
                "used_blocks": st.used_blocks,
                "cached_blocks": st.cached_blocks,
                "free_blocks": st.free_blocks,
                "usage": st.usage,
                "prefix_queried_tokens": st.queried_tokens,
                "prefix_hit_tokens": st.hit_tokens,
                "prefix_hit_rate": st.hit_rate,
                "evictions": st.evictions,
            }
        return out

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or self._incoming or self.scheduler.has_work()):
                    self._cv.wait()
                if self._closed:
                    finished = self.scheduler.fail_all(EngineError("the engine is shut down"))
                    for seq in self._incoming:
                        seq.reason, seq.error = "error", EngineError("the engine is shut down")
                        seq.finish()
                    finished += self._incoming
                    self._incoming = []
                    self._end(finished)
                    return
                refused = []
                for seq in self._incoming:
                    try:
                        self.scheduler.add(seq)
                    except Exception as exc:  # checked at the request already; never stop the loop
                        seq.reason, seq.error = "error", exc
                        seq.finish()
                        refused.append(seq)
                self._incoming = []
            self._end(refused)
            try:
                finished = self.scheduler.step()
            except Exception as exc:
                log.exception("engine step failed; ending the sequences it held")
                finished = self.scheduler.fail_all(exc)
            self._outbox.flush()
            if len(self.scheduler.steps) > 4096:  # keep the step records bounded
                del self.scheduler.steps[:2048]
                self.total_steps += 2048
            self._end(finished)

    def _end(self, seqs) -> None:
        if not seqs:
            return
        with self._cv:
            streams = [self._streams.pop(s.id, None) for s in seqs]
        for stream in streams:
            if stream is not None:
                self._outbox.put(stream, _END)
        self._outbox.flush()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)
