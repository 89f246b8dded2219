"""The engine inside one replica: target, method, KV block pool, and the request's way through them.

No Ray here (the replica deployment wraps it; unit tests drive it directly). A request takes one
way in: one worker-thread call builds its :class:`~deployments.job.EngineJob` (prompt, limits,
grammar, decode settings), begins its library search (which runs on the event loop beside the
engine's prefill, :mod:`deployments.search`), builds its drafter and sequence and hands the
sequence to the replica's one engine thread (:mod:`deployments.bridge`: every running request
verified in one target forward per step); its text comes back as typed events
(:mod:`deployments.events`, :mod:`deployments.streaming`). Every sequence's KV lives in the
replica's block pool, whose cached blocks are the prefix cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from toolspec_core.errors import InvalidRequestError

from .bridge import EngineBridge, EngineError, SequenceStream
from .config import ServeAppConfig, served_name
from .events import Done, Event, Failed, Start
from .job import EngineJob, JobPolicy, build_job
from .protocol import APIError, ChatRequest, request_error
from .search import LateDrafter, Search
from .streaming import TextStreamer, TokenText, final_text_event, text_events

log = logging.getLogger("toolspec.serve")

# worker threads of a replica: request preparation (tokenising, grammar set-up), building
# drafters, and learning from finished outputs -- CPU work, never a wait
PREPARE_WORKERS = 4


def error_event(err: APIError) -> Failed:
    """The replica's ``Failed`` event: the request ends with this OpenAI error."""
    return Failed(err.status, err.body()["error"])


@dataclass
class HostStats:
    cancelled: int = 0  # requests whose client went away before their sequence ended


@dataclass(frozen=True, eq=False)
class Launched:
    """A request in the engine: its job, its sequence's stream, its search (None: none)."""

    job: EngineJob
    stream: SequenceStream
    search: Search | None


class EngineHost:
    """Target + method + engine of one replica. ``build`` does the heavy start-up work."""

    def __init__(self, cfg: ServeAppConfig, target, method, cost=None, library=None, retrieval=None):
        from toolspec_core.engine.scheduler import BatchLimits

        self.cfg, self.target, self.method, self.cost = cfg, target, method, cost
        self.library, self.retrieval = library, retrieval
        # the Retrieval deployment keys the request's text itself (every key but the target's hidden state)
        self.text_key = retrieval is not None and cfg.retrieval.text_key()
        self.workers = ThreadPoolExecutor(max_workers=PREPARE_WORKERS, thread_name_prefix="toolspec-prepare")
        self.token_text = TokenText(target.tokenizer, target.eos_ids)
        self.stats = HostStats()
        self.name = served_name(cfg)
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}"
        limits = BatchLimits(max_running=cfg.max_num_seqs, prefill_chunk=cfg.prefill_chunk_tokens)
        kv_pool = None  # a model family the batched forward does not cover keeps per-sequence caches
        if target.batched:
            tokens = kv_pool_tokens(cfg, target, limits.tree_rows)
            kv_pool = target.block_pool(tokens, cfg.kv_block_tokens, cfg.prefix_caching)
        self.engine = EngineBridge(target, cost, limits, kv_pool)
        self.policy = JobPolicy(  # what every job of this replica is held to
            target.tokenizer,
            getattr(target.model.config, "vocab_size", None),
            serving_limits(cfg, target, self.engine.scheduler),
            cfg.default_temperature,
            library=retrieval is not None,
            text_key=self.text_key,
        )
        self.startup: dict = {}  # what ``build`` took, and the graphs it captured

    # ------------------------------------------------------------------ start-up
    @classmethod
    def build(cls, cfg: ServeAppConfig, retrieval=None) -> "EngineHost":
        """Load the target (or start TP workers), build the method, measure the cost model."""
        import torch

        from toolspec_core.drafters.methods import make_method, method_class
        from toolspec_core.engine.cost_probe import cost_model_for
        from toolspec_core.engine.grammar import _lltokenizer
        from toolspec_core.model.openmp import release_team

        t0 = time.perf_counter()
        threads = serving_threads(cfg)
        if threads:
            torch.set_num_threads(threads)
        if retrieval is not None and not method_class(cfg.method).uses_library:
            retrieval = None  # a method that drafts nothing from the library never searches it
        target = load_serving_target(cfg)
        loaded = time.perf_counter()
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
        if cfg.model == "scripted" and cfg.scripted_tokens_per_step > 1:
            from .scripted import ScriptedMethod

            method = ScriptedMethod(target.script, cfg.scripted_tokens_per_step)
        cost = cost_model_for(cfg.cost_model, target, cfg.calibrate_cost)
        _lltokenizer(target.tokenizer)  # build llguidance's tokenizer view now, not on a request
        host = cls(cfg, target, method, cost, library, retrieval)
        built = time.perf_counter()
        graphs = warm_replica_graphs(target, host.engine.scheduler.pool, cfg, host.engine.scheduler.limits)
        release_team()  # this thread's OpenMP workers, so the engine thread's team is the only one
        done = time.perf_counter()
        host.startup = {
            "total_s": round(done - t0, 3),
            "load_s": round(loaded - t0, 3),  # the weights (or the TP workers)
            "build_s": round(built - loaded, 3),  # method, cost model, KV pool
            "graphs_s": round(done - built, 3),
            "dtype": str(target.dtype).removeprefix("torch."),
            **graphs,
        }
        log.info(
            "replica %s ready in %.1f s (weights %.1f s, method/cost/pool %.1f s, graphs %.1f s: %s; dtype %s)",
            host.replica_id,
            done - t0,
            loaded - t0,
            built - loaded,
            done - built,
            graphs["cuda_graphs"],
            host.startup["dtype"],
        )
        return host

    def info(self) -> dict:
        return {
            "replica": self.replica_id,
            "model": self.name,
            "max_context": self.target.max_context,
            "method": getattr(self.method, "name", self.cfg.method),
            "tensor_parallel_size": self.cfg.tensor_parallel_size,
            "retrieval": self.retrieval.counters() if self.retrieval is not None else None,
            "engine": self.engine.load(),
            # the compiled tool sets (``ToolSetCache``: hit rate, compile ms, bytes), where the method keeps them
            "tool_sets": tool_sets.stats() if (tool_sets := getattr(self.method, "tool_sets", None)) else None,
            "tensor_parallel": self._tp_info(),
            "startup": self.startup,
            # the draft budget's curve (measured at start-up unless configured): how much a tree may cost
            "cost_model": None if self.cost is None else cost_summary(self.cost),
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

    # ------------------------------------------------------------------ worker-thread steps
    def job(self, req: ChatRequest, tenant: str = "default", timeline: bool = False) -> EngineJob:
        """The request's job under this replica's policy (:func:`~deployments.job.build_job`)."""
        return build_job(req, self.policy, tenant, timeline)

    def _launch(self, req: ChatRequest, tenant: str, timeline: bool, loop, marks: dict) -> Launched:
        """A worker thread's whole part of a request: its job built, its search begun, its drafter
        and sequence built and the sequence handed to the engine -- one hand-over from the event
        loop, and the engine starts on the prompt while the loop is still waking."""
        job = self.job(req, tenant, timeline)
        marks["prepared"] = time.time()
        search = Search(self.retrieval, job, loop) if job.searches else None
        if search is not None and job.search_key is not None:
            search.begin(job.search_key)  # keyed on the text: runs while the engine prefills
        marks["searched"] = time.time()
        seq = self._sequence(job, search)
        marks["submitted"] = time.time()
        return Launched(job, self.engine.submit(seq, loop), search)

    def _sequence(self, job: EngineJob, search: Search | None):
        """The job's sequence and drafter. With a search, the calls it finds reach the drafter late:
        a fallback drafter is built now and the real one, in a worker thread, once the calls are in
        (:class:`~deployments.search.LateDrafter`) -- no drafter is ever built on the engine
        thread. A search keyed on the prompt's last hidden state begins when the engine has
        prefilled the prompt in its pool, and the sequence's first draft waits for the drafter
        built from what it found, the sequence decoding undrafted meanwhile (``Sequence.on_prompt``)."""
        from toolspec_core.engine.sequence import Sequence

        on_prompt = None
        if search is None:  # with a library, no calls found (None would have the method search it)
            drafter = self.method.drafter(job.request_info([] if self.retrieval is not None else None))
        else:
            built: concurrent.futures.Future = concurrent.futures.Future()
            info = job.request_info([], job.search_key)

            def build(calls) -> None:
                if built.set_running_or_notify_cancel():
                    try:
                        built.set_result(self.method.drafter(dataclasses.replace(info, retrieved=calls)))
                    except Exception as exc:
                        built.set_exception(exc)

            fallback = self.method.drafter(info)
            search.calls.add_done_callback(lambda f: self.workers.submit(build, f.result()))
            drafter = LateDrafter(built, fallback)
            if job.search_key is None:
                from retrieval_service.embedding import from_hidden

                def on_prompt(hidden):  # the engine thread, once the prompt is in the pool
                    search.begin(from_hidden(hidden))
                    return built

        return Sequence(
            self.target,
            job.prompt_ids,
            drafter,
            job.decode,
            job.constraint,
            on_prompt=on_prompt,
            decode_held=True,
            early_steps=job.timeline,
        )

    def _observe(self, run: Launched, result) -> None:
        embedding = run.search.wire_embedding() if run.search is not None else None
        retrieved = [] if self.retrieval is not None else None
        try:
            self.method.observe(run.job.request_info(retrieved, embedding), result.tokens, result.text)
        except Exception:  # learning must never fail a finished request
            log.exception("method.observe failed")

    # ------------------------------------------------------------------ the request
    async def stream(self, req: ChatRequest, tenant: str = "default", timeline: bool = False) -> AsyncIterator[Event]:
        """Events (:mod:`deployments.events`): ``Start`` | ``Failed`` first, then ``Text`` deltas,
        then ``Done`` (the result) or ``Failed`` (the engine failed the request). ``tenant``: the
        caller's library tenant; ``timeline``: the Done event carries where the request's time went.
        Closing the generator early (the client went away) cancels the request's sequence at the
        engine's next step."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        marks = {"replica_in": time.time()}  # where the request's time went (the Done event's ``timeline``)
        work = self.workers.submit(self._launch, req, tenant, timeline, loop, marks)
        try:
            run = await asyncio.wrap_future(work)
        except InvalidRequestError as exc:
            yield error_event(request_error(exc))
            return
        except Exception:  # building the request failed: the route answers a server error
            raise
        except BaseException:  # the client went away meanwhile: a sequence queued all the same ends now
            self.stats.cancelled += 1  # counted here, on the event loop: no stream is left to count it
            work.add_done_callback(_cancel_launched)
            raise
        if self.library is not None:  # the request's tool schemas, against which its output's calls are filed
            self.library.note_tools(run.job.tenant, run.job.tools)
        yield Start(len(run.job.prompt_ids))
        async for ev in self._follow(run, marks, t0):
            yield ev

    async def _follow(self, run: Launched, marks: dict, t0: float) -> AsyncIterator[Event]:
        """The launched request's ``Text`` events as the engine commits, then ``Done`` | ``Failed``."""
        job, stream = run.job, run.stream
        streamer = TextStreamer(list(job.decode.stop), job.decode.end_after)
        try:
            async for ev in text_events(stream.updates(), streamer, self.token_text, stream.seq.logprobs):
                if job.timeline:
                    marks.setdefault("first_text", time.time())
                yield ev
            result = await stream.result()
        except EngineError as exc:
            yield error_event(APIError(f"internal error: {exc}", 500, type="server_error"))
            return
        finally:
            if not stream.ended:  # the client went away: quietly, no error
                stream.cancel()
                self.stats.cancelled += 1
        if result.finish_reason != "cancelled":
            await asyncio.get_running_loop().run_in_executor(self.workers, self._observe, run, result)
        retrieval = {"status": "disabled"}
        if run.search is not None:
            retrieval = {**await run.search.report(), "in_time": stream.seq.drafter.in_time}
        last = final_text_event(streamer, self.token_text, result)
        if last is not None:
            if job.timeline:
                marks.setdefault("first_text", time.time())
            yield last
        yield self._done(job, result, retrieval, marks, t0)

    def _done(self, job: EngineJob, result, retrieval: dict, marks: dict, t0: float) -> Done:
        """The ``Done`` event of a finished sequence's ``GenerationResult``."""
        stats = result.stats.to_dict()
        marks.update(result.stats.times)
        extra = {
            "method": getattr(self.method, "name", self.cfg.method),
            "prefix_cached_tokens": result.stats.cached_tokens,
            # wall clock of the first generated token: the HTTP route turns it into first_token_ms
            "first_token_at": result.stats.times.get("first_token"),
            "retrieval": retrieval,
            "replica": self.replica_id,
            "latency_s": time.perf_counter() - t0,
            "constrained": job.constraint is not None,
        }
        if job.timeline:  # asked for: where its time went (~3 KB), the HTTP route adds its own marks
            extra.update(timeline=marks, early_steps=list(result.stats.early_steps or []))
        return Done(
            result.text,
            result.finish_reason,
            len(job.prompt_ids),
            len(result.tokens),
            {k: v for k, v in stats.items() if not k.endswith("_per_step") and k != "step_labels"},
            extra,
            self.token_text.entries(result.logprobs) if result.logprobs is not None else None,
        )

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

    async def generate(self, req: ChatRequest, tenant: str = "default", timeline: bool = False) -> Done | Failed:
        """Non-streaming: the ``Failed`` or ``Done`` event."""
        last = None
        async for ev in self.stream(req, tenant, timeline):
            if isinstance(ev, (Done, Failed)):
                last = ev
        return last

    def close(self) -> None:
        self.engine.close()
        group = getattr(self.target, "group", None)
        if group is not None:
            group.shutdown()
        self.workers.shutdown(wait=False, cancel_futures=True)


def _cancel_launched(work: concurrent.futures.Future) -> None:
    """Cancel the engine's sequence of a request whose client left while a worker launched it."""
    if not work.cancelled() and work.exception() is None:
        work.result().stream.cancel()


def serving_limits(cfg: ServeAppConfig, target, scheduler):
    """Every token limit a job of this replica is held to, resolved once: the target's window and
    the scheduler's KV pool, the server's ``max_tokens_limit`` / ``max_tokens_default`` and
    ``limits.prompt_tokens`` (:mod:`toolspec_core.engine.limits` checks them all)."""
    from toolspec_core.engine.limits import target_limits

    return dataclasses.replace(
        target_limits(target, scheduler),
        max_tokens=cfg.max_tokens_limit,
        default=cfg.max_tokens_default,
        prompt_tokens=cfg.limits.prompt_tokens,
    )


def kv_pool_tokens(cfg: ServeAppConfig, target, tree_rows: int) -> int:
    """Tokens of the replica's KV block pool: ``kv_pool_tokens``, else on an accelerator a fraction
    of the memory free after the weights (the least of any tensor-parallel rank's), else on the CPU
    ``kv_cpu_gib`` (:func:`cpu_pool_tokens`). The prefix cache lives in this pool: agents re-send
    the same tool definitions, so a pool that keeps every recent prompt skips most of a prefill."""
    if cfg.kv_pool_tokens is not None:
        return cfg.kv_pool_tokens
    budget = target.kv_budget_tokens(cfg.kv_memory_fraction)
    if budget is not None:
        return max(budget, cfg.kv_block_tokens)
    from toolspec_core.model.block_pool import kv_bytes_per_token

    per_token = kv_bytes_per_token(target.model.config, target.dtype)
    return cpu_pool_tokens(cfg.kv_cpu_gib, per_token, available_memory(), target.max_context + tree_rows)


# the pool's block bookkeeping is host lists: past a million tokens (only a toy model's KV is that
# small per token) it would cost more host memory than the cache it keeps
CPU_POOL_MAX_TOKENS = 1 << 20


def cpu_pool_tokens(gib: float, bytes_per_token: int, available: int | None, floor: int) -> int:
    """A CPU pool of ``gib`` GiB, at most half of the ``available`` bytes (None: unknown) so a
    replica that fills its cache still leaves the rest of the machine its memory, and at least
    ``floor`` tokens (one full context window and a tree: a sequence must always fit)."""
    want = int(gib * 2**30)
    if available is not None:
        want = min(want, available // 2)
    return max(min(want // bytes_per_token, CPU_POOL_MAX_TOKENS), floor)


def available_memory() -> int | None:
    """Bytes this process may still take: the host's MemAvailable, less where a cgroup (a
    Kubernetes pod's memory limit) leaves less; None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" / a huge v1 number: no limit
            left = max(int(limit) - usage, 0)
            avail = left if avail is None else min(avail, left)
        break
    return avail


def cost_summary(cost) -> dict:
    """A cost model for /health: its source and its points (a k-row forward's time over one row's)."""
    d = cost.to_dict()
    return {"source": d["source"], "points": {k: round(v, 3) for k, v in d["points"].items()}}


def serving_threads(cfg: ServeAppConfig) -> int | None:
    """Torch threads of the replica's model: ``threads`` when set; on the CPU otherwise every core
    this process may run on. Ray starts an actor with OMP_NUM_THREADS=1 when it asks for fewer
    than 2 CPUs (the replica's default asks for 1), which would leave a laptop's other cores idle
    while a prompt prefills; the model is what the replica is for. None: leave torch as it is (a
    GPU, the scripted target)."""
    import os

    if cfg.threads:
        return cfg.threads
    if cfg.model == "scripted" or resolve_device(cfg.device) != "cpu":
        return None
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def graphs_unusable(cfg: ServeAppConfig, device: str) -> str | None:
    """Why the replica cannot replay CUDA graphs on ``device`` (None: it can, or none were asked
    for). The config refuses what it can see (a cpu device, the per-sequence attention); a
    replica of ``device: auto`` that finds no GPU learns it here."""
    if not cfg.cuda_graphs:
        return None
    if device != "cuda":
        return f"the replica has no CUDA device (device {cfg.device} resolved to {device})"
    return None


def load_serving_target(cfg: ServeAppConfig):
    """Single-process target, or a tensor-parallel one whose workers are Ray actors. CUDA graphs
    the replica cannot use (:func:`graphs_unusable`) are turned off with one warning."""
    from toolspec_core.model.target import load_target, resolve_dtype

    from .tp.placement import target_placement

    if cfg.model == "scripted":
        from .scripted import scripted_target

        return scripted_target(step_s=cfg.scripted_step_s)
    device = resolve_device(cfg.device)
    graphs = cfg.cuda_graphs
    why = graphs_unusable(cfg, device)
    if why is not None:
        log.warning("cuda_graphs off: %s; decode steps run eager", why)
        graphs = False
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
            attention=cfg.attention,
            cuda_graphs=graphs,
        )
    return load_target(
        cfg.model,
        resolve_dtype(cfg.dtype, device),
        packed_rows=cfg.cpu_packed_rows,
        device=device,
        attention=cfg.attention,
        cuda_graphs=graphs,
    )


def warm_grids(limits, warm_tokens: int, pool) -> list[tuple[int, int, int]]:
    """The decode-step shapes (running sequences, rows a sequence, KV rows) a replica captures at
    start-up: every batch bucket up to ``limits.max_running``, every row bucket up to a draft
    tree's rows, every KV bucket up to ``warm_tokens`` rows (longer contexts are captured at their
    first step). Bucketed as :mod:`toolspec_core.model.graphs` buckets a step."""
    from toolspec_core.model.graphs import BATCH_BUCKETS, ROW_BUCKETS, bucket, kv_bucket

    top_b = bucket(limits.max_running, BATCH_BUCKETS) or BATCH_BUCKETS[-1]
    top_n = bucket(limits.tree_rows, ROW_BUCKETS) or ROW_BUCKETS[-1]
    kv, rows = [], 1
    while rows <= warm_tokens:
        s = kv_bucket(rows, pool)
        if s is None:
            break
        if s not in kv:
            kv.append(s)
        rows = s + 1
    return [(b, n, s) for b in BATCH_BUCKETS if b <= top_b for n in ROW_BUCKETS if n <= top_n for s in kv]


def warm_replica_graphs(target, pool, cfg: ServeAppConfig, limits) -> dict:
    """Capture the replica's CUDA graphs now (:func:`warm_grids`), not on a request; what it did,
    for the start-up report. A tensor-parallel target's ranks capture theirs at first use."""
    if getattr(target, "group", None) is not None:  # tensor parallel: the ranks own the step runners
        on = cfg.cuda_graphs and graphs_unusable(cfg, resolve_device(cfg.device)) is None
        return {"cuda_graphs": "on the ranks, captured at first use" if on else "off", "graph_shapes": 0}
    if not getattr(target, "cuda_graphs", False):
        return {"cuda_graphs": "off (no CUDA device)" if cfg.cuda_graphs else "off", "graph_shapes": 0}
    if pool is None:  # a model family the batched forward does not cover: no pool, no graphed step
        return {"cuda_graphs": "off (no KV block pool for this model family)", "graph_shapes": 0}
    grids = warm_grids(limits, cfg.cuda_graphs_warm_tokens, pool)
    try:
        target.warm_graphs(pool, grids)
    except RuntimeError as exc:  # a kernel this GPU / torch cannot capture: eager steps, said once
        log.warning("cuda_graphs off: capturing the decode steps failed (%s); decode steps run eager", exc)
        target.cuda_graphs = False
        target.runner(pool).graphs = None  # the kept runner of this pool steps eager from now on
        return {"cuda_graphs": f"off (capture failed: {type(exc).__name__})", "graph_shapes": 0}
    return {"cuda_graphs": "on", "graph_shapes": len(grids)}


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
