"""The step scheduler: every running sequence proposes, all are verified in one forward, each commits.

One :meth:`Scheduler.step` is one target forward. It admits waiting sequences (limits: running
sequences and reserved KV rows), gives at most ``prefill_chunk`` prompt rows to sequences still
prefilling -- so a long prompt stalls the running sequences by one chunk a step at most --,
asks each decoding sequence's drafter for its tree, cuts all trees together under one budget
(:meth:`~toolspec_core.engine.budget.CostModel.allocate`), runs one forward over the rows of all
sequences (:meth:`~toolspec_core.model.target.Target.forward`), then walks, commits, emits and
feeds back per sequence. On an accelerator the greedy sequences' walks run there, all at once
(:mod:`~toolspec_core.model.device_walk`), and one small copy per step comes back; a pool's KV
commits of a step go as one slot move. A single request is a batch of one through the same step
(:func:`toolspec_core.engine.loop.decode`).

With a :class:`~toolspec_core.model.block_pool.BlockPool`, admission gives each sequence a block
table: the cached blocks its prompt begins with (those rows are not prefilled again) and its own
blocks for the rest of the prompt, ``max_new_tokens`` and one draft tree. A sequence the pool has
no room for waits (first come, first served) until finished sequences give blocks back; its full
blocks are registered for later prompts when its prefill completes and when it finishes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.commit import commit_kv, kv_rows
from toolspec_core.engine.limits import target_limits
from toolspec_core.engine.planner import Chunk, Decode, plan_step, prefill_chunks
from toolspec_core.engine.sequence import Sequence, cap_depth
from toolspec_core.engine.stats import EARLY_STEPS, record_step
from toolspec_core.engine.verify import VerifyResult, walk
from toolspec_core.model.block_pool import BlockPool
from toolspec_core.model.device_walk import read_walks
from toolspec_core.model.step_plan import SeqRows, StepPlan
from toolspec_core.model.step_runner import StepOutput
from toolspec_core.spec.proposer import NoDrafter, Proposer
from toolspec_core.spec.tree import DraftTree, select

log = logging.getLogger("toolspec.engine")

HOLD_WAIT_S = 0.005  # the longest a step with nothing else to run waits for a held sequence
# The drafters' floor (``DraftContext.min_prob``) is this share of the last step's best left-out
# path probability, in a step with as many decoding sequences as that one (the cut depends on the
# batch: with fewer sequences rows are cheaper for what each step yields, so a floor from a fuller
# batch would drop nodes the budget keeps); the cut still moves with the trees, so a drafter builds
# nodes down to half of it.
FLOOR_SHARE = 0.5


@dataclass(frozen=True)
class BatchLimits:
    """What one scheduler runs at once: ``max_running`` sequences, whose reserved KV rows (prompt +
    max_new_tokens each) sum to at most ``max_kv_tokens`` (None: no limit; with a block pool the
    pool's free blocks are the limit); ``prefill_chunk`` prompt rows per step; ``tree_rows``: KV
    rows a pooled sequence keeps for one draft tree beyond its tokens (a larger tree is cut)."""

    max_running: int = 16
    max_kv_tokens: int | None = None
    prefill_chunk: int = 512
    tree_rows: int = 64

    def __post_init__(self):
        for name in ("max_running", "prefill_chunk", "tree_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_kv_tokens is not None and (not isinstance(self.max_kv_tokens, int) or self.max_kv_tokens <= 0):
            raise ValueError(f"max_kv_tokens must be a positive integer or None, got {self.max_kv_tokens!r}")

    def rows_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """KV rows a pooled sequence may come to hold: its prompt, its output and one draft tree --
        what admission reserves in the pool, and what a pool made for given sequences must hold."""
        return prompt_tokens + max_new_tokens + self.tree_rows


@dataclass
class StepRecord:
    """One step: rows of the forward (prefill + decode), sequences decoded, and where the time went.

    ``rows`` = ``prefill_rows`` + ``root_rows`` + ``draft_rows``, so time per row by row count and
    by mix (a prefill chunk sharing the step or not) can be read from a run's records under load.
    ``host_s`` splits into ``draft_s`` (drafters' trees), ``budget_s`` (the batch budget),
    ``inputs_s`` (the forward's rows, positions and trees' parent rows; a path that takes a float
    mask builds it inside the forward) and ``commit_s`` (walks, KV commits,
    drafter feedback, emits); the rest (admission, prefill bookkeeping) is the difference.
    """

    rows: int
    prefill_rows: int
    sequences: int
    forward_s: float
    host_s: float  # drafting + budget + walks + commits + emits
    root_rows: int = 0  # decoding sequences' root chains
    draft_rows: int = 0  # draft-tree nodes the budget kept
    draft_s: float = 0.0
    budget_s: float = 0.0
    inputs_s: float = 0.0
    commit_s: float = 0.0
    handover_s: float = 0.0  # the step's plan reaching every rank (a tensor-parallel target; part of forward_s)
    side_s: float = 0.0  # host work needing no result of the step (Scheduler._side_job), wherever it ran
    hidden_s: float = 0.0  # the part of side_s that ran while the forward did (overlap on; not in host_s)


@dataclass
class _Step:
    """A step in flight: what was planned (prompt chunks, decoding sequences, the plan) and when
    its phases ended."""

    chunks: list[Chunk]
    decodes: list[Decode]
    plan: StepPlan
    root_rows: int
    draft_s: float
    budget_s: float
    planned: float  # perf_counter when drafting and the budget were done
    inputs: float = 0.0  # perf_counter when the plan was made and the forward began
    forward_s: float = 0.0
    side_s: float = 0.0
    hidden_s: float = 0.0
    inline: bool = False  # the side work ran before the forward, on this thread

    @property
    def prefill_rows(self) -> int:
        return sum(c.n for c in self.chunks)

    @property
    def decoding(self) -> list[tuple[Decode, SeqRows]]:
        return list(zip(self.decodes, self.plan.seqs[len(self.chunks) :]))


class Scheduler:
    """Owns the waiting and running sequences of one target and runs them a step at a time.

    ``cost``: the budget's curve over total rows of a forward (None: trees as drafted); ``pool``:
    the KV block pool sequences are admitted into (None: each sequence grows its own cache);
    ``device_walk``: walk greedy trees where the argmax is (None: as the target's ``device_walk``
    says, asked once: on an accelerator; on the CPU there is no device-to-host copy to save, so the
    plain Python walk is kept);
    ``overlap``: run the step's host work that needs no result of it while the forward runs
    (:meth:`_beside_forward`; None: :func:`forward_overlaps_host` -- on where the target's
    forward runs elsewhere, an accelerator's; False runs it inline before the forward).
    Not thread-safe: one thread steps it (the server's engine thread).
    """

    def __init__(
        self,
        target,
        cost: CostModel | None = None,
        limits: BatchLimits = BatchLimits(),
        pool: BlockPool | None = None,
        device_walk: bool | None = None,
        overlap: bool | None = None,
    ):
        self.target, self.cost, self.limits, self.pool = target, cost, limits, pool
        # where the walks run: as given, else as the target says (its device does not change under
        # a scheduler; asked once, not every step -- a model's device is a walk over its parameters)
        self.device_walk = bool(getattr(target, "device_walk", False)) if device_walk is None else device_walk
        self.overlap = forward_overlaps_host(target) if overlap is None else bool(overlap)
        if cost is not None:
            cost.ensure_rows(limits.max_running * (cost.max_nodes + 2) + limits.prefill_chunk)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps: list[StepRecord] = []
        self._worker = None  # the thread that runs host work beside the forward (_beside_forward)
        self._floor = 0.0  # the drafters' floor in this step (_plan, DraftContext.min_prob)
        self._last_cut: tuple[int, float] = (0, 0.0)  # (decoding sequences, floor) of the last step's cut
        self._unrecorded: list[tuple[Sequence, DraftTree, VerifyResult]] = []  # steps whose stats wait (_commit)

    def add(self, seq: Sequence) -> Sequence:
        """Queue ``seq``. A job's limits are checked before it is made
        (:func:`toolspec_core.engine.limits.token_budget`, with :func:`~toolspec_core.engine.limits.target_limits`
        of this scheduler); one the whole pool could never hold -- it would wait forever -- is a bug here."""
        if self.pool is not None and not target_limits(self.target, self).holds(
            len(seq.prompt_ids), seq.cfg.max_new_tokens
        ):
            raise ValueError(
                f"sequence {seq.id} ({len(seq.prompt_ids)} prompt + {seq.cfg.max_new_tokens} new tokens) can never "
                f"be held by the KV pool of {self.pool.capacity_tokens} tokens; check it with toolspec_core.engine.limits first"
            )
        seq.stats.times.setdefault("queued", time.time())
        self.waiting.append(seq)
        return seq

    def _rows_needed(self, seq: Sequence) -> int:
        return self.limits.rows_for(len(seq.prompt_ids), seq.cfg.max_new_tokens)

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq`` at the next step (finish_reason "cancelled"); the others are untouched."""
        seq.cancelled = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> None:
        while self.has_work():
            idle, waiting = not self.running, len(self.waiting)
            self.step()
            if idle and len(self.waiting) == waiting:  # nothing admitted, nothing running to free blocks
                raise RuntimeError(
                    f"a waiting sequence needs {self._rows_needed(self.waiting[0])} KV rows and the pool "
                    "cannot free that many (its other blocks are pinned or referenced)"
                )

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Sequence]:
        """One forward over every running sequence; returns the sequences that finished in it."""
        t0 = time.perf_counter()
        finished = self._admit_step()
        st = self._plan()
        if st is None:  # nothing to run
            self._wait_held()
            return finished
        out = self._forward(st)
        walks, choice = self._accept(st, out)
        self._commit_step(st, out, walks, choice, finished, t0)
        return finished

    def _admit_step(self) -> list[Sequence]:
        """Admit: holds released, cancelled waiting sequences ended, waiting ones admitted while
        they fit, cancelled or finished running ones reaped; the sequences that ended."""
        for seq in self.running:  # a first draft whose retrieval finished goes ahead this step
            seq.release_hold()
        finished: list[Sequence] = []
        for seq in list(self.waiting):
            if seq.cancelled:
                self.waiting.remove(seq)
                seq.reason = "cancelled"
                seq.finish()
                finished.append(seq)
        self._admit()
        self._reap(finished)
        return finished

    def _plan(self) -> _Step | None:
        """Plan: the prompt chunks, every decoding sequence's tree (drafted, fitted to its KV room,
        cut under the budget) and the step's :class:`~toolspec_core.model.step_plan.StepPlan`
        (:func:`~toolspec_core.engine.planner.plan_step`). None: no rows to run."""
        wall0 = time.time()  # the step's rows are chosen from here
        chunks = prefill_chunks(self.running, self.limits.prefill_chunk)
        for c in chunks:
            c.seq.stats.times.setdefault("prefill_start", wall0)
            c.seq.filled += c.n
        decoding = [s for s in self.running if s.decoding]
        root_rows = sum(len(s.roots) for s in decoding)
        ta = time.perf_counter()
        n, floor = self._last_cut
        self._floor = floor if n == len(decoding) else 0.0
        drafted = iter(self._propose_all([s for s in decoding if not s.held]))
        # a held sequence that decodes (``Sequence.decode_held``) does so undrafted
        trees = [fit_room(seq, DraftTree() if seq.held else next(drafted)) for seq in decoding]
        tb = time.perf_counter()
        if self.cost is not None and decoding:
            cut = self.cost.allocate(trees, root_rows)  # as in a decode-only step: the chunk rides on top
            trees, self._last_cut = cut.trees, (len(decoding), FLOOR_SHARE * cut.left_out)
        tc = time.perf_counter()
        if not chunks and not decoding:
            return None
        decodes = [Decode(seq, tree, seq.cache.get_seq_length()) for seq, tree in zip(decoding, trees)]
        plan = plan_step(chunks, decodes, bool(self.device_walk))
        return _Step(chunks, decodes, plan, root_rows, tb - ta, tc - tb, tc)

    def _forward(self, st: _Step) -> StepOutput:
        """Forward: the target's step over the plan, with the host work that needs no result of it
        (:meth:`_side_job`) beside it (``overlap``) or before it."""
        job = self._side_job()
        inline = side_work(*job) if job is not None and not self.overlap else None  # before the forward
        t1 = time.perf_counter()
        out, beside, ended = self._beside_forward(st.plan, job if self.overlap else None)  # waits for the forward
        t2 = time.perf_counter()
        end = t2 if ended is None else min(ended, t2)
        st.side_s, st.hidden_s = side_times(inline or beside, t1, end)
        st.inputs, st.forward_s, st.inline = t1, end - t1, inline is not None
        return out

    def _commit_step(self, st: _Step, out: StepOutput, walks, choice, finished: list[Sequence], t0: float) -> None:
        """Commit: completed prompts start their output, every decoding sequence commits its walk
        (one KV slot move for the batch), finished sequences are reaped and the step recorded."""
        fwd = st.forward_s
        self._prompts_done(st, out, choice)
        t3 = time.perf_counter()
        with self.pool.together() if self.pool is not None else nullcontext():  # one KV slot move for the batch
            for (d, rows), result in zip(st.decoding, walks):
                self._commit(d, rows, out, fwd, result, choice)
        t4 = time.perf_counter()
        total_rows = st.plan.rows
        if self.cost is not None:  # steps with a prefill chunk too: the curve learns what they cost under load
            self.cost.observe(total_rows, fwd)
        self._reap(finished)
        draft_rows = sum(len(d.tree) for d in st.decodes)
        note_early_steps(st, time.time(), fwd, total_rows, st.root_rows + draft_rows)
        self.steps.append(
            StepRecord(
                rows=total_rows,
                prefill_rows=st.prefill_rows,
                sequences=len(st.decodes),
                forward_s=fwd,
                host_s=time.perf_counter() - t0 - fwd,
                root_rows=st.root_rows,
                draft_rows=draft_rows,
                draft_s=st.draft_s,
                budget_s=st.budget_s,
                inputs_s=st.inputs
                - st.planned
                - (st.side_s if st.inline else 0.0),  # side work before the forward: its own
                commit_s=t4 - t3,
                handover_s=out.handover_s,
                side_s=st.side_s,
                hidden_s=st.hidden_s,
            )
        )

    def _prompts_done(self, st: _Step, out: StepOutput, choice) -> None:
        """Each prompt chunk's forward time and kept states; a completed prompt's first token(s),
        its last state to ``on_prompt`` and its blocks registered for later prompts."""
        for c, rows in zip(st.chunks, st.plan.seqs):
            seq = c.seq
            seq.stats.prefill_s += st.forward_s
            if seq.states is not None:
                seq.states.append(out.hidden[rows.hidden : rows.hidden + rows.hiddens].cpu())
            if c.done:
                first = out.rows(rows.logit, 1)
                seq.start(None if first is None else first[0].cpu(), None if choice is None else choice[rows.logit])
                seq.stats.times["first_token"] = time.time()
                self._prompt_done(seq, out.hidden[rows.hidden + rows.hiddens - 1].cpu())
                seq.cache.register(seq.prompt_ids)  # later prompts that begin with this one reuse its blocks

    @staticmethod
    def _prompt_done(seq: Sequence, hidden: torch.Tensor) -> None:
        """``seq``'s prompt is in its cache: its last state [H] to the sequence and its ``on_prompt``
        hook (e.g. a retrieval search keyed on it); a hook that fails leaves the first draft unheld."""
        try:
            seq.prompt_done(hidden)
        except Exception:
            log.exception("on_prompt of sequence %s failed; it drafts without waiting for it", seq.id)
            seq.hold = None

    def _wait_held(self) -> None:
        """A step with nothing to run while sequences wait for their first draft (``Sequence.hold``):
        wait for one of them a little (:data:`HOLD_WAIT_S` at most, so sequences queued meanwhile
        are admitted soon) instead of spinning."""
        held = [s.hold for s in self.running if s.held]
        if held:
            wait(held, timeout=HOLD_WAIT_S, return_when=FIRST_COMPLETED)

    def _node_hint(self) -> int | None:
        """Nodes one tree can keep under the budget (``DraftContext.max_nodes``): the cost model's
        per-tree cap (None without a budget: trees as drafted)."""
        return None if self.cost is None else self.cost.max_nodes

    def _propose_all(self, seqs: list[Sequence]) -> list[DraftTree]:
        """Every decoding sequence's tree, drafted in one batch call
        (:meth:`~toolspec_core.spec.proposer.Proposer.propose`); a drafter that fails is dropped (the
        sequence decodes on without drafts, its output unchanged) so it cannot stop the batch."""
        t = time.perf_counter()
        hint, floor = self._node_hint(), self._floor
        ctxs = []
        for seq in seqs:
            ctx = seq.context()
            ctx.max_nodes, ctx.min_prob = hint, floor
            ctxs.append(ctx)
        trees = []
        for seq, ctx, tree in zip(seqs, ctxs, Proposer.propose([s.drafter for s in seqs], ctxs)):
            if isinstance(tree, BaseException):
                log.error("drafter of sequence %s failed; it decodes on without drafts", seq.id, exc_info=tree)
                seq.drafter, tree = NoDrafter(), DraftTree()
            trees.append(cap_depth(tree, ctx.max_depth))
        share = (time.perf_counter() - t) / max(1, len(seqs))  # the batch's time, shared out
        for seq in seqs:
            seq.stats.draft_s += share
        return trees

    def _side_job(self) -> tuple[list, list, list] | None:
        """The step's host work that needs no result of it (:func:`side_work`'s arguments): the
        prompt-side drafting work of sequences that have not drafted yet (waiting, or still
        prefilling) and the statistics of the last step's commits (:meth:`_commit`). None: none."""
        todo = [
            s
            for s in list(self.waiting) + self.running
            if not s.prepared and not s.decoding and s.reason is None and s.drafter.prepares
        ]
        for s in todo:
            s.prepared = True
        unrecorded, self._unrecorded = self._unrecorded, []
        if not todo and not unrecorded:
            return None
        return [s.drafter for s in todo], [list(s.prompt_ids) for s in todo], unrecorded

    def _beside_forward(self, plan: StepPlan, job) -> tuple[StepOutput, tuple[float, float] | None, float | None]:
        """The step's forward with ``job`` (:meth:`_side_job`; None: nothing beside it) running
        while it does. A target that launches its step (``launch(plan, pool)``, whose ``result()``
        waits for the forward and whose ``done_at`` is then when it ended: the replay's step model)
        runs the job on this thread between the two; any other target's ``step`` runs while the
        worker thread does the job (its forward must release the GIL: an accelerator's copy back).
        Returns the output, the job's (start, end) ``perf_counter`` (None: no job) and when the
        forward ended (None: when it returned)."""
        launch = getattr(self.target, "launch", None) if job is not None else None
        if launch is not None:
            pending = launch(plan, self.pool)
            times = side_work(*job)
            out = pending.result()
            return out, times, pending.done_at
        if job is None:
            return self.target.step(plan, self.pool), None, None
        if self._worker is None:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = ThreadPoolExecutor(1, thread_name_prefix="toolspec-beside-forward")
        side = self._worker.submit(side_work, *job)
        out = self.target.step(plan, self.pool)
        return out, side.result(), None

    def _record_unrecorded(self) -> None:
        """The statistics :meth:`_commit` left for the next step's side work, recorded now (a
        sequence about to finish: its result carries them)."""
        unrecorded, self._unrecorded = self._unrecorded, []
        for seq, tree, result in unrecorded:
            record_step(seq.stats, tree, result)

    def fail_all(self, exc: BaseException) -> list[Sequence]:
        """A step raised: every sequence ends with finish_reason "error" and ``seq.error`` (their KV
        state is no longer known to be consistent, so none of it is registered for reuse); the
        scheduler is empty and usable again."""
        self._record_unrecorded()
        out = list(self.waiting) + self.running
        self.waiting.clear()
        self.running = []
        for seq in out:
            if seq.cache is not None:
                seq.cache.release()
            seq.reason, seq.error = "error", exc
            seq.finish()
        return out

    @staticmethod
    def _accept(st: _Step, out: StepOutput) -> tuple[list[VerifyResult | None], list[int | None] | None]:
        """Accept: the step's walks done where the argmax is, one per decoding sequence (None: it
        walks on the host, in :meth:`_commit`) and the argmax of the logit indices host code reads
        (None elsewhere)."""
        it = iter(read_walks(out.walks))
        return [next(it) if rows.walk >= 0 else None for _, rows in st.decoding], out.choice

    def _commit(
        self, d: Decode, rows: SeqRows, out: StepOutput, fwd: float, result: VerifyResult | None, choice
    ) -> None:
        """Commit one sequence's step: its walk (``result`` when done on the device), KV commit,
        drafter feedback, statistics and emitted tokens. ``choice``: the argmax on the host of the
        logit indices a host walk reads (:meth:`_accept`)."""
        seq, tree = d.seq, d.tree
        t = time.perf_counter()
        own = out.rows(rows.logit, rows.logits)  # [R+T, V] this sequence's rows (None: only their argmax came back)
        root_row = len(seq.roots) - 1
        if result is None:
            mine = None if choice is None else choice[rows.logit : rows.logit + rows.logits]
            result = walk(tree, own, seq.cfg.sampling, seq.gen, seq.constraint, root_row, mine)
        commit_kv(seq.cache, d.kv_len, kv_rows(result.path, len(seq.roots)))
        result.logits = own  # for drafters that learn from the target (token recycling)
        try:
            Proposer.feedback(seq.drafter, tree, result)
        except Exception:
            log.exception("drafter feedback of sequence %s failed; it decodes on without drafts", seq.id)
            seq.drafter = NoDrafter()
        forced = seq.constraint.forced() if seq.constraint is not None else []
        seq.stats.forced += len(forced)
        chosen = [tree.tokens[i] for i in result.path] + [result.token]
        # token k of ``chosen`` was chosen at the row of its parent: the root's, then each accepted node's
        rows = [root_row] + [root_row + 1 + i for i in result.path]
        logprobs = seq.token_logprobs(own[rows], chosen, forced) if seq.logprobs is not None else None
        seq.emit(chosen + forced, logprobs)
        seq.roots = [result.token] + forced
        if self.overlap and seq.reason is None:  # counted beside the next forward (_beside_forward)
            self._unrecorded.append((seq, tree, result))
        else:
            record_step(seq.stats, tree, result)
        seq.stats.verify_s += fwd
        seq.stats.verify_step_s.append(fwd)
        seq.stats.commit_s += time.perf_counter() - t

    def _admit(self) -> None:
        lim = self.limits
        reserved = sum(s.reserved_tokens for s in self.running)
        while self.waiting and len(self.running) < lim.max_running:
            seq = self.waiting[0]
            if self.pool is not None:
                if not self._place(seq):  # the pool is full: wait for blocks (first come, first served)
                    break
            else:
                fits = lim.max_kv_tokens is None or reserved + seq.reserved_tokens <= lim.max_kv_tokens
                if not fits and self.running:  # one sequence alone is always admitted: nothing else would free room
                    break
                self._place(seq)
            self.waiting.popleft()
            self.running.append(seq)
            seq.stats.times["admitted"] = time.time()
            reserved += seq.reserved_tokens

    def _place(self, seq: Sequence) -> bool:
        """Open ``seq``'s KV cache: the one place a sequence's cache is set (``Sequence.place_cache``).

        With a pool, a block table opened by the pool: the prompt's cached prefix blocks (at
        least one prompt token is left to prefill: its logits start the output), then its own
        blocks for the rest of the prompt, ``max_new_tokens`` and one draft tree; the scheduler
        prefills the rest. False: the pool has no room yet. Without a pool (a family the batched
        forward does not cover), a cache of the sequence's own (the target's :meth:`new_cache`)."""
        pool = self.pool
        if pool is None:
            seq.place_cache(self.target.new_cache(), 0)
            return True
        shared, keys = pool.match(seq.prompt_ids, len(seq.prompt_ids) - 1)
        need = pool.blocks_for(self._rows_needed(seq)) - len(shared)
        if need > pool.available():
            pool.release(shared)
            return False
        cache = pool.open(shared + pool.allocate(need), len(shared), keys)
        pool.count_query(len(seq.prompt_ids), cache.length)
        seq.place_cache(cache, cache.length)
        seq.stats.cached_tokens = cache.length
        return True

    def _reap(self, finished: list[Sequence]) -> None:
        if self._unrecorded and any(s.cancelled or s.reason is not None for s in self.running):
            self._record_unrecorded()
        for seq in list(self.running):
            if seq.cancelled and seq.reason is None:
                seq.reason = "cancelled"
            if seq.reason is not None:
                self.running.remove(seq)
                if seq.cache is not None:  # a pooled cache's committed rows stay findable until evicted
                    seq.cache.release(seq.tokens)
                seq.finish()
                finished.append(seq)


def forward_overlaps_host(target) -> bool:
    """Whether to run host work beside ``target``'s forward: as the target says
    (``forward_elsewhere``), no where it says nothing. A torch forward releases the GIL, so on an
    accelerator (or the replay's step model, which sleeps) the work is hidden behind it; on the CPU
    the forward already uses every core, and a worker thread would only add a hand-over a step."""
    return bool(getattr(target, "forward_elsewhere", False))


def side_work(drafters: list, prompts: list[list[int]], unrecorded: list) -> tuple[float, float]:
    """The step's host work that needs no result of it (:meth:`Scheduler._side_job`):
    drafters' prompt-side work (:meth:`~toolspec_core.spec.proposer.Proposer.prepare`) and the last
    step's per-sequence statistics. Returns its (start, end) ``time.perf_counter``."""
    t = time.perf_counter()
    Proposer.prepare(drafters, prompts)
    for seq, tree, result in unrecorded:
        record_step(seq.stats, tree, result)
    return t, time.perf_counter()


def side_times(side: tuple[float, float] | None, t1: float, t2: float) -> tuple[float, float]:
    """The side work's seconds and the part of them inside the forward ``t1 .. t2``."""
    if side is None:
        return 0.0, 0.0
    a, b = side
    return b - a, max(0.0, min(b, t2) - max(a, t1))


def keeps_early_steps(seq: Sequence) -> bool:
    """Whether ``seq`` asked for its timeline and has fewer than ``EARLY_STEPS`` steps noted."""
    steps = seq.stats.early_steps
    return steps is not None and len(steps) < EARLY_STEPS


def note_early_steps(st: _Step, end: float, fwd: float, total: int, decode: int) -> None:
    """What a step carried, kept on each of its sequences that keeps early steps, for their first
    ``EARLY_STEPS`` steps (``GenerationStats.early_steps``, None where not kept): when it ended (wall clock), its forward's seconds, its rows
    (all / prompt rows / decoding rows), this sequence's own rows and its output tokens after it --
    so a load study can tell where a first token (and a first streamed chunk) waited."""
    held = [(c.seq, c.n, "prefill") for c in st.chunks if keeps_early_steps(c.seq)]
    held += [(d.seq, rows.n, "decode") for d, rows in st.decoding if keeps_early_steps(d.seq)]
    if not held:  # no timeline asked (the default)
        return
    step = {
        "end": round(end, 4),
        "forward_s": round(fwd, 4),
        "rows": total,
        "prefill_rows": st.prefill_rows,
        "decode_rows": decode,
    }
    for seq, n, kind in held:
        seq.stats.early_steps.append({**step, "kind": kind, "own_rows": n, "generated": len(seq.generated)})


def fit_room(seq: Sequence, tree: DraftTree) -> DraftTree:
    """``tree`` cut to the KV rows a pooled sequence has left after its root chain (parents
    precede children, so the first nodes are a tree)."""
    room = seq.cache.room()  # None: the cache grows
    room = len(tree) if room is None else room - len(seq.roots)
    return tree if len(tree) <= room else select(tree, list(range(max(0, room))))


def run_batch(
    target,
    seqs: list[Sequence],
    cost: CostModel | None = None,
    limits: BatchLimits | None = None,
    pool: BlockPool | None = None,
):
    """Decode ``seqs`` together to the end; their results in order."""
    sched = Scheduler(target, cost, limits or BatchLimits(max_running=max(1, len(seqs))), pool)
    for s in seqs:
        sched.add(s)
    sched.run()
    return [s.result for s in seqs]
