"""The engine inside one replica: target, method, prefix KV cache, request pipeline.

No Ray here (the replica deployment wraps it; unit tests drive it directly). Decoding runs on one
engine thread per replica (:class:`EngineLoop`): a step scheduler verifies every running request
in one target forward per step. Tokenising, prefill and drafter set-up run in worker threads, so
the event loop only accepts, enqueues and streams; each request owns its KV cache (the shared
prefix entry is cloned, never mutated).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator

from toolspec_core.errors import InvalidRequestError

from .config import ServeAppConfig, served_name

log = logging.getLogger("toolspec.serve")


# ---------------------------------------------------------------------------------------- helpers


def error_event(exc: InvalidRequestError) -> dict:
    from toolspec_core.errors import ContextLengthError

    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else "invalid_value"
    return {
        "event": "error",
        "status": 400,
        "error": {"message": str(exc), "type": "invalid_request_error", "param": exc.param, "code": code},
    }


class TextStreamer:
    """Safe-to-send part of the output text: always a prefix of the engine's final text.

    It is fed the request's decoded text (``Detokenizer.text``, complete characters only, decoded
    once by the engine and shared with stop strings and the drafter) and does no decoding: with
    stop strings it holds back the tail that could still become one (the final text is cut
    before it), searching only the new text plus that lookback; ``end_after`` strings end the
    text after them (:func:`~toolspec_core.engine.sequence.end_text`).
    """

    def __init__(self, stop: list[str], end_after: tuple[str, ...] = ()):
        self.stop, self.end_after = list(stop), tuple(end_after)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.back = max((len(s) for s in (*self.stop, *self.end_after)), default=1) - 1
        self.text = ""  # the text last fed; ``text[:sent]`` has been sent
        self.sent = 0
        self.cut: int | None = None  # where the text ends (a stop string's start), once seen
        self._searched = 0

    def feed(self, text: str) -> str:
        """The delta safe to send now that the output's text is ``text`` (an extension of the last)."""
        self.text = text
        if self.cut is None and (self.stop or self.end_after):
            start = max(0, self._searched - self.back)
            hits = [k for k in (text.find(s, start) for s in self.stop) if k >= 0]
            hits += [k + len(s) for s in self.end_after if (k := text.find(s, start)) >= 0]
            self._searched = len(text)
            if hits:
                self.cut = min(hits)
        end = self.cut if self.cut is not None else len(text) - self.hold
        return self._delta(text, end)

    def _delta(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent : end], end
        return out

    def finish(self, final_text: str) -> str:
        if not final_text.startswith(self.text[: self.sent]):
            log.warning("streamed text diverged from the final text")
            return ""
        self.text = final_text
        return self._delta(final_text, len(final_text))


class TokenText:
    """OpenAI's logprob entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``) of engine
    ``TokenLogprob`` tuples. A byte-level BPE token's bytes come from its own symbols, so a token
    holding part of a character still has its exact bytes; EOS tokens are not output text and get
    no entry."""

    def __init__(self, tokenizer, eos_ids):
        self.tokenizer, self.eos = tokenizer, set(eos_ids)
        self._bytes: dict[int, bytes] = {}
        try:
            from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

            self._decoder = {c: b for b, c in bytes_to_unicode().items()}
        except ImportError:
            self._decoder = {}

    def bytes_of(self, tid: int) -> bytes:
        out = self._bytes.get(tid)
        if out is None:
            piece = self.tokenizer.convert_ids_to_tokens(int(tid))
            if isinstance(piece, str) and piece and all(c in self._decoder for c in piece):
                out = bytes(self._decoder[c] for c in piece)
            else:
                out = self.tokenizer.decode([int(tid)]).encode()
            self._bytes[tid] = out
        return out

    def entry(self, tid: int, logprob: float) -> dict:
        raw = self.bytes_of(tid)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def entries(self, logprobs) -> list[dict]:
        return [
            {**self.entry(t, lp), "top_logprobs": [self.entry(a, alp) for a, alp in top]}
            for t, lp, top in logprobs
            if t not in self.eos
        ]


class PrefixCache:
    """Small LRU of prefilled shared prefixes (system prompt + tools), keyed by token ids."""

    def __init__(self, entries: int):
        self.entries = entries
        self._d: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: tuple):
        with self._lock:
            pre = self._d.get(key)
            if pre is not None:
                self._d.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return pre

    def put(self, key: tuple, pre) -> None:
        if self.entries <= 0:
            return
        with self._lock:
            self._d[key] = pre
            self._d.move_to_end(key)
            while len(self._d) > self.entries:
                self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


def shared_prefix_len(prompt_ids: list[int], turn_end_ids: set[int]) -> int:
    """Length of the first turn (e.g. system prompt + tools) incl. its end token, 0 if none.

    Never the whole prompt: the suffix must leave at least one token to prefill.
    """
    for i, t in enumerate(prompt_ids):
        if t in turn_end_ids:
            return i + 1 if i + 1 < len(prompt_ids) else 0
    return 0


@dataclass
class Prepared:
    """A validated request: prompt ids, decode settings, optional grammar (``tool_choice``)."""

    prompt_ids: list[int]
    decode_cfg: Any
    constraint: Any = None
    prefix_len: int = 0
    key: Any = None  # retrieval key known before prefill (lexical), else None


@dataclass
class HostStats:
    cancelled: int = 0  # streams closed by the client mid-decode


# ---------------------------------------------------------------------------------------- engine thread


class EngineLoop:
    """The replica's decode thread: one :class:`~toolspec_core.engine.scheduler.Scheduler` over
    every running request. Request threads ``submit`` a sequence and wait on its event; the thread
    steps while there is work and sleeps otherwise. A step that raises ends the sequences it held
    with finish_reason "error" (their requests fail cleanly) and the loop goes on."""

    def __init__(self, target, cost, limits, pool=None):
        from toolspec_core.engine.scheduler import Scheduler

        self.scheduler = Scheduler(target, cost, limits, pool)
        self._cv = threading.Condition()
        self._incoming: list = []
        self._events: dict[int, threading.Event] = {}
        self._closed = False
        self.total_steps = 0  # steps whose records were dropped (the records are kept bounded)
        self._thread = threading.Thread(target=self._run, name="toolspec-engine", daemon=True)
        self._thread.start()

    def submit(self, seq) -> threading.Event:
        done = threading.Event()
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            self._events[seq.id] = done
            self._incoming.append(seq)
            self._cv.notify()
        return done

    def load(self) -> dict:
        """What /health and /metrics report: sequences, the last steps' shape and time, the pool.
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
                    finished = self.scheduler.fail_all(RuntimeError("the engine is shut down"))
                    finished += self._incoming
                    self._incoming = []
                    self._finish(finished)
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
            self._finish(refused)
            try:
                finished = self.scheduler.step()
            except Exception as exc:
                log.exception("engine step failed; ending the sequences it held")
                finished = self.scheduler.fail_all(exc)
            if len(self.scheduler.steps) > 4096:  # keep the step records bounded
                del self.scheduler.steps[:2048]
                self.total_steps += 2048
            self._finish(finished)

    def _finish(self, seqs) -> None:
        with self._cv:
            events = [self._events.pop(s.id, None) for s in seqs]
        for ev in events:
            if ev is not None:
                ev.set()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)


# ---------------------------------------------------------------------------------------- host


class EngineHost:
    """Target + method + caches of one replica. ``build`` does the heavy start-up work."""

    def __init__(self, cfg: ServeAppConfig, target, method, cost=None, library=None, retrieval=None):
        self.cfg, self.target, self.method, self.cost = cfg, target, method, cost
        self.library, self.retrieval = library, retrieval
        # the Retrieval deployment keys the request's text itself (every key but the target's hidden state)
        self.text_key = retrieval is not None and cfg.retrieval.text_key()
        self.pool = ThreadPoolExecutor(max_workers=cfg.max_ongoing_requests + 1, thread_name_prefix="toolspec-decode")
        self.prefixes = PrefixCache(cfg.prefix_cache_entries)
        from toolspec_core.model.prompting import turn_end_tokens

        self.turn_end = set(turn_end_tokens(target.tokenizer))
        self.token_text = TokenText(target.tokenizer, target.eos_ids)
        self.stats = HostStats()
        self.name = served_name(cfg)
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}"
        from toolspec_core.engine.scheduler import BatchLimits

        self.engine = None
        if cfg.engine == "batched":
            limits = BatchLimits(max_running=cfg.max_num_seqs, prefill_chunk=cfg.prefill_chunk_tokens)
            kv_pool = None  # a model family the batched forward does not cover keeps per-sequence caches
            if target.batched:
                tokens = kv_pool_tokens(cfg, target, limits.tree_rows)
                kv_pool = target.block_pool(tokens, cfg.kv_block_tokens, cfg.prefix_caching)
            self.engine = EngineLoop(target, cost, limits, kv_pool)

    # ------------------------------------------------------------------ start-up
    @classmethod
    def build(cls, cfg: ServeAppConfig, retrieval=None) -> "EngineHost":
        """Load the target (or start TP workers), build the method, measure the cost model."""
        import torch

        from toolspec_core.drafters.methods import make_method, method_class
        from toolspec_core.engine.cost_probe import cost_model_for
        from toolspec_core.engine.grammar import _lltokenizer

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        target = load_serving_target(cfg)
        library = None
        if retrieval is not None:
            from .retrieval import ServeLibrary

            library = ServeLibrary(retrieval)
        opts = dict(cfg.method_options)
        try:
            if library is not None and method_class(cfg.method).uses_library:
                opts.setdefault("library", library)
            method = make_method(cfg.method, target.tokenizer, **opts)
        except Exception as exc:
            raise RuntimeError(f"cannot build decoding method {cfg.method!r}: {exc}") from exc
        cost = cost_model_for(cfg.cost_model, target, cfg.calibrate_cost)
        _lltokenizer(target.tokenizer)  # build llguidance's tokenizer view now, not on a request
        return cls(cfg, target, method, cost, library, retrieval)

    def info(self) -> dict:
        return {
            "replica": self.replica_id,
            "model": self.name,
            "max_context": self.target.max_context,
            "method": getattr(self.method, "name", self.cfg.method),
            "tensor_parallel_size": self.cfg.tensor_parallel_size,
            "prefix_cache": len(self.prefixes),
            "prefix_hits": self.prefixes.hits,
            "prefix_misses": self.prefixes.misses,
            "retrieval": self.retrieval.counters() if self.retrieval is not None else None,
            "engine": self.engine.load() if self.engine is not None else {"mode": "threads"},
            "tensor_parallel": self._tp_info(),
        }

    def _tp_info(self) -> dict | None:
        group = getattr(self.target, "group", None)
        if group is None:
            return None
        keys = ("rank", "device", "placement_group", "weights_bytes", "peak_rss_bytes", "load_s")
        return {
            "placement_group": group.pg.id.hex() if group.pg is not None else None,
            "workers": [{k: r.get(k) for k in keys} for r in group.reports],
            "transport": group.transport.as_dict(),
        }

    # ------------------------------------------------------------------ blocking steps (threads)
    def _prepare(self, req: dict) -> Prepared:
        from toolspec_core.engine.grammar import make_tool_constraint
        from toolspec_core.engine.loop import DecodeConfig, check_prompt
        from toolspec_core.engine.sampling import SamplingParams
        from toolspec_core.model.prompting import render_prompt

        tok = self.target.tokenizer
        tools = req["tools"] if req["tool_choice"] != "none" else []
        prompt = render_prompt(tok, req["messages"], tools or None)
        most = self.cfg.limits.prompt_tokens
        if most is not None and len(prompt) > most:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; this server takes at most {most} (limits.prompt_tokens)",
                "messages",
            )
        constraint = None
        parallel = req.get("parallel_tool_calls", True)
        answer = req.get("response_schema")
        if (tools and req["tool_choice"] not in ("auto", "none")) or answer is not None:
            vocab = getattr(self.target.model.config, "vocab_size", None)
            constraint = make_tool_constraint(tok, tools, req["tool_choice"], vocab, parallel, answer)
        room = self.target.max_context - len(prompt)
        if req["max_tokens"] is None:
            if room < 1:
                check_prompt(self.target, prompt, 1)
            max_new = min(self.cfg.max_tokens_default, room)
            pool_room = self.engine.scheduler.max_new_tokens(len(prompt)) if self.engine is not None else None
            if pool_room is not None and pool_room >= 1:
                max_new = min(max_new, pool_room)
        else:
            max_new = max(1, req["max_tokens"])
        check_prompt(self.target, prompt, max_new)
        if self.engine is not None:
            self.engine.scheduler.check_fits(len(prompt), max_new)
        temperature = req["temperature"] if req["temperature"] is not None else self.cfg.default_temperature
        sampling = SamplingParams(temperature, req["top_p"], req["top_k"], req["seed"])
        # no parallel calls: the output ends with the first call's closer (the grammar does that
        # for a forced tool_choice; fences and bare JSON hold one call in the drafted layouts)
        end_after = ("</tool_call>",) if tools and not parallel else ()
        cfg = DecodeConfig(max_new, tuple(req["stop"]), sampling, end_after, req.get("logprobs"))
        key = None
        if self.text_key and tools:
            from retrieval_service.embedding import query_text

            key = query_text(req["messages"], tools)
        return Prepared(prompt, cfg, constraint, key=key)

    def _shared_prefix(self, prep: Prepared):
        """The cached first turn of the prompt (prefilled here on a miss), or None."""
        from toolspec_core.engine.loop import prefill

        ids = prep.prompt_ids
        n = shared_prefix_len(ids, self.turn_end) if self.cfg.prefix_cache_entries else 0
        if not n:
            return None
        key = tuple(ids[:n])
        prefix = self.prefixes.get(key)
        if prefix is None:
            prefix = prefill(self.target, list(key))
            self.prefixes.put(key, prefix)
        else:
            prep.prefix_len = n
        return prefix

    def _prefill(self, prep: Prepared):
        from toolspec_core.engine.loop import prefill

        return prefill(self.target, prep.prompt_ids, self._shared_prefix(prep))

    def _decode(
        self, prep: Prepared, pre, info, on_tokens, detok=None, holder: list | None = None, prefix=None, late=None
    ):
        """Build the request's drafter, hand its sequence to the engine thread, wait for the end.

        ``pre``: the prompt prefilled in this thread; None: the engine prefills it in chunks
        between decode steps, after the cached ``prefix`` (if any). ``late``: a future of the
        retrieved calls, still being searched while the engine prefills (:class:`LateDrafter`)."""
        from toolspec_core.engine.sequence import Sequence

        if late is None:
            drafter = self.method.drafter(info)
        else:
            drafter = LateDrafter(lambda calls: self.method.drafter(dataclasses.replace(info, retrieved=calls)), late)
        seq = Sequence(
            self.target,
            prep.prompt_ids,
            drafter,
            prep.decode_cfg,
            prep.constraint,
            on_tokens,
            detok,
            prefilled=pre,
            own_cache=True,
            prefix=prefix,
        )
        if holder is not None:
            holder.append(seq)
        if self.engine is None:  # engine "threads": this thread decodes the request alone
            from toolspec_core.engine.scheduler import run_batch

            run_batch(self.target, [seq], self.cost)
        else:
            self.engine.submit(seq).wait()
        if seq.error is not None:
            raise RuntimeError(f"decoding failed: {type(seq.error).__name__}: {seq.error}") from seq.error
        result = seq.result
        if result.finish_reason != "cancelled":
            try:
                self.method.observe(info, result.tokens, result.text)
            except Exception:  # learning must never fail a finished request
                log.exception("method.observe failed")
        return result

    # ------------------------------------------------------------------ async pipeline
    async def _retrieve(self, req: dict, embedding) -> tuple[list | None, dict]:
        if self.retrieval is None or embedding is None:
            return None, {"status": "disabled"}
        names = [t["function"]["name"] for t in req["tools"]]
        return await self.retrieval.search(req["tenant"], embedding, names)

    async def stream(self, req: dict) -> AsyncIterator[dict]:
        """Events: ``start`` | ``error`` first, then ``text`` deltas, then ``done`` (the result)."""
        from toolspec_core.drafters.methods import RequestInfo
        from toolspec_core.engine.detokenize import Detokenizer

        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            prep = await loop.run_in_executor(self.pool, self._prepare, req)
        except InvalidRequestError as exc:
            yield error_event(exc)
            return
        yield {"event": "start", "prompt_tokens": len(prep.prompt_ids)}
        # a search keyed on the request text runs while the prompt is prefilled
        wants_history = self.retrieval is not None and bool(req["tools"]) and req["tool_choice"] != "none"
        embedding, search = prep.key, None
        if wants_history and embedding is not None:
            search = asyncio.ensure_future(self._retrieve(req, embedding))
        # the batched engine prefills the prompt itself, in chunks between decode steps, unless the
        # retrieval key is the prompt's hidden state (then the prefill must come first, here)
        in_engine = self.engine is not None and not (wants_history and embedding is None)
        pre, prefix = None, None
        if in_engine:
            if self.engine.scheduler.pool is None:  # a block pool caches prefixes itself
                prefix = await loop.run_in_executor(self.pool, self._shared_prefix, prep)
        else:
            pre = await loop.run_in_executor(self.pool, self._prefill, prep)
        if wants_history and embedding is None:
            from retrieval_service.embedding import from_hidden

            embedding = from_hidden(pre.hidden)
            search = asyncio.ensure_future(self._retrieve(req, embedding))
        late = None  # the search still running when the sequence enters the engine
        if search is not None and in_engine and pre is None:
            late = concurrent.futures.Future()
            search.add_done_callback(lambda task: late.set_result(task.result()[0]))
            retrieved, rinfo = None, None
        else:
            retrieved, rinfo = (await search) if search is not None else (None, {"status": "disabled"})
        if self.library is not None:
            self.library.note_tools(req["tenant"], req["tools"])
        info = RequestInfo(
            list(prep.prompt_ids),
            list(req["tools"]),
            req["tenant"],
            embedding if embedding is None or isinstance(embedding, str) else embedding.tolist(),
            req["remember"],
            retrieved if retrieved is not None else ([] if self.retrieval is not None else None),
            req.get("response_schema"),
        )
        # the decode thread writes the request's text into ``detok``; each commit hands the
        # streamer a snapshot of it (a str, so the event loop never sees it half-written)
        detok = Detokenizer(self.target.tokenizer, self.target.eos_ids)
        streamer = TextStreamer(req["stop"], prep.decode_cfg.end_after)
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        done = object()

        holder: list = []  # the request's sequence, so a client that leaves can cancel it

        def on_tokens(ids: list[int]):
            lps = holder[0].logprobs if holder else None  # appended by this thread only
            loop.call_soon_threadsafe(queue.put_nowait, (detok.text, len(lps) if lps is not None else 0))
            return not cancel.is_set()

        def run():
            try:
                return self._decode(prep, pre, info, on_tokens, detok, holder, prefix, late)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, done)

        fut = loop.run_in_executor(self.pool, run)
        sent_logprobs = 0
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                text, n_logprobs = item
                delta = streamer.feed(text)
                lps = holder[0].logprobs[sent_logprobs:n_logprobs] if n_logprobs > sent_logprobs else None
                if delta or lps:
                    sent_logprobs = max(sent_logprobs, n_logprobs)
                    ev = {"event": "text", "delta": delta}
                    if lps:
                        ev["logprobs"] = self.token_text.entries(lps)
                    yield ev
            result = await fut
        except (asyncio.CancelledError, GeneratorExit):
            cancel.set()
            self.stats.cancelled += 1
            raise
        finally:
            cancel.set()
            for seq in holder:  # Scheduler.cancel: read at the next step, also while waiting for admission
                seq.cancelled = True
        if late is not None:
            rinfo = dict((await search)[1])
            rinfo["in_time"] = bool(holder) and getattr(holder[0].drafter, "in_time", False)
        tail = streamer.finish(result.text)
        rest = result.logprobs[sent_logprobs:] if result.logprobs is not None else None
        if tail or rest:
            ev = {"event": "text", "delta": tail}
            if rest:
                ev["logprobs"] = self.token_text.entries(rest)
            yield ev
        stats = result.stats.to_dict()
        extra = {
            "method": getattr(self.method, "name", self.cfg.method),
            "prefix_cached_tokens": prep.prefix_len + result.stats.cached_tokens,
            "retrieval": rinfo,
            "replica": self.replica_id,
            "latency_s": time.perf_counter() - t0,
            "constrained": prep.constraint is not None,
        }
        yield {
            "event": "done",
            "text": result.text,
            "finish_reason": result.finish_reason,
            "prompt_tokens": len(prep.prompt_ids),
            "completion_tokens": len(result.tokens),
            "stats": {k: v for k, v in stats.items() if not k.endswith("_per_step") and k != "step_labels"},
            "extra": extra,
            "logprobs": self.token_text.entries(result.logprobs) if result.logprobs is not None else None,
        }

    async def library_admin(self, op: str, tenant: str) -> dict:
        """``forget``: delete the calls of ``tenant`` and its users from the shared library and this
        replica's history of their outputs; ``stats``: how many calls the library holds for them.
        Other engine replicas' in-memory histories (bounded per tenant) are not reached."""
        from toolspec_core.drafters.toolcall.library import MemoryLibrary

        history = getattr(self.method, "history", None)
        local = getattr(self.method, "library", None)
        if op == "forget":
            deleted = 0
            if self.retrieval is not None:
                deleted = await self.retrieval.forget_tenant(tenant)
            elif isinstance(local, MemoryLibrary):
                deleted = local.forget(tenant)
            outputs = history.forget(tenant) if history is not None else 0
            return {"tenant": tenant, "deleted": deleted, "history_outputs": outputs}
        if op == "stats":
            if self.retrieval is not None:
                out = await self.retrieval.tenant_stats(tenant)
            elif isinstance(local, MemoryLibrary):
                subs = local.tenants_of(tenant)
                out = {"tenant": tenant, "records": sum(len(local.records[t]) for t in subs), "sub_tenants": len(subs)}
            else:
                out = {"tenant": tenant, "records": 0, "sub_tenants": 0}
            return out
        raise ValueError(f"unknown library operation {op!r}")

    async def generate(self, req: dict) -> dict:
        """Non-streaming: the ``error`` or ``done`` event."""
        last: dict = {}
        async for ev in self.stream(req):
            if ev["event"] in ("error", "done"):
                last = ev
        return last

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        group = getattr(self.target, "group", None)
        if group is not None:
            group.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)


class LateDrafter:
    """A request's drafter, built at its first proposal -- once the engine has prefilled the
    prompt -- from the retrieved calls if their search has finished by then, else from none (the
    request drafts schema-only, as on a timeout). So the library search runs while the prompt is
    prefilled instead of before it, and never holds the engine up."""

    reads_logits = False

    def __init__(self, build, calls: concurrent.futures.Future):
        self.build, self.calls = build, calls
        self.inner = None
        self.in_time = False

    def propose(self, ctx):
        if self.inner is None:
            self.in_time = self.calls.done()
            self.inner = self.build(self.calls.result() if self.in_time else [])
        return self.inner.propose(ctx)

    def feedback(self, tree, result) -> None:
        if self.inner is not None:
            self.inner.feedback(tree, result)


def kv_pool_tokens(cfg: ServeAppConfig, target, tree_rows: int) -> int:
    """Tokens of the replica's KV block pool: ``kv_pool_tokens``, else on an accelerator a fraction
    of the memory free after the weights (the least of any tensor-parallel rank's), else 32768 (at
    least one full context window and a tree)."""
    if cfg.kv_pool_tokens is not None:
        return cfg.kv_pool_tokens
    budget = target.kv_budget_tokens(cfg.kv_memory_fraction)
    if budget is not None:
        return max(budget, cfg.kv_block_tokens)
    return max(32768, target.max_context + tree_rows)


def load_serving_target(cfg: ServeAppConfig):
    """Single-process target, or a tensor-parallel one whose workers are Ray actors."""
    from toolspec_core.model.target import load_target, resolve_dtype

    from .tp.placement import target_placement

    device = resolve_device(cfg.device)
    if target_placement(cfg.tensor_parallel_size, device, cfg.replica_num_gpus) == "workers":
        from .tp.placement import worker_gpus
        from .tp.target import start_tp_target

        return start_tp_target(
            cfg.model,
            cfg.tensor_parallel_size,
            cfg.dtype,
            device,
            cfg.tp_worker_num_cpus,
            worker_gpus(cfg.tp_worker_num_gpus, device),
            cfg.threads,
            cfg.tp_placement_strategy,
            cfg.tp_start_timeout_s,
        )
    return load_target(cfg.model, resolve_dtype(cfg.dtype, device), packed_rows=cfg.cpu_packed_rows, device=device)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
