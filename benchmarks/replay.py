"""The replay target: the embedded model's plain-greedy outputs, recorded once, served without a forward.

``toolspec bench --batch ... --target replay`` measures the engine's host work -- drafting, the
budget, inputs, commits -- at any batch size on a CPU in minutes: :class:`ReplayTarget` answers
every logit row with the argmax the real model gives there, read from a recording of each dev
item's plain-greedy output (``python -m benchmarks.replay record``). A row whose prefix (the
sequence's committed tokens, then its ancestors in the draft tree) follows the recorded output is
answered with the recorded next token; any other row with a token no draft of that step holds.
Acceptance, MAT, the trees the drafters build and every output are therefore the real model's,
while the forward costs nothing but this lookup (it shows in the forward column, not the host
ones).

How it knows a sequence: its "forward" writes each row's token id into the KV storage (layer 0,
K, every slot of the row), so the committed tokens of any cache -- a prompt's cached prefix
blocks, a commit that moved rows -- are read back from the cache itself, and the
recording whose prompt + output begins with them is the sequence's. The model under it is a
one-layer random Qwen2 of width 8 over the embedded tokenizer (the KV pool and vocabulary are sized
from it). The retrieval key the bench gives the call library (the prompt's last hidden state) is
recorded too (float16), so library search ranks past calls as with the real model.

With a step model (``--step-model FILE``, :mod:`benchmarks.step_model`) each step lasts as long
as the forward of its batch and rows on the GPU the model was measured on: the lookup runs, then
the target sleeps (``time.sleep``, the GIL released) to the modelled end. The step is launched
(:meth:`ReplayTarget.launch`: the lookup, standing for a GPU step's launch) and then waited for
(:class:`Launched`), so host work the scheduler runs beside the forward (``Scheduler.overlap``,
on by default for such a target: ``forward_elsewhere``) runs between the two, on the scheduler's
own thread, and the bench's tokens/s are a projection for that GPU. The lookup takes its part of
the modelled window (a graphed GPU step's launch is shorter), so the host time hidden behind the
forward is if anything understated.

Recording: batched plain greedy (``Scheduler`` with no drafter, ``--batch-size`` sequences at a
time), which the engine's tests hold equal to single-stream plain greedy.

    python -m benchmarks.replay record --limit 64 --out benchmarks/datasets/greedy-qwen2.5-coder-0.5b.jsonl.gz
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import gzip
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.step_model import StepModel
from toolspec_core.model.step_plan import StepPlan
from toolspec_core.model.step_runner import StepOutput, answer
from toolspec_core.model.target import Target, from_model

RECORDING = Path(__file__).parent / "datasets" / "greedy-qwen2.5-coder-0.5b.jsonl.gz"


def prompt_key(prompt_ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(prompt_ids).encode()).hexdigest()[:16]


def encode_hidden(h: torch.Tensor) -> str:
    return base64.b64encode(h.to(torch.float16).numpy().tobytes()).decode()


def decode_hidden(s: str) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.float16).copy()).float()


def load_recording(path: str | Path = RECORDING, tokenizer=None) -> list[dict]:
    """The recorded rows; with ``tokenizer``, each with its ``prompt_ids`` rendered again from its
    dev set (the recording keeps only their hash), rows whose prompt no longer renders the same left out."""
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if tokenizer is None:
        return rows
    from benchmarks.data import load_items, prompt_ids
    from benchmarks.datasets import dev_set

    items: dict[tuple, dict] = {}
    for bench in sorted({r["benchmark"] for r in rows}):
        items.update({(bench, it["id"]): it for it in load_items(dev_set(bench))})
    out = []
    for r in rows:
        it = items.get((r["benchmark"], r["id"]))
        ids = prompt_ids(tokenizer, it) if it is not None else None
        if ids is not None and prompt_key(ids) == r["prompt_key"]:
            out.append({**r, "prompt_ids": ids})
        else:
            print(f"replay: {r['benchmark']} {r['id']}: prompt changed since recorded, left out", file=sys.stderr)
    return out


@dataclasses.dataclass
class _Rec:
    full: list[int]  # prompt + recorded output
    prompt_len: int
    hidden: torch.Tensor  # [H] the prompt's last hidden state (float16 -> float32)


@dataclasses.dataclass
class ReplayTarget(Target):
    """A target whose every logit row's argmax is the recorded plain-greedy one (module docstring).

    ``records``: ``load_recording`` rows whose prompts this target can serve; ``max_new_tokens``:
    the recording's length bound (a longer decode would need tokens never recorded)."""

    records: tuple = ()
    max_new_tokens: int = 0
    step_model: StepModel | None = None  # each step lasts its modelled forward (module docstring)

    def __post_init__(self):
        super().__post_init__()
        self._by_first: dict[tuple, list[_Rec]] = {}
        self._owner: dict[int, tuple] = {}  # id(cache) -> (cache, its record)
        for r in self.records:
            full = list(r["prompt_ids"]) + list(r["tokens"])
            rec = _Rec(full, len(r["prompt_ids"]), decode_hidden(r["hidden"]))
            self._by_first.setdefault(tuple(full[:8]), []).append(rec)
        vocab = self.model.config.vocab_size
        self.off = (vocab - 1, vocab - 2)  # tokens no recording writes: the answer where nothing was recorded

    def recorded(self) -> set[tuple[str, str]]:
        """(benchmark, id) of every recorded item."""
        return {(r["benchmark"], r["id"]) for r in self.records}

    @property
    def hidden_size(self) -> int:
        return int(next(iter(self._by_first.values()))[0].hidden.shape[0]) if self._by_first else 8

    @property
    def forward_elsewhere(self) -> bool:
        """Whether the step's forward leaves the host's cores free (a step model's sleep): the
        scheduler's default ``overlap`` (:func:`~toolspec_core.engine.scheduler.forward_overlaps_host`)."""
        return self.step_model is not None

    # ------------------------------------------------------------------ what the engine calls
    def launch(self, plan: StepPlan, pool=None) -> Launched:
        """The step started: its answer looked up now (:meth:`lookup`, the part a GPU step's
        launch stands for), its forward over when the step model says (at once without one)."""
        start = time.perf_counter()
        model = self.step_model
        ms = 0.0 if model is None else model.forward_ms(len(plan.seqs), plan.rows)
        out = self.lookup(plan)
        return Launched(out, max(start + ms / 1000, time.perf_counter()))

    def step(self, plan: StepPlan, pool=None) -> StepOutput:
        """The step's answer, returned when its modelled forward ends (:meth:`launch`)."""
        return self.launch(plan, pool).result()

    def lookup(self, plan: StepPlan) -> StepOutput:
        """The step's argmax read from the recordings, then :func:`~toolspec_core.model.step_runner.answer`
        (the greedy walks and the host's rows), as every target's step ends."""
        segments, logit_rows, full_rows, hidden_rows = (
            plan.segments,
            plan.logits.rows,
            plan.logits.full,
            plan.hidden_rows,
        )
        committed = self._write(segments)  # each segment's cache tokens before its rows
        answers: list[int] = []  # [N] every row's argmax
        hidden_at: dict[int, torch.Tensor] = {}
        for seg, before in zip(segments, committed):
            ids, pos = seg.ids.tolist(), seg.pos.tolist()
            parents = _parents(seg, pos)
            # rows known to be committed: a causal segment's (a prompt chunk, a lone root), else the first root
            rec = self._record(seg.cache, before + (ids if not seg.tree else ids[:1]))
            ok: list[bool] = []
            for i, (t, p) in enumerate(zip(ids, pos)):
                par = parents[i]
                follows = (par < 0 or ok[par]) and rec is not None and p < len(rec.full) and rec.full[p] == t
                ok.append(follows)
                if follows and p + 1 < len(rec.full):
                    answers.append(rec.full[p + 1])
                else:
                    kids = {ids[j] for j in range(i + 1, len(ids)) if parents[j] == i}
                    answers.append(self.off[0] if self.off[0] not in kids else self.off[1])
                if follows and p + 1 == rec.prompt_len:
                    hidden_at[len(answers) - 1] = rec.hidden
        choice = [answers[r] for r in logit_rows]
        logits = None
        if full_rows:
            # one-hot rows for the sequences that read logits (sampling, a grammar, logprobs); a row
            # off the recording is flat (argmax 0, or a grammar's first allowed token): a function of
            # its prefix alone, so a constrained decode is the same whatever was drafted
            vocab = self.model.config.vocab_size
            logits = torch.full((len(full_rows), vocab), -1e4)
            for k, j in enumerate(full_rows):
                if choice[j] in self.off:
                    logits[k] = 0.0
                else:
                    logits[k, choice[j]] = 0.0
        hidden = None
        if hidden_rows:
            hidden = torch.zeros(len(hidden_rows), self.hidden_size)
            for k, r in enumerate(hidden_rows):
                if r in hidden_at:
                    hidden[k] = hidden_at[r]
        return answer(plan, torch.tensor(choice, dtype=torch.long), logits, hidden)

    # ------------------------------------------------------------------ bookkeeping
    def _write(self, segments) -> list[list[int]]:
        """Write each segment's token ids into its cache (every layer's K and V) and advance it;
        returns each cache's committed tokens before the segment (read back from the storage)."""
        out = []
        with torch.inference_mode():
            for seg in segments:
                n = len(seg)
                before = seg.cache.get_seq_length()
                layers, heads, dim = _kv_shape(self.model.config)
                k = seg.ids.to(torch.float32)[None, None, :, None].expand(1, heads, n, dim).contiguous()
                full = None
                for layer in range(layers):
                    full, _ = seg.cache.write(layer, k, k)
                seg.cache.advance(n)
                out.append([int(x) for x in full[0, 0, :before, 0].tolist()])
        return out

    def _record(self, cache, tokens: list[int]) -> _Rec | None:
        """The recording ``cache`` belongs to: its committed ``tokens`` begin the recorded prompt + output."""
        key = id(cache)
        hit = self._owner.get(key)
        if hit is not None and hit[0] is cache and hit[1].full[: len(tokens)] == tokens:
            return hit[1]
        if len(tokens) < 8:
            return None
        found = [r for r in self._by_first.get(tuple(tokens[:8]), ()) if r.full[: len(tokens)] == tokens]
        # a prompt cut short may begin several recordings: only a prompt's own length decides
        mine = [r for r in found if len(tokens) >= r.prompt_len] or (found if len(found) == 1 else [])
        if not mine:
            return None
        rec = max(mine, key=lambda r: r.prompt_len)
        self._owner[key] = (cache, rec)
        return rec


@dataclasses.dataclass
class Launched:
    """A launched replay step: :meth:`result` sleeps (``time.sleep``: the GIL released) to the end
    of its modelled forward; ``done_at`` is then when the forward ended (``perf_counter``: the wake,
    or ``end`` where that had passed), what the scheduler counts as the forward's end."""

    out: StepOutput
    end: float
    done_at: float | None = None

    def result(self) -> StepOutput:
        left = self.end - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.done_at = time.perf_counter()
        else:
            self.done_at = self.end
        return self.out


def _kv_shape(config) -> tuple[int, int, int]:
    from toolspec_core.model.block_pool import kv_shape

    return kv_shape(config)


def _parents(seg, pos: list[int]) -> list[int]:
    """Parent row of each row of a segment (-1: the cache's last committed token): a tree's
    parents as the scheduler draws them, else the previous row (causal rows)."""
    if seg.parents is not None:
        return list(seg.parents)
    return [i - 1 for i in range(len(pos))]


def replay_target(path: str | Path = RECORDING, step_model: StepModel | None = None) -> ReplayTarget:
    """The replay target over the embedded model's tokenizer, serving the recording at ``path``
    (each step lasting ``step_model``'s forward, if given)."""
    from transformers import AutoTokenizer

    from deployments.scripted import tiny_qwen2
    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    rows = load_recording(path, tok)
    base = from_model(tiny_qwen2(tok, hidden=8, layers=1, context=32768), tok, name="replay")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Target)}
    fields["eos_ids"] = tuple(rows[0]["eos_ids"]) if rows and rows[0].get("eos_ids") else base.eos_ids
    return ReplayTarget(
        **fields,
        records=tuple(rows),
        max_new_tokens=min((r["max_new_tokens"] for r in rows), default=0),
        step_model=step_model,
    )


# --------------------------------------------------------------------------- recording


def record(args) -> int:
    """Record plain greedy for the selected items of each data file, ``--batch-size`` at a time,
    appending to ``--out`` (items already there are skipped: an interrupted run resumes)."""
    from benchmarks.data import load_items, prompt_ids, select_items
    from benchmarks.datasets import SINGLE_TURN, dev_set
    from toolspec_core.engine.limits import check_prompt
    from toolspec_core.errors import ToolSpecError
    from toolspec_core.model.target import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(None)
    out = Path(args.out)
    done = set()
    if out.exists():
        done = {(r["benchmark"], r["id"]) for r in load_recording(out)}
    data = args.data or [str(dev_set(name)) for name in SINGLE_TURN]
    # levels: every file's first ``l`` selected items before any file's next ones
    streams = []
    for p in data:
        order: list[dict] = []
        for lim in sorted(set(args.levels + [args.limit])):
            if lim > args.limit:
                continue
            for it in select_items(load_items(p), lim, None if args.seed < 0 else args.seed):
                if it not in order:
                    order.append(it)
        streams.append(order)
    todo = []
    for lim in sorted(set(args.levels + [args.limit])):
        for order in streams:
            for it in order[:lim]:
                if (it["benchmark"], it["id"]) not in done and it not in todo:
                    todo.append(it)
    t0 = time.time()
    for g in range(0, len(todo), args.batch_size):
        group = todo[g : g + args.batch_size]
        prompts = []
        for it in group:
            ids = prompt_ids(target.tokenizer, it)
            try:
                check_prompt(target, ids, args.max_new_tokens)
            except ToolSpecError as exc:
                print(f"skipping {it['id']}: {exc}", file=sys.stderr)
                continue
            prompts.append((it, ids))
        rows = greedy_rows(target, [ids for _, ids in prompts], args.max_new_tokens)
        with gzip.open(out, "at") as f:
            for (it, ids), row in zip(prompts, rows):
                row.pop("prompt_ids")
                f.write(json.dumps({"benchmark": it["benchmark"], "id": it["id"], **row}) + "\n")
        print(f"{g + len(group)}/{len(todo)} items recorded, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


def greedy_rows(target, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Batched plain greedy of ``prompts`` (prefilled and decoded together in one block pool): one
    recording row each (``prompt_ids`` included; the recording file keeps only their hash), with
    the prompt's last state (the retrieval key the scheduler hands each sequence)."""
    from toolspec_core.engine.loop import DecodeConfig
    from toolspec_core.engine.scheduler import BatchLimits, run_batch
    from toolspec_core.engine.sequence import Sequence

    limits = BatchLimits(max_running=max(1, len(prompts)))
    seqs = [Sequence(target, ids, None, DecodeConfig(max_new_tokens=max_new_tokens)) for ids in prompts]
    # each sequence's rows, plus the partial block its table may end in
    pool = target.block_pool(sum(limits.rows_for(len(s.prompt_ids), max_new_tokens) + 16 for s in seqs))
    run_batch(target, seqs, None, limits, pool)
    return [
        {
            "prompt_key": prompt_key(ids),
            "prompt_len": len(ids),
            "prompt_ids": list(ids),
            "tokens": s.result.tokens,
            "finish": s.result.finish_reason,
            "max_new_tokens": max_new_tokens,
            "eos_ids": list(target.eos_ids),
            "hidden": encode_hidden(s.hidden),
        }
        for ids, s in zip(prompts, seqs)
    ]


def replay_over(base: Target, rows: list[dict], step_model: StepModel | None = None) -> ReplayTarget:
    """A replay target serving ``rows`` (with their ``prompt_ids``) on ``base``'s tokenizer and
    model shapes (its forward never runs; ``step_model``: each step lasts its modelled forward)."""
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Target)}
    fields["name"] = "replay"
    return ReplayTarget(
        **fields,
        records=tuple(rows),
        max_new_tokens=min((r["max_new_tokens"] for r in rows), default=0),
        step_model=step_model,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.replay", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record plain greedy of the dev items")
    rec.add_argument("--data", action="append", default=[])
    rec.add_argument("--limit", type=int, default=64, help="items per data file (select_items with --seed)")
    rec.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[16], help="record these first")
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--batch-size", type=int, default=16)
    rec.add_argument("--threads", type=int)
    rec.add_argument("--out", default=str(RECORDING))
    args = ap.parse_args(argv)
    return record(args)


if __name__ == "__main__":
    sys.exit(main())
